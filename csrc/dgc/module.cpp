// aiak_training.dgc._dgc_cpu: threshold selection and sparse scatter-add for deep gradient
// compression (Lin et al., ICLR 2018) on CPU tensors.
//
// Python passes raw data pointers (ints), element counts and DataType codes; no framework
// headers are used, so the module works with any torch version.  The GIL is released while
// the kernels run, so the engine's communication thread keeps going.
//
// Selection order.  Every selection here returns the k largest elements by the total order
// "larger |x| first, then smaller index first", restricted to elements with |x| > 0 (a zero is
// never worth sending, and NaN is never selected).  The sampled path and the exact path
// therefore return the *same* set, whatever the random sample was: sampling only decides how
// much work is needed to find it.  Indices come out in ascending order.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/half.h"
#include "dgc/dgc.h"

namespace py = pybind11;

namespace aiak_dgc {
namespace {

// ---------------------------------------------------------------------------- tuning constants
// The first sampled threshold aims at kOversample * k candidates, so that the scan usually
// finds at least k of them (then no second scan is needed) while the exact refinement over
// the candidates stays cheap.
constexpr double kOversample = 2.0;
// The sample is made large enough to hold at least this many elements above the estimated
// threshold; fewer makes the estimate too noisy (the relative error is about 1/sqrt(count)).
constexpr double kMinSampleTop = 32.0;
// Each failed attempt (fewer than k candidates) lowers the target quantile by this factor.
constexpr double kRetryFactor = 4.0;
constexpr int kAttempts = 3;
// Elements are sampled in contiguous blocks: one cache line per block instead of one per
// element, which makes sampling a 64 MB tensor ~10x cheaper.  Neighbouring gradient elements
// are only weakly correlated, and a poor estimate costs time, never correctness.
constexpr int64_t kBlock = 8;
// Below this size, or above this density, the exact path is as cheap as sampling.
constexpr int64_t kMinSampledN = 1 << 14;
constexpr int64_t kMaxSampledDensityInv = 16;  // sampled only if k * 16 <= n

// ------------------------------------------------------------------------------------ ISA choice
int64_t scan_f32_scalar(const float* x, int64_t n, float t, int32_t* out, int64_t cap);

// The scan kernel for `want` ("" = the best this CPU has); throws if the CPU lacks it.
ScanF32 scan_by_name(const std::string& want) {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2");
  if (want == "scalar") return scan_f32_scalar;
  if (want == "avx2") {
    if (!avx2) throw std::runtime_error("DGC scan: this CPU has no AVX2");
    return scan_f32_avx2;
  }
  if (want == "avx512") {
    if (!avx512) throw std::runtime_error("DGC scan: this CPU has no AVX-512F");
    return scan_f32_avx512;
  }
  if (!want.empty()) throw std::runtime_error("the DGC scan ISA must be scalar, avx2 or avx512");
  if (avx512) return scan_f32_avx512;
  if (avx2) return scan_f32_avx2;
#else
  if (!want.empty() && want != "scalar") throw std::runtime_error("DGC scan: only scalar here");
#endif
  return scan_f32_scalar;
}

ScanF32 g_scan = nullptr;

ScanF32 scan_f32() {
  if (g_scan == nullptr) {  // called with the GIL held: no race
    const char* env = std::getenv("AIAK_DGC_ISA");  // testing/debugging: scalar|avx2|avx512
    g_scan = scan_by_name(env ? env : "");
  }
  return g_scan;
}

std::string isa_name() {
  const ScanF32 s = scan_f32();
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  if (s == scan_f32_avx512) return "avx512";
  if (s == scan_f32_avx2) return "avx2";
#endif
  return "scalar";
}

// ------------------------------------------------------------------------------ portable scan
template <typename T>
inline T absval(T v) {
  return v < T(0) ? -v : v;
}

// |v| for the threshold sample, with NaN as 0: nth_element needs a strict weak order, which
// NaN breaks (undefined behaviour), and NaN is never selected anyway.
template <typename T>
inline T sample_abs(T v) {
  const T a = absval(v);
  return a > T(0) ? a : T(0);
}

template <typename T>
int64_t scan_portable(const T* x, int64_t n, T t, int32_t* out, int64_t cap) {
  int64_t count = 0;
  int64_t i = 0;
  // Blocks of 16: the "any hit?" reduction vectorizes; the per-element loop runs rarely.
  for (; i + 16 <= n; i += 16) {
    int any = 0;
    for (int j = 0; j < 16; ++j) any |= (absval(x[i + j]) >= t);
    if (!any) continue;
    for (int j = 0; j < 16; ++j) {
      if (absval(x[i + j]) >= t) out[count++] = int32_t(i + j);
    }
    if (count > cap) return cap + 1;
  }
  for (; i < n; ++i) {
    if (absval(x[i]) >= t) {
      out[count++] = int32_t(i);
      if (count > cap) return cap + 1;
    }
  }
  return count;
}

int64_t scan_f32_scalar(const float* x, int64_t n, float t, int32_t* out, int64_t cap) {
  return scan_portable<float>(x, n, t, out, cap);
}

template <typename T>
int64_t scan(const T* x, int64_t n, T t, int32_t* out, int64_t cap);
template <>
int64_t scan<float>(const float* x, int64_t n, float t, int32_t* out, int64_t cap) {
  return scan_f32()(x, n, t, out, cap);
}
template <>
int64_t scan<double>(const double* x, int64_t n, double t, int32_t* out, int64_t cap) {
  return scan_portable<double>(x, n, t, out, cap);
}

// -------------------------------------------------------------------------------- selection
struct SelectResult {
  int64_t count;       // indices written
  int path;            // 0 exact; 1..kAttempts sampled, on that attempt; kAttempts+1 fell back
  int64_t candidates;  // elements the exact refinement looked at
};

// Writes to `out`, in ascending order, the k best (selection order) of the m = a.size()
// elements x[idx[j]]; idx is ascending and a[j] holds |x[idx[j]]| > 0 (reordered here).
// Requires m > k.
template <typename T>
void keep_best(const T* x, const int32_t* idx, std::vector<T>& a, int64_t k, int32_t* out) {
  const int64_t m = int64_t(a.size());
  std::nth_element(a.begin(), a.begin() + (k - 1), a.end(), std::greater<T>());
  const T kth = a[k - 1];
  // After nth_element a[0, k-1) >= kth, so every element strictly above kth is in there.
  // Elements equal to kth are ties: the ones with the smallest indices win.
  int64_t greater = 0;
  for (int64_t j = 0; j < k - 1; ++j) greater += (a[j] > kth);
  int64_t ties = k - greater;
  int64_t w = 0;
  for (int64_t j = 0; j < m && w < k; ++j) {
    const T v = absval(x[idx[j]]);
    if (v > kth || (v == kth && ties-- > 0)) out[w++] = idx[j];
  }
}

// Order-preserving integer keys of |x|: for non-negative IEEE values, comparing the bit
// patterns as unsigned integers is comparing the values.  0 means "never select" (zero or
// NaN); +inf is the largest valid key.
template <typename T>
struct Keys;
template <>
struct Keys<float> {
  using K = uint32_t;
  static constexpr int kShift = 15;  // top 16 of the 31 value bits: exponent + 8 mantissa bits
  static K key(float v) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    b &= 0x7FFFFFFFu;
    return b > 0x7F800000u ? 0 : b;  // NaN -> 0
  }
};
template <>
struct Keys<double> {
  using K = uint64_t;
  static constexpr int kShift = 47;
  static K key(double v) {
    uint64_t b;
    std::memcpy(&b, &v, 8);
    b &= 0x7FFFFFFFFFFFFFFFull;
    return b > 0x7FF0000000000000ull ? 0 : b;
  }
};

// Exact top-k over the whole tensor by a radix histogram of the keys' top 16 bits, in three
// passes: histogram; collect the keys of the one bucket that holds the k-th largest and find
// it with nth_element (a small array); write the winners in index order.  About 5x faster
// than nth_element over all of |x|, and than torch.topk, on 16M elements.
template <typename T>
SelectResult exact_select(const T* x, int64_t n, int64_t k, int32_t* out, int path) {
  using K = typename Keys<T>::K;
  constexpr int S = Keys<T>::kShift;
  std::vector<int64_t> hist(size_t(1) << 16, 0);
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const K key = Keys<T>::key(x[i]);
    if (key != 0) {
      ++hist[size_t(key >> S)];
      ++m;
    }
  }
  int64_t w = 0;
  if (m <= k) {
    for (int64_t i = 0; i < n; ++i) {
      if (Keys<T>::key(x[i]) != 0) out[w++] = int32_t(i);
    }
    return {m, path, m};
  }
  // The bucket of the k-th largest key, and how many keys lie in higher buckets.
  int64_t above = 0;
  size_t bucket = hist.size() - 1;
  while (above + hist[bucket] < k) above += hist[bucket--];
  const int64_t need = k - above;  // 1 <= need <= hist[bucket]
  std::vector<K> in_bucket;
  in_bucket.reserve(static_cast<size_t>(hist[bucket]));
  for (int64_t i = 0; i < n; ++i) {
    const K key = Keys<T>::key(x[i]);
    if (key != 0 && size_t(key >> S) == bucket) in_bucket.push_back(key);
  }
  std::nth_element(in_bucket.begin(), in_bucket.begin() + (need - 1), in_bucket.end(),
                   std::greater<K>());
  const K kth = in_bucket[need - 1];
  int64_t greater = 0;  // keys above kth inside the bucket: all in [0, need - 1)
  for (int64_t j = 0; j < need - 1; ++j) greater += (in_bucket[j] > kth);
  int64_t ties = need - greater;  // keys equal to kth to take, smallest indices first
  for (int64_t i = 0; i < n && w < k; ++i) {
    const K key = Keys<T>::key(x[i]);
    if (key > kth || (key == kth && ties-- > 0)) out[w++] = int32_t(i);
  }
  return {k, path, m};
}

