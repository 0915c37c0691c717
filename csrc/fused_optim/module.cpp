// aiak_training.fused_optim._cpu: multi-tensor fused optimizer steps for CPU tensors.
//
// Python passes raw data pointers (ints), element counts and a DataType code (common/dtypes.h);
// no framework headers are used, so the module works with any torch version.
//
// Work is split into fixed-size chunks over all tensors of a call and handed out to threads:
// torch's own OpenMP threads where Python found torch's OpenMP runtime in the process
// (use_openmp), else a small persistent pool of our own.  The caller says how many threads
// to use (torch.get_num_threads()), so several ranks on one machine do not oversubscribe it.
// The GIL is released while the kernels run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fused_optim/fused_optim.h"

namespace py = pybind11;

namespace aiak_fo {
namespace {

// Elements per work item.  A multiple of every vector width; big enough that the atomic
// hand-out costs nothing against ~100 KB-1 MB of memory traffic, small enough to balance load.
constexpr int64_t kChunk = 32768;
// Below this many elements in a call, threads cost more than they save.
constexpr int64_t kMinParallel = 65536;

// ---------------------------------------------------------------------------------- ISA choice
const KernelTable* detect_best() {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return avx512_table();
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return avx2_table();
  }
#endif
  return scalar_table();
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out{"scalar"};
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx2) out.push_back("avx2");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    out.push_back("avx512");
  }
#endif
  return out;
}

const KernelTable* table_by_name(const std::string& name) {
  const auto ok = supported_isas();
  if (std::find(ok.begin(), ok.end(), name) == ok.end()) {
    throw std::invalid_argument("ISA '" + name + "' is not supported on this machine");
  }
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  if (name == "avx512") return avx512_table();
  if (name == "avx2") return avx2_table();
#endif
  return scalar_table();
}

std::atomic<const KernelTable*> g_table{nullptr};
// True once AIAK_FUSED_OPTIM_ISA or set_isa() chose the path: it then runs every call.
std::atomic<bool> g_isa_forced{false};

bool cpu_is_amd() {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}

const KernelTable* table() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (t == nullptr) {
    const char* env = std::getenv("AIAK_FUSED_OPTIM_ISA");  // for testing/debugging
    t = (env && *env) ? table_by_name(env) : detect_best();
    if (env && *env) g_isa_forced.store(true);
    g_table.store(t, std::memory_order_release);
  }
  return t;
}

// The kernels of a call on `threads` threads.  On AMD CPUs a multi-threaded call runs the
// AVX2 kernels even where AVX-512 is available: on the project's Zen 5 VMs (2 vCPUs), one
// 16M-element Adam step on 2 threads took 0.94-0.97x torch's fused Adam's time with AVX2 and
// 0.96-1.35x with AVX-512, in three interleaved runs with rotated order; on 1 thread both were
// the same.  Every path gives the same bits.
const KernelTable* table_for(int threads) {
  const KernelTable* t = table();
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  static const bool amd = cpu_is_amd();
  if (threads > 1 && amd && t == avx512_table() && !g_isa_forced.load(std::memory_order_relaxed)) {
    return avx2_table();
  }
#endif
  return t;
}

// --------------------------------------------------------------------------------- thread pool
// A persistent pool: worker threads sleep on a condition variable between calls, so an idle
// optimizer costs no CPU.  Work items are handed out dynamically, and the caller waits only
// for helpers that actually joined the call: on a shared machine a helper may get no CPU for
// a while, and the caller (or a faster helper) then does its share instead of waiting for it.
// After fork() the child has no workers; the pool notices the pid change and builds a fresh
// one (the old object is leaked on purpose: its mutexes may be held).
class Pool {
 public:
  // Runs fn(i) for i in [0, n) on up to `threads` threads (the caller is one of them).
  void run(int threads, int64_t n, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> call_lock(call_mu_);  // one parallel call at a time
    const int helpers = int(std::max<int64_t>(0, std::min<int64_t>(threads, n) - 1));
    grow(helpers);
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      wanted_ = helpers;
      open_ = true;
      ++generation_;
    }
    cv_work_.notify_all();
    drain();
    std::unique_lock<std::mutex> lk(mu_);
    open_ = false;  // helpers that wake up from now on skip this call
    cv_done_.wait(lk, [&] { return joined_ == 0; });
    fn_ = nullptr;
  }

 private:
  void drain() {
    for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i);
  }

  void grow(int count) {
    while (int(workers_.size()) < count) {
      const int id = int(workers_.size());
      workers_.emplace_back([this, id] { worker(id); });
    }
  }

  void worker(int id) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_work_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        if (!open_ || id >= wanted_) continue;  // call already finished, or not needed
        ++joined_;
      }
      drain();
      std::lock_guard<std::mutex> lk(mu_);
      if (--joined_ == 0) cv_done_.notify_all();
    }
  }

  std::mutex call_mu_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int wanted_ = 0;   // helpers asked to join the current call
  int joined_ = 0;   // helpers currently inside the current call
  bool open_ = false;
  uint64_t generation_ = 0;
};