inline uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Sampled threshold selection (paper section 5): estimate the threshold from a sample, keep
// every element above it (one scan), then take the exact top-k among those candidates.  If
// the estimate was too high (fewer than k candidates), retry with a lower quantile; if the
// sample is degenerate (zeros, heavy ties) or the retries run out, use the exact path.
template <typename T>
SelectResult sampled_select(const T* x, int64_t n, int64_t k, int32_t* out, double sample_ratio,
                            uint64_t seed) {
  const double density = double(k) / double(n);
  double want = std::max(std::ceil(double(n) * sample_ratio),
                         std::ceil(kMinSampleTop / (kOversample * density)));
  const int64_t blocks = int64_t(std::ceil(want / double(kBlock)));
  const int64_t s = blocks * kBlock;
  if (s * 4 > n) return exact_select(x, n, k, out, 0);  // sampling would not pay

  std::vector<T> sample(static_cast<size_t>(s));
  uint64_t state = seed ^ (uint64_t(n) * 0xD1B54A32D192ED03ull);
  const uint64_t span = uint64_t(n - kBlock + 1);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = int64_t(splitmix64(state) % span);
    for (int64_t j = 0; j < kBlock; ++j) sample[b * kBlock + j] = sample_abs(x[start + j]);
  }

  std::vector<int32_t> cand;
  double oversample = kOversample;
  for (int attempt = 1; attempt <= kAttempts; ++attempt, oversample *= kRetryFactor) {
    const int64_t ks = int64_t(std::ceil(oversample * density * double(s)));
    if (ks >= s) break;
    std::nth_element(sample.begin(), sample.begin() + (ks - 1), sample.end(), std::greater<T>());
    const T t = sample[ks - 1];
    if (!(t > T(0))) break;  // the sample's top reaches zero: the exact path is as cheap
    // Room for 4x the expected candidates; more means the estimate is far off (or ties).
    const int64_t cap = std::max<int64_t>(int64_t(4.0 * oversample * double(k)), 4096);
    cand.resize(static_cast<size_t>(cap + 32));
    const int64_t c = scan<T>(x, n, t, cand.data(), cap);
    if (c > cap) break;
    if (c >= k) {
      if (c == k) {
        std::copy(cand.begin(), cand.begin() + c, out);
      } else {
        std::vector<T> a(static_cast<size_t>(c));
        for (int64_t j = 0; j < c; ++j) a[j] = absval(x[cand[j]]);
        keep_best(x, cand.data(), a, k, out);
      }
      return {k, attempt, c};
    }
  }
  return exact_select(x, n, k, out, kAttempts + 1);
}

template <typename T>
SelectResult select_impl(const T* x, int64_t n, int64_t k, int32_t* out, double sample_ratio,
                         uint64_t seed, bool exact) {
  if (k <= 0 || n <= 0) return {0, 0, 0};
  if (k >= n || exact || n < kMinSampledN || k * kMaxSampledDensityInv > n) {
    return exact_select(x, n, std::min(k, n), out, 0);
  }
  return sampled_select(x, n, k, out, sample_ratio, seed);
}

// ----------------------------------------------------------------------- momentum correction
// One pass for DGC's local accumulation (paper eq. 7), with the same operations, in the same
// order, as the torch-op path in aiak_training/dgc/optimizer.py:
//   g' = g + wd * w;  u = first ? g' : m * u + (1 - dampening) * g';
//   v += u  (nesterov: v = (v + g') + m * u;  no momentum: v += g').
// Reads g, w, u, v once and writes u, v once, instead of torch's ~12 passes over memory.
template <typename T>
void compensate_impl(const T* g, const T* w, T* u, T* v, int64_t n, T m, T damp1, T wd,
                     bool nesterov, bool first) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = g[i];
    if (w != nullptr) gi = gi + wd * w[i];
    if (u == nullptr) {
      v[i] = v[i] + gi;
      continue;
    }
    const T ui = first ? gi : m * u[i] + damp1 * gi;
    u[i] = ui;
    v[i] = nesterov ? (v[i] + gi) + m * ui : v[i] + ui;
  }
}