// ------------------------------------------------------------------------ torch's OpenMP threads
// An optimizer step comes right after backward, whose torch kernels leave torch's OpenMP
// threads spinning on the other cores for a while.  A helper of our own pool then waits for a
// core until they stop, and the step runs on one thread: on a 2-vCPU VM, FusedAdam right
// after a torch op took 1.38x as long as torch's fused Adam (adam_vs_torch_fused_cpu 0.72 with
// --pattern after_torch_op).  Running the chunks on those same threads, through the C entry
// point that OpenMP runtimes export for a parallel region, avoids the contest (and the second
// set of threads).  It is a C ABI, stable across GCC's libgomp versions and also exported by
// LLVM's libomp; no torch C++ symbol is involved.
using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
std::atomic<GompParallel> g_gomp_parallel{nullptr};

struct OmpCall {
  const std::function<void(int64_t)>* fn;
  int64_t n;
  std::atomic<int64_t> next{0};
};

void omp_body(void* data) {  // every thread of the region takes items until none are left
  auto* call = static_cast<OmpCall*>(data);
  for (int64_t i = call->next.fetch_add(1); i < call->n; i = call->next.fetch_add(1)) {
    (*call->fn)(i);
  }
}

// GNU OpenMP is not fork-safe: a child of a process whose OpenMP threads ran hangs in its
// first parallel region (torch's own ops too).  Our pool rebuilds itself after fork(), so a
// child goes back to it.
void forget_openmp_in_child() { g_gomp_parallel.store(nullptr); }

// Use the OpenMP runtime at `path`, already loaded in this process (by torch), for parallel
// calls; "" goes back to our own pool.  False (and our own pool) if it is not loaded or has
// no GOMP_parallel.
bool use_openmp(const std::string& path) {
  static const bool at_fork = pthread_atfork(nullptr, nullptr, forget_openmp_in_child) == 0;
  (void)at_fork;
  if (path.empty()) {
    g_gomp_parallel.store(nullptr);
    return false;
  }
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);  // never loads a second copy
  void* sym = handle != nullptr ? dlsym(handle, "GOMP_parallel") : nullptr;
  g_gomp_parallel.store(reinterpret_cast<GompParallel>(sym));
  return sym != nullptr;
}

Pool* g_pool = nullptr;
pid_t g_pool_pid = 0;
std::mutex g_pool_mu;

Pool& pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (g_pool == nullptr || g_pool_pid != getpid()) {
    g_pool = new Pool();  // never deleted: workers live until process exit
    g_pool_pid = getpid();
  }
  return *g_pool;
}

struct Chunk {
  int32_t tensor;
  int64_t begin, end;
};

// Work items: pieces of at most `chunk` elements of each tensor.  The chunk grows with the
// call so that each thread gets about kItemsPerThread long pieces: long sequential runs keep
// the hardware prefetchers streaming, while several pieces per thread still let a thread that
// loses its core to another process hand its share to the others.
constexpr int64_t kItemsPerThread = 8;

int64_t chunk_size(const std::vector<int64_t>& numels, int threads) {
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  const int64_t per_item = total / (std::max(threads, 1) * kItemsPerThread);
  return std::max(kChunk, (per_item + kChunk - 1) / kChunk * kChunk);  // keep a multiple of kChunk
}

std::vector<Chunk> make_chunks(const std::vector<int64_t>& numels, int64_t chunk = kChunk) {
  std::vector<Chunk> out;
  for (size_t t = 0; t < numels.size(); ++t) {
    for (int64_t b = 0; b < numels[t]; b += chunk) {
      out.push_back({int32_t(t), b, std::min(numels[t], b + chunk)});
    }
  }
  return out;
}

// Largest pieces first (LPT order): with dynamic hand-out the small pieces then fill the gaps
// at the end, instead of one thread finishing a big last tensor while the others idle.  Only
// for elementwise updates, where the order of the pieces cannot change any result.
std::vector<Chunk> make_balanced_chunks(const std::vector<int64_t>& numels, int threads) {
  std::vector<Chunk> out = make_chunks(numels, chunk_size(numels, threads));
  std::stable_sort(out.begin(), out.end(), [](const Chunk& a, const Chunk& b) {
    return (a.end - a.begin) > (b.end - b.begin);
  });
  return out;
}