// The v that compensate_impl would produce at element i, without writing anything.
template <typename T>
inline T next_v(const T* g, const T* w, const T* u, const T* v, int64_t i, T m, T damp1, T wd,
                bool nesterov, bool first) {
  T gi = g[i];
  if (w != nullptr) gi = gi + wd * w[i];
  if (u == nullptr) return v[i] + gi;
  const T ui = first ? gi : m * u[i] + damp1 * gi;
  return nesterov ? (v[i] + gi) + m * ui : v[i] + ui;
}

struct CompensateArgs {
  const void* g;
  const void* w;
  void* u;
  void* v;
  double m, damp1, wd;
  bool nesterov, first;
};

// Momentum correction and selection in one pass over memory: the threshold is estimated
// from a sample of the *updated* v (computed on the fly at the sampled positions), then the
// update runs block by block and each block, still in cache, is scanned for candidates.
// Falls back to "update, then select" whenever the sampled path would.
template <typename T>
SelectResult compensate_select_impl(const CompensateArgs& a, int64_t n, int64_t k, int32_t* out,
                                    double sample_ratio, uint64_t seed, bool exact) {
  const T* g = static_cast<const T*>(a.g);
  const T* w = static_cast<const T*>(a.w);
  T* u = static_cast<T*>(a.u);
  T* v = static_cast<T*>(a.v);
  const T m = T(a.m), damp1 = T(a.damp1), wd = T(a.wd);
  const bool plain = k <= 0 || k >= n || exact || n < kMinSampledN || k * kMaxSampledDensityInv > n;
  const double density = plain ? 1.0 : double(k) / double(n);
  const double want = plain ? 0.0 : std::max(std::ceil(double(n) * sample_ratio),
                                             std::ceil(kMinSampleTop / (kOversample * density)));
  const int64_t blocks = int64_t(std::ceil(want / double(kBlock)));
  const int64_t s = blocks * kBlock;
  if (plain || s * 4 > n) {
    compensate_impl(g, w, u, v, n, m, damp1, wd, a.nesterov, a.first);
    return select_impl(static_cast<const T*>(v), n, k, out, sample_ratio, seed, exact);
  }
  std::vector<T> sample(static_cast<size_t>(s));
  uint64_t state = seed ^ (uint64_t(n) * 0xD1B54A32D192ED03ull);
  const uint64_t span = uint64_t(n - kBlock + 1);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = int64_t(splitmix64(state) % span);
    for (int64_t j = 0; j < kBlock; ++j) {
      const T nv = next_v(g, w, u, v, start + j, m, damp1, wd, a.nesterov, a.first);
      sample[b * kBlock + j] = sample_abs(nv);
    }
  }
  const int64_t ks = int64_t(std::ceil(kOversample * density * double(s)));
  T t = T(0);
  if (ks < s) {
    std::nth_element(sample.begin(), sample.begin() + (ks - 1), sample.end(), std::greater<T>());
    t = sample[ks - 1];
  }
  if (!(t > T(0))) {  // degenerate sample: update, then the usual selection
    compensate_impl(g, w, u, v, n, m, damp1, wd, a.nesterov, a.first);
    return select_impl(static_cast<const T*>(v), n, k, out, sample_ratio, seed, exact);
  }
  const int64_t cap = std::max<int64_t>(int64_t(4.0 * kOversample * double(k)), 4096);
  std::vector<int32_t> cand(static_cast<size_t>(cap + 32));
  int64_t c = 0;
  constexpr int64_t kChunk = 2048;  // g, u, v, w blocks of 8 KB each stay in L1/L2
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    compensate_impl(g + i0, w ? w + i0 : nullptr, u ? u + i0 : nullptr, v + i0, len, m, damp1,
                    wd, a.nesterov, a.first);
    if (c <= cap) {
      const int64_t found = scan<T>(v + i0, len, t, cand.data() + c, cap - c);
      for (int64_t j = c; j < c + std::min(found, cap - c + 1); ++j) cand[j] += int32_t(i0);
      c += found;  // > cap: overflow, stop collecting (the update goes on)
    }
  }
  if (c > cap || c < k) {
    // The estimate was far off (ties, or too few above it): v is updated, select normally.
    SelectResult r = select_impl(static_cast<const T*>(v), n, k, out, sample_ratio, seed, exact);
    if (r.path == 1) r.path = 2;  // it took a second scan
    return r;
  }
  if (c == k) {
    std::copy(cand.begin(), cand.begin() + c, out);
  } else {
    std::vector<T> av(static_cast<size_t>(c));
    for (int64_t j = 0; j < c; ++j) av[j] = absval(v[cand[j]]);
    keep_best(static_cast<const T*>(v), cand.data(), av, k, out);
  }
  return {k, 1, c};
}

// ------------------------------------------------------------------------------- wire values
int64_t wire_size(int code) {
  if (code != FLOAT32 && code != FLOAT64 && code != FLOAT16) {
    throw std::invalid_argument("unknown DGC dtype code " + std::to_string(code));
  }
  return aiak::itemsize(code);
}

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

template <typename Out>
void add_values(Out* out, int64_t numel, const uint8_t* idx_bytes, const uint8_t* val_bytes,
                int64_t count, int wire, Out scale) {
  for (int64_t j = 0; j < count; ++j) {
    int32_t i;
    std::memcpy(&i, idx_bytes + 4 * j, 4);
    if (i == -1) continue;  // an empty slot (a tensor with fewer pairs than slots)
    if (i < 0 || i >= numel) {
      throw std::runtime_error("DGC exchange: index " + std::to_string(i) +
                               " out of range for a tensor of " + std::to_string(numel) +
                               " elements (ranks disagree on the compressed tensors?)");
    }
    if (wire == FLOAT32) {
      float v;
      std::memcpy(&v, val_bytes + 4 * j, 4);
      out[i] += Out(v) * scale;
    } else if (wire == FLOAT64) {
      double v;
      std::memcpy(&v, val_bytes + 8 * j, 8);
      out[i] += Out(v) * scale;
    } else {
      uint16_t h;
      std::memcpy(&h, val_bytes + 2 * j, 2);
      out[i] += Out(aiak::half_to_float(h)) * scale;
    }
  }
}