void parallel_chunks(int threads, const std::vector<Chunk>& chunks,
                     const std::function<void(const Chunk&, int64_t)>& fn) {
  int64_t total = 0;
  for (const auto& c : chunks) total += c.end - c.begin;
  if (threads <= 1 || total < kMinParallel || chunks.size() < 2) {
    for (size_t i = 0; i < chunks.size(); ++i) fn(chunks[i], int64_t(i));
    return;
  }
  const std::function<void(int64_t)> item = [&](int64_t i) { fn(chunks[size_t(i)], i); };
  if (GompParallel gomp = g_gomp_parallel.load()) {
    OmpCall call{&item, int64_t(chunks.size())};
    gomp(omp_body, &call, unsigned(threads), 0);
    return;
  }
  pool().run(threads, int64_t(chunks.size()), item);
}

// ------------------------------------------------------------------------------- validation
void* ptr(int64_t v) { return reinterpret_cast<void*>(static_cast<intptr_t>(v)); }

void check_dtype(int dtype) {
  if (dtype != FLOAT32 && dtype != FLOAT16 && dtype != BFLOAT16 && dtype != FLOAT64)
    throw std::invalid_argument("unsupported dtype code " + std::to_string(dtype));
}

void check_len(const std::vector<int64_t>& v, size_t n, const char* what, bool optional) {
  if (optional && v.empty()) return;
  if (v.size() != n) {
    throw std::invalid_argument(std::string(what) + ": expected " + std::to_string(n) +
                                " pointers, got " + std::to_string(v.size()));
  }
}

template <class Fn>
Fn pick(Fn const (&entries)[kNumDataTypes], Fn const (&fallback)[kNumDataTypes], int dtype) {
  return entries[dtype] ? entries[dtype] : fallback[dtype];
}

// ------------------------------------------------------------------------------------- Adam
void adam(const std::vector<int64_t>& params, const std::vector<int64_t>& grads,
          const std::vector<int64_t>& exp_avgs, const std::vector<int64_t>& exp_avg_sqs,
          const std::vector<int64_t>& max_exp_avg_sqs, const std::vector<int64_t>& masters,
          const std::vector<int64_t>& steps, const std::vector<int64_t>& numels, int dtype,
          double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
          bool amsgrad, bool maximize, double grad_scale, int threads) {
  const size_t n = params.size();
  check_dtype(dtype);
  check_len(grads, n, "grads", false);
  check_len(exp_avgs, n, "exp_avgs", false);
  check_len(exp_avg_sqs, n, "exp_avg_sqs", false);
  check_len(max_exp_avg_sqs, n, "max_exp_avg_sqs", !amsgrad);
  check_len(masters, n, "master_params", true);
  check_len(steps, n, "steps", false);
  check_len(numels, n, "numels", false);
  const AdamFn fn = pick(table_for(threads)->adam, scalar_table()->adam, dtype);

  std::vector<AdamArgs> args(n);
  std::vector<AdamPtrs> ptrs(n);
  for (size_t t = 0; t < n; ++t) {
    // Per-parameter step, incremented here exactly like `state_steps[i] += 1` in torch.
    float* step = static_cast<float*>(ptr(steps[t]));
    *step += 1.0f;
    const double s = double(*step);
    const double bc1 = 1.0 - std::pow(beta1, s);
    const double bc2 = 1.0 - std::pow(beta2, s);
    AdamArgs& a = args[t];
    a.beta1 = beta1;
    a.beta2 = beta2;
    a.eps = eps;
    a.weight_decay = weight_decay;
    a.lerp_weight = 1.0 - beta1;
    a.one_minus_beta2 = 1.0 - beta2;
    a.step_size = lr / bc1;
    a.bc2_sqrt = std::pow(bc2, 0.5);  // Python's `bias_correction2 ** 0.5`
    a.decay = 1.0 - lr * weight_decay;
    a.inv_scale = grad_scale > 0 ? 1.0 / grad_scale : 1.0;
    a.adamw = adamw;
    a.amsgrad = amsgrad;
    a.maximize = maximize;
    a.unscale = grad_scale > 0;
    ptrs[t] = {ptr(params[t]), ptr(grads[t]), ptr(exp_avgs[t]), ptr(exp_avg_sqs[t]),
               amsgrad ? ptr(max_exp_avg_sqs[t]) : nullptr,
               masters.empty() ? nullptr : ptr(masters[t])};
  }
  parallel_chunks(threads, make_balanced_chunks(numels, threads),
                  [&](const Chunk& c, int64_t) { fn(args[c.tensor], ptrs[c.tensor], c.begin, c.end); });
}