// Parses the allgathered buffer (one segment per rank, layout in aiak_training/dgc/exchange.py)
// and adds every rank's values, times `scale` (1/N for an average: scaling the pairs is
// cheaper than a pass over the dense outputs), into the dense outputs.  Ranks are visited in
// order, so every rank adds the same numbers in the same order and gets bit-identical sums.
int64_t scatter_add_segments(uintptr_t buf_addr, int64_t nbytes, int64_t nranks,
                             const std::vector<uintptr_t>& outs, const std::vector<int64_t>& numels,
                             const std::vector<int>& out_codes, const std::vector<int>& wire_codes,
                             double scale) {
  const size_t T = outs.size();
  if (numels.size() != T || out_codes.size() != T || wire_codes.size() != T) {
    throw std::invalid_argument("scatter_add_segments: per-tensor lists differ in length");
  }
  const uint8_t* buf = reinterpret_cast<const uint8_t*>(buf_addr);
  std::vector<int32_t> counts(T);
  std::vector<int64_t> val_off(T);
  int64_t off = 0, pairs = 0;
  for (int64_t r = 0; r < nranks; ++r) {
    const int64_t seg = off;
    if (seg + int64_t(4 * T) > nbytes) throw std::runtime_error("DGC exchange: truncated header");
    if (T) std::memcpy(counts.data(), buf + seg, 4 * T);
    int64_t total = 0;
    for (size_t t = 0; t < T; ++t) {
      if (counts[t] < 0 || counts[t] > numels[t]) {
        throw std::runtime_error("DGC exchange: corrupt header (count " +
                                 std::to_string(counts[t]) + ")");
      }
      total += counts[t];
    }
    const int64_t idx_off = seg + 4 * int64_t(T);
    int64_t p = idx_off + 4 * total;
    for (size_t t = 0; t < T; ++t) {
      const int64_t w = wire_size(wire_codes[t]);
      p = seg + align_up(p - seg, w);
      val_off[t] = p;
      p += w * counts[t];
    }
    off = seg + align_up(p - seg, 8);
    if (off > nbytes) throw std::runtime_error("DGC exchange: segment runs past the buffer");
    int64_t io = idx_off;
    for (size_t t = 0; t < T; ++t) {
      if (out_codes[t] == FLOAT32) {
        add_values(reinterpret_cast<float*>(outs[t]), numels[t], buf + io, buf + val_off[t],
                   counts[t], wire_codes[t], float(scale));
      } else if (out_codes[t] == FLOAT64) {
        add_values(reinterpret_cast<double*>(outs[t]), numels[t], buf + io, buf + val_off[t],
                   counts[t], wire_codes[t], scale);
      } else {
        throw std::invalid_argument("scatter_add_segments: outputs must be float32 or float64");
      }
      io += 4 * int64_t(counts[t]);
    }
    pairs += total;
  }
  if (off != nbytes) {
    throw std::runtime_error("DGC exchange: " + std::to_string(nbytes - off) +
                             " bytes left after " + std::to_string(nranks) + " segments");
  }
  return pairs;
}

}  // namespace
}  // namespace aiak_dgc