// -------------------------------------------------------------------------------------- SGD
void sgd(const std::vector<int64_t>& params, const std::vector<int64_t>& grads,
         const std::vector<int64_t>& bufs, const std::vector<int64_t>& masters,
         const std::vector<int64_t>& first, const std::vector<int64_t>& numels, int dtype,
         double lr, double momentum, double dampening, double weight_decay, bool nesterov,
         bool maximize, double grad_scale, int threads) {
  const size_t n = params.size();
  check_dtype(dtype);
  check_len(grads, n, "grads", false);
  check_len(bufs, n, "momentum_buffers", momentum == 0);
  check_len(masters, n, "master_params", true);
  check_len(first, n, "first_step_flags", momentum == 0);
  check_len(numels, n, "numels", false);
  const SgdFn fn = pick(table_for(threads)->sgd, scalar_table()->sgd, dtype);
  SgdArgs a{lr, momentum, dampening, weight_decay, grad_scale > 0 ? 1.0 / grad_scale : 1.0,
            nesterov, maximize, grad_scale > 0};
  std::vector<SgdPtrs> ptrs(n);
  for (size_t t = 0; t < n; ++t) {
    ptrs[t] = {ptr(params[t]), ptr(grads[t]), momentum != 0 ? ptr(bufs[t]) : nullptr,
               masters.empty() ? nullptr : ptr(masters[t]),
               momentum != 0 && first[t] != 0};
  }
  parallel_chunks(threads, make_balanced_chunks(numels, threads),
                  [&](const Chunk& c, int64_t) { fn(a, ptrs[c.tensor], c.begin, c.end); });
}

// ------------------------------------------------------------------------------------- LAMB
// Returns the per-tensor (||p||, ||update||) used for the trust ratios, for inspection.
std::vector<std::pair<double, double>> lamb(
    const std::vector<int64_t>& params, const std::vector<int64_t>& grads,
    const std::vector<int64_t>& exp_avgs, const std::vector<int64_t>& exp_avg_sqs,
    const std::vector<int64_t>& masters, const std::vector<int64_t>& steps,
    const std::vector<int64_t>& numels, int dtype, double lr, double beta1, double beta2,
    double eps, double weight_decay, bool bias_correction, bool grad_averaging,
    bool adam_w_mode, bool use_nvlamb, double clip, double grad_scale, int threads) {
  const size_t n = params.size();
  check_dtype(dtype);
  check_len(grads, n, "grads", false);
  check_len(exp_avgs, n, "exp_avgs", false);
  check_len(exp_avg_sqs, n, "exp_avg_sqs", false);
  check_len(masters, n, "master_params", true);
  check_len(steps, n, "steps", false);
  check_len(numels, n, "numels", false);
  const Lamb1Fn fn1 = pick(table_for(threads)->lamb1, scalar_table()->lamb1, dtype);
  const Lamb2Fn fn2 = pick(table_for(threads)->lamb2, scalar_table()->lamb2, dtype);
  const double inv_scale = grad_scale > 0 ? 1.0 / grad_scale : 1.0;

  std::vector<LambArgs> args(n);
  std::vector<LambPtrs> ptrs(n);
  for (size_t t = 0; t < n; ++t) {
    float* step = static_cast<float*>(ptr(steps[t]));
    *step += 1.0f;
    const double s = double(*step);
    LambArgs& a = args[t];
    a.beta1 = beta1;
    a.beta2 = beta2;
    a.beta3 = grad_averaging ? 1.0 - beta1 : 1.0;
    a.eps = eps;
    a.weight_decay = weight_decay;
    a.bc1 = bias_correction ? 1.0 - std::pow(beta1, s) : 1.0;
    a.bc2 = bias_correction ? 1.0 - std::pow(beta2, s) : 1.0;
    a.grad_factor = inv_scale / clip;
    a.inv_scale = inv_scale;
    a.ratio = lr;
    a.adam_w_mode = adam_w_mode;
    a.unscale = grad_scale > 0;
    ptrs[t] = {ptr(params[t]), ptr(grads[t]), ptr(exp_avgs[t]), ptr(exp_avg_sqs[t]),
               masters.empty() ? nullptr : ptr(masters[t])};
  }
  const std::vector<Chunk> chunks = make_chunks(numels);
  std::vector<double> psq(chunks.size()), usq(chunks.size());
  parallel_chunks(threads, chunks, [&](const Chunk& c, int64_t i) {
    fn1(args[c.tensor], ptrs[c.tensor], c.begin, c.end, &psq[size_t(i)], &usq[size_t(i)]);
  });
  // Reduce per tensor in chunk order: the result does not depend on thread scheduling, so
  // every rank of a data-parallel job computes bit-identical trust ratios.
  std::vector<double> pn(n, 0.0), un(n, 0.0);
  for (size_t i = 0; i < chunks.size(); ++i) {
    pn[size_t(chunks[i].tensor)] += psq[i];
    un[size_t(chunks[i].tensor)] += usq[i];
  }
  std::vector<std::pair<double, double>> norms(n);
  for (size_t t = 0; t < n; ++t) {
    const double p_norm = std::sqrt(pn[t]), u_norm = std::sqrt(un[t]);
    norms[t] = {p_norm, u_norm};
    double trust = 1.0;
    if ((use_nvlamb || weight_decay != 0) && p_norm > 0 && u_norm > 0) trust = p_norm / u_norm;
    args[t].ratio = lr * trust;
  }
  parallel_chunks(threads, chunks, [&](const Chunk& c, int64_t) {
    fn2(args[c.tensor], ptrs[c.tensor], c.begin, c.end);
  });
  return norms;
}