PYBIND11_MODULE(_dgc_cpu, m) {
  using namespace aiak_dgc;
  m.doc() = "DGC threshold selection and sparse scatter-add on raw CPU pointers";
  m.def(
      "select_topk",
      [](uintptr_t x, int64_t n, int dtype, int64_t k, uintptr_t out, double sample_ratio,
         uint64_t seed, bool exact) {
        if (n > int64_t(INT32_MAX)) throw std::invalid_argument("select_topk: n exceeds int32");
        SelectResult r;
        {
          (void)scan_f32();  // resolve the ISA with the GIL held
          py::gil_scoped_release nogil;
          if (dtype == FLOAT32) {
            r = select_impl(reinterpret_cast<const float*>(x), n, k,
                            reinterpret_cast<int32_t*>(out), sample_ratio, seed, exact);
          } else if (dtype == FLOAT64) {
            r = select_impl(reinterpret_cast<const double*>(x), n, k,
                            reinterpret_cast<int32_t*>(out), sample_ratio, seed, exact);
          } else {
            throw std::invalid_argument("select_topk: float32 or float64 only");
          }
        }
        return py::make_tuple(r.count, r.path, r.candidates);
      },
      py::arg("x"), py::arg("n"), py::arg("dtype"), py::arg("k"), py::arg("out"),
      py::arg("sample_ratio"), py::arg("seed"), py::arg("exact"),
      "Top-k of |x| (ties: smaller index first; zeros and NaN never selected) into the int32 "
      "buffer `out` (room for k), ascending.  Returns (count, path, candidates): path 0 is the "
      "exact path, 1-3 the sampled attempt that succeeded, 4 a sampled fallback to exact.");
  m.def(
      "scatter_add_segments",
      [](uintptr_t buf, int64_t nbytes, int64_t nranks, const std::vector<uintptr_t>& outs,
         const std::vector<int64_t>& numels, const std::vector<int>& out_codes,
         const std::vector<int>& wire_codes, double scale) {
        py::gil_scoped_release nogil;
        return scatter_add_segments(buf, nbytes, nranks, outs, numels, out_codes, wire_codes,
                                    scale);
      },
      py::arg("buf"), py::arg("nbytes"), py::arg("nranks"), py::arg("outs"), py::arg("numels"),
      py::arg("out_codes"), py::arg("wire_codes"), py::arg("scale") = 1.0,
      "Add every rank's (index, value) pairs, times `scale`, from an allgathered DGC buffer "
      "into dense outputs; returns the number of pairs.");
  m.def(
      "compensate",
      [](uintptr_t g, uintptr_t w, uintptr_t u, uintptr_t v, int64_t n, int dtype,
         double momentum, double dampening, double weight_decay, bool nesterov, bool first) {
        py::gil_scoped_release nogil;
        if (dtype == FLOAT32) {
          compensate_impl(reinterpret_cast<const float*>(g), reinterpret_cast<const float*>(w),
                          reinterpret_cast<float*>(u), reinterpret_cast<float*>(v), n,
                          float(momentum), float(1.0 - dampening), float(weight_decay),
                          nesterov, first);
        } else if (dtype == FLOAT64) {
          compensate_impl(reinterpret_cast<const double*>(g), reinterpret_cast<const double*>(w),
                          reinterpret_cast<double*>(u), reinterpret_cast<double*>(v), n,
                          momentum, 1.0 - dampening, weight_decay, nesterov, first);
        } else {
          throw std::invalid_argument("compensate: float32 or float64 only");
        }
      },
      py::arg("g"), py::arg("w"), py::arg("u"), py::arg("v"), py::arg("n"), py::arg("dtype"),
      py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"),
      py::arg("first"),
      "DGC momentum correction in one pass: g' = g + wd*w; u = m*u + (1-d)*g' (u = g' if "
      "first); v += u (nesterov: v += g' + m*u).  w = 0 when wd = 0; u = 0 when m = 0.");
  m.def(
      "compensate_select",
      [](uintptr_t g, uintptr_t w, uintptr_t u, uintptr_t v, int64_t n, int dtype,
         double momentum, double dampening, double weight_decay, bool nesterov, bool first,
         int64_t k, uintptr_t out, double sample_ratio, uint64_t seed, bool exact) {
        if (n > int64_t(INT32_MAX)) {
          throw std::invalid_argument("compensate_select: n exceeds int32");
        }
        const CompensateArgs a{reinterpret_cast<const void*>(g), reinterpret_cast<const void*>(w),
                               reinterpret_cast<void*>(u), reinterpret_cast<void*>(v),
                               momentum, 1.0 - dampening, weight_decay, nesterov, first};
        SelectResult r;
        {
          (void)scan_f32();
          py::gil_scoped_release nogil;
          if (dtype == FLOAT32) {
            r = compensate_select_impl<float>(a, n, k, reinterpret_cast<int32_t*>(out),
                                              sample_ratio, seed, exact);
          } else if (dtype == FLOAT64) {
            r = compensate_select_impl<double>(a, n, k, reinterpret_cast<int32_t*>(out),
                                               sample_ratio, seed, exact);
          } else {
            throw std::invalid_argument("compensate_select: float32 or float64 only");
          }
        }
        return py::make_tuple(r.count, r.path, r.candidates);
      },
      "compensate() followed by select_topk() on v, fused into one pass over memory when the "
      "sampled path applies.  Same results as the two calls; returns (count, path, candidates).");
  m.def("isa", &isa_name, "The scan implementation in use: scalar, avx2 or avx512.");
  m.def(
      "set_isa",
      [](const std::string& name) {
        const std::string previous = isa_name();
        g_scan = scan_by_name(name == "auto" ? "" : name);
        return previous;
      },
      py::arg("name"),
      "Use the scan for `name` (scalar, avx2, avx512, or auto); returns the previous one.  "
      "For tests and benchmarks; raises if this CPU lacks the ISA.");
  m.attr("ATTEMPTS") = kAttempts;
}