// Sum of squares of each tensor (double), e.g. for a global gradient norm.
std::vector<double> sum_squares(const std::vector<int64_t>& tensors,
                                const std::vector<int64_t>& numels, int dtype, int threads) {
  check_dtype(dtype);
  check_len(numels, tensors.size(), "numels", false);
  const SumSqFn fn = pick(table_for(threads)->sumsq, scalar_table()->sumsq, dtype);
  const std::vector<Chunk> chunks = make_chunks(numels);
  std::vector<double> part(chunks.size());
  parallel_chunks(threads, chunks, [&](const Chunk& c, int64_t i) {
    part[size_t(i)] = fn(ptr(tensors[size_t(c.tensor)]), c.begin, c.end);
  });
  std::vector<double> out(tensors.size(), 0.0);
  for (size_t i = 0; i < chunks.size(); ++i) out[size_t(chunks[i].tensor)] += part[i];
  return out;
}

}  // namespace
}  // namespace aiak_fo

PYBIND11_MODULE(_cpu, m) {
  using namespace aiak_fo;
  m.doc() = "Fused multi-tensor optimizer kernels for CPU (raw pointers; no torch C++ API).";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("adam", &adam, nogil, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"), py::arg("master_params"),
        py::arg("steps"), py::arg("numels"), py::arg("dtype"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("adamw"), py::arg("amsgrad"), py::arg("maximize"), py::arg("grad_scale"),
        py::arg("threads"),
        "Adam/AdamW step over many tensors.  steps are float32 scalars, incremented in place.");
  m.def("sgd", &sgd, nogil, py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"),
        py::arg("master_params"), py::arg("first_step"), py::arg("numels"), py::arg("dtype"),
        py::arg("lr"), py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"),
        py::arg("nesterov"), py::arg("maximize"), py::arg("grad_scale"), py::arg("threads"),
        "SGD step (momentum, dampening, nesterov, weight decay) over many tensors.");
  m.def("lamb", &lamb, nogil, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("master_params"), py::arg("steps"), py::arg("numels"),
        py::arg("dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("bias_correction"), py::arg("grad_averaging"),
        py::arg("adam_w_mode"), py::arg("use_nvlamb"), py::arg("clip"),
        py::arg("grad_scale"), py::arg("threads"),
        "LAMB step over many tensors; returns per-tensor (param_norm, update_norm).");
  m.def("sum_squares", &sum_squares, nogil, py::arg("tensors"), py::arg("numels"),
        py::arg("dtype"), py::arg("threads"), "Per-tensor sum of squares (float64).");
  m.def("isa", [](int threads) { return std::string(table_for(threads)->name); },
        py::arg("threads") = 1, "SIMD path a call on this many threads uses.");
  m.def("supported_isas", &supported_isas, "SIMD paths this machine can run.");
  m.def("use_openmp", &use_openmp, py::arg("path"),
        "Run parallel calls on the threads of the OpenMP runtime at path (loaded already); "
        "'' for the module's own pool.  Returns whether the runtime is used.");
  m.def("threads_backend", [] { return std::string(g_gomp_parallel.load() ? "openmp" : "pool"); },
        "Where parallel calls run: 'openmp' (torch's OpenMP threads) or 'pool' (our own).");
  m.def("set_isa", [](const std::string& name) {
          g_table.store(table_by_name(name));
          g_isa_forced.store(true);
        },
        py::arg("name"), "Force a SIMD path ('scalar', 'avx2', 'avx512'); for tests.");
  m.attr("CHUNK") = py::int_(kChunk);
}
