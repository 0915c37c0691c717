// Kernel bodies shared by every ISA translation unit.
//
// This file is included *inside an anonymous namespace* of each kernels_*.cpp, after that file
// has defined three "ops" structs:
//   VO  vector float ops (W lanes),   SO  scalar float ops (W == 1),
//   DO  scalar double ops (only when AIAK_WITH_F64 is defined, in the scalar TU).
// Each ops struct provides: T (math type), V (register type), W, load/store (T*), set1, add, sub,
// mul, div, sqrt, max, fma(a, b, c) = a*b + c with one rounding, neg, for float ops
// load_bf16/store_bf16/load_f16/store_f16 (round to nearest even), and a sum of squares in
// double: S (accumulator type), sq_zero(), add_sq(S, V) and sq_total(S).
//
// Sums of squares (LAMB's norms, the global gradient norm) accumulate in double.  In float, a
// 32K-element chunk summed in 1 (scalar), 8 (AVX2) or 16 (AVX-512) lanes carried a relative
// error of up to ~1e-5 that depended on the ISA; LAMB divides the gradient by the clip norm
// and, in L2 mode, adds wd * p, so where the two nearly cancel that error grew to percents of
// the moment and ~1e-5 of the parameter.  A float squared is exact in double, and the double
// sums agree across ISAs to ~1e-16, far below a float's resolution.
//
// Every element is loaded once and stored once.  The order of operations mirrors the ATen
// kernels behind torch.optim's for-loop path so results agree to the last bit in most
// elements (see the comments at each step).  Scalar tails use the same exact-FMA arithmetic as
// the vector body, so all ISAs produce identical bits.

template <class O, int PT>
inline typename O::V ld_param(const void* base, int64_t i) {
  if constexpr (PT == FLOAT32 || PT == FLOAT64) {
    return O::load(static_cast<const typename O::T*>(base) + i);
  } else if constexpr (PT == BFLOAT16) {
    return O::load_bf16(static_cast<const uint16_t*>(base) + i);
  } else {
    return O::load_f16(static_cast<const uint16_t*>(base) + i);
  }
}

template <class O, int PT>
inline void st_param(void* base, int64_t i, typename O::V x) {
  if constexpr (PT == FLOAT32 || PT == FLOAT64) {
    O::store(static_cast<typename O::T*>(base) + i, x);
  } else if constexpr (PT == BFLOAT16) {
    O::store_bf16(static_cast<uint16_t*>(base) + i, x);
  } else {
    O::store_f16(static_cast<uint16_t*>(base) + i, x);
  }
}

// Software prefetch kAhead elements ahead on every stream.  The hardware prefetchers track
// only so many streams at once; Adam walks 4-6 of them, and this measured a few % faster.
constexpr int64_t kAhead = 512;

template <int PT>
inline void prefetch_param(const void* base, int64_t i) {
  constexpr int64_t size = (PT == FLOAT32) ? 4 : (PT == FLOAT64) ? 8 : 2;
  __builtin_prefetch(static_cast<const char*>(base) + (i + kAhead) * size, 1);
}

template <class T>
inline void prefetch_state(const T* base, int64_t i) {
  if (base) __builtin_prefetch(base + i + kAhead, 1);
}

// Each *_range function first copies its arguments into a local "K" object: broadcast
// constants, pointers and flags.  The object never escapes, so the compiler keeps everything
// in registers; read straight from the argument structs, every store through a float* would
// force it to reload and re-broadcast them on each iteration.

// ------------------------------------------------------------------------------- Adam/AdamW
template <class O>
struct AdamK {
  using T = typename O::T;
  using V = typename O::V;
  void* p;
  void* g;
  T* m;
  T* v;
  T* vmax;
  T* master;
  V inv_scale, decay, wd, w, w_minus_1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size;
  bool unscale, maximize, l2, decoupled, amsgrad, lerp_lo;

  AdamK(const AdamArgs& a, const AdamPtrs& t)
      : p(t.p), g(t.g), m(static_cast<T*>(t.m)), v(static_cast<T*>(t.v)),
        vmax(static_cast<T*>(t.vmax)), master(static_cast<T*>(t.master)),
        inv_scale(O::set1(T(a.inv_scale))), decay(O::set1(T(a.decay))),
        wd(O::set1(T(a.weight_decay))), w(O::set1(T(a.lerp_weight))),
        // ATen forms weight - 1 in the tensor's dtype
        w_minus_1(O::set1(T(T(a.lerp_weight) - T(1)))), beta2(O::set1(T(a.beta2))),
        one_minus_beta2(O::set1(T(a.one_minus_beta2))),
        inv_bc2_sqrt(O::set1(T(1.0 / a.bc2_sqrt))),
        eps(O::set1(T(a.eps))), neg_step_size(O::set1(T(-a.step_size))), unscale(a.unscale),
        maximize(a.maximize), l2(a.weight_decay != 0 && !a.adamw),
        decoupled(a.weight_decay != 0 && a.adamw), amsgrad(a.amsgrad),
        lerp_lo(a.lerp_weight < 0.5) {}
};

template <class O, int PT>
inline void adam_elem(const AdamK<O>& k, int64_t i) {
  using V = typename O::V;
  V g = ld_param<O, PT>(k.g, i);
  if (k.unscale) {  // unscale and store back, as torch's fused kernels do under GradScaler
    g = O::mul(g, k.inv_scale);
    st_param<O, PT>(k.g, i, g);
  }
  if (k.maximize) g = O::neg(g);
  V p = k.master ? O::load(k.master + i) : ld_param<O, PT>(k.p, i);
  if (k.decoupled) p = O::mul(p, k.decay);     // param.mul_(1 - lr*wd)
  if (k.l2) g = O::fma(p, k.wd, g);            // grad.add(param, alpha=wd)
  V m = O::load(k.m + i);
  // exp_avg.lerp_(grad, 1 - beta1): ATen's lerp is fma(w, end - start, start) for |w| < 0.5
  // and fma(w - 1, end - start, end) otherwise.
  const V diff = O::sub(g, m);
  m = k.lerp_lo ? O::fma(k.w, diff, m) : O::fma(k.w_minus_1, diff, g);
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2); ATen's addcmul computes
  // fma(value * t1, t2, self).
  V v = O::fma(O::mul(k.one_minus_beta2, g), g, O::mul(O::load(k.v + i), k.beta2));
  O::store(k.m + i, m);
  O::store(k.v + i, v);
  if (k.amsgrad) {
    v = O::max(O::load(k.vmax + i), v);  // torch.maximum; a NaN in v propagates
    O::store(k.vmax + i, v);
  }
  // denom = sqrt(v) / bc2_sqrt + eps;  param.addcdiv_(m, denom, value=-step_size).
  // The divide by the per-tensor constant bc2_sqrt is a multiply by its reciprocal (at most
  // 1 ulp apart): divisions and square roots share one slow unit, and with fast memory that
  // unit, not bandwidth, limited the step.  torch's own vectorised sqrt is not exact either.
  const V denom = O::add(O::mul(O::sqrt(v), k.inv_bc2_sqrt), k.eps);
  p = O::add(p, O::div(O::mul(k.neg_step_size, m), denom));
  if (k.master) O::store(k.master + i, p);
  st_param<O, PT>(k.p, i, p);
}

template <class VOps, class SOps, int PT>
void adam_range(const AdamArgs& a, const AdamPtrs& t, int64_t b, int64_t e) {
  const AdamK<VOps> kv(a, t);
  int64_t i = b;
  for (; i + VOps::W <= e; i += VOps::W) {
    prefetch_param<PT>(kv.g, i);
    prefetch_param<PT>(kv.p, i);
    prefetch_state(kv.m, i);
    prefetch_state(kv.v, i);
    prefetch_state(kv.vmax, i);
    prefetch_state(kv.master, i);
    adam_elem<VOps, PT>(kv, i);
  }
  if (i < e) {
    const AdamK<SOps> ks(a, t);
    for (; i < e; ++i) adam_elem<SOps, PT>(ks, i);
  }
}

// --------------------------------------------------------------------------------------- SGD
template <class O>
struct SgdK {
  using T = typename O::T;
  using V = typename O::V;
  void* p;
  void* g;
  T* buf;
  T* master;
  V inv_scale, wd, momentum, one_minus_damp, neg_lr;
  bool unscale, maximize, has_wd, first, nesterov;

  SgdK(const SgdArgs& a, const SgdPtrs& t)
      : p(t.p), g(t.g), buf(static_cast<T*>(t.buf)), master(static_cast<T*>(t.master)),
        inv_scale(O::set1(T(a.inv_scale))), wd(O::set1(T(a.weight_decay))),
        momentum(O::set1(T(a.momentum))), one_minus_damp(O::set1(T(1.0 - a.dampening))),
        neg_lr(O::set1(T(-a.lr))), unscale(a.unscale), maximize(a.maximize),
        has_wd(a.weight_decay != 0), first(t.first), nesterov(a.nesterov) {}
};

template <class O, int PT>
inline void sgd_elem(const SgdK<O>& k, int64_t i) {
  using V = typename O::V;
  V g = ld_param<O, PT>(k.g, i);
  if (k.unscale) {
    g = O::mul(g, k.inv_scale);
    st_param<O, PT>(k.g, i, g);
  }
  if (k.maximize) g = O::neg(g);
  V p = k.master ? O::load(k.master + i) : ld_param<O, PT>(k.p, i);
  if (k.has_wd) g = O::fma(p, k.wd, g);  // grad.add(param, alpha=wd)
  if (k.buf) {
    // first step: buf = grad.clone(); then buf.mul_(momentum).add_(grad, alpha=1 - dampening)
    const V buf = k.first ? g : O::fma(g, k.one_minus_damp, O::mul(O::load(k.buf + i), k.momentum));
    O::store(k.buf + i, buf);
    g = k.nesterov ? O::fma(buf, k.momentum, g) : buf;  // grad.add(buf, alpha=momentum)
  }
  p = O::fma(g, k.neg_lr, p);  // param.add_(grad, alpha=-lr)
  if (k.master) O::store(k.master + i, p);
  st_param<O, PT>(k.p, i, p);
}

template <class VOps, class SOps, int PT>
void sgd_range(const SgdArgs& a, const SgdPtrs& t, int64_t b, int64_t e) {
  const SgdK<VOps> kv(a, t);
  int64_t i = b;
  for (; i + VOps::W <= e; i += VOps::W) {
    prefetch_param<PT>(kv.g, i);
    prefetch_param<PT>(kv.p, i);
    prefetch_state(kv.buf, i);
    prefetch_state(kv.master, i);
    sgd_elem<VOps, PT>(kv, i);
  }
  if (i < e) {
    const SgdK<SOps> ks(a, t);
    for (; i < e; ++i) sgd_elem<SOps, PT>(ks, i);
  }
}

// -------------------------------------------------------------------------------------- LAMB
template <class O>
struct LambK {
  using T = typename O::T;
  using V = typename O::V;
  void* p;
  void* g;
  T* m;
  T* v;
  T* master;
  V inv_scale, grad_factor, wd, beta1, beta2, beta3, one_minus_beta2, bc1, bc2, eps, neg_ratio;
  bool unscale, l2, decoupled;

  LambK(const LambArgs& a, const LambPtrs& t)
      : p(t.p), g(t.g), m(static_cast<T*>(t.m)), v(static_cast<T*>(t.v)),
        master(static_cast<T*>(t.master)), inv_scale(O::set1(T(a.inv_scale))),
        grad_factor(O::set1(T(a.grad_factor))), wd(O::set1(T(a.weight_decay))),
        beta1(O::set1(T(a.beta1))), beta2(O::set1(T(a.beta2))), beta3(O::set1(T(a.beta3))),
        one_minus_beta2(O::set1(T(1.0 - a.beta2))), bc1(O::set1(T(a.bc1))),
        bc2(O::set1(T(a.bc2))), eps(O::set1(T(a.eps))), neg_ratio(O::set1(T(-a.ratio))),
        unscale(a.unscale), l2(!a.adam_w_mode && a.weight_decay != 0),
        decoupled(a.adam_w_mode && a.weight_decay != 0) {}

  // update = (m / bc1) / (sqrt(v / bc2) + eps)  [+ wd * p in AdamW mode]
  typename O::V update(typename O::V mv, typename O::V vv, typename O::V pv) const {
    const typename O::V denom = O::add(O::sqrt(O::div(vv, bc2)), eps);
    typename O::V u = O::div(O::div(mv, bc1), denom);
    return decoupled ? O::fma(wd, pv, u) : u;
  }
};

template <class O, int PT>
inline void lamb1_elem(const LambK<O>& k, int64_t i, typename O::S& acc_p, typename O::S& acc_u) {
  using V = typename O::V;
  V g = ld_param<O, PT>(k.g, i);
  if (k.unscale) st_param<O, PT>(k.g, i, O::mul(g, k.inv_scale));
  g = O::mul(g, k.grad_factor);
  const V p = k.master ? O::load(k.master + i) : ld_param<O, PT>(k.p, i);
  if (k.l2) g = O::fma(k.wd, p, g);
  const V m = O::fma(k.beta3, g, O::mul(k.beta1, O::load(k.m + i)));
  const V v = O::fma(k.one_minus_beta2, O::mul(g, g), O::mul(k.beta2, O::load(k.v + i)));
  O::store(k.m + i, m);
  O::store(k.v + i, v);
  const V u = k.update(m, v, p);
  acc_p = O::add_sq(acc_p, p);
  acc_u = O::add_sq(acc_u, u);
}

template <class VOps, class SOps, int PT>
void lamb1_range(const LambArgs& a, const LambPtrs& t, int64_t b, int64_t e, double* p_sq,
                 double* u_sq) {
  const LambK<VOps> kv(a, t);
  typename VOps::S vp = VOps::sq_zero(), vu = VOps::sq_zero();
  typename SOps::S sp = SOps::sq_zero(), su = SOps::sq_zero();
  int64_t i = b;
  for (; i + VOps::W <= e; i += VOps::W) {
    prefetch_param<PT>(kv.g, i);
    prefetch_param<PT>(kv.p, i);
    prefetch_state(kv.m, i);
    prefetch_state(kv.v, i);
    prefetch_state(kv.master, i);
    lamb1_elem<VOps, PT>(kv, i, vp, vu);
  }
  if (i < e) {
    const LambK<SOps> ks(a, t);
    for (; i < e; ++i) lamb1_elem<SOps, PT>(ks, i, sp, su);
  }
  *p_sq = VOps::sq_total(vp) + SOps::sq_total(sp);
  *u_sq = VOps::sq_total(vu) + SOps::sq_total(su);
}

template <class O, int PT>
inline void lamb2_elem(const LambK<O>& k, int64_t i) {
  typename O::V p = k.master ? O::load(k.master + i) : ld_param<O, PT>(k.p, i);
  p = O::fma(k.neg_ratio, k.update(O::load(k.m + i), O::load(k.v + i), p), p);
  if (k.master) O::store(k.master + i, p);
  st_param<O, PT>(k.p, i, p);
}

template <class VOps, class SOps, int PT>
void lamb2_range(const LambArgs& a, const LambPtrs& t, int64_t b, int64_t e) {
  const LambK<VOps> kv(a, t);
  int64_t i = b;
  for (; i + VOps::W <= e; i += VOps::W) {
    prefetch_param<PT>(kv.p, i);
    prefetch_state(kv.m, i);
    prefetch_state(kv.v, i);
    prefetch_state(kv.master, i);
    lamb2_elem<VOps, PT>(kv, i);
  }
  if (i < e) {
    const LambK<SOps> ks(a, t);
    for (; i < e; ++i) lamb2_elem<SOps, PT>(ks, i);
  }
}

// ------------------------------------------------------------------------------ sum of squares
template <class VOps, class SOps, int PT>
double sumsq_range(const void* x, int64_t b, int64_t e) {
  typename VOps::S acc = VOps::sq_zero();
  typename SOps::S sacc = SOps::sq_zero();
  int64_t i = b;
  for (; i + VOps::W <= e; i += VOps::W) acc = VOps::add_sq(acc, ld_param<VOps, PT>(x, i));
  for (; i < e; ++i) sacc = SOps::add_sq(sacc, ld_param<SOps, PT>(x, i));
  return VOps::sq_total(acc) + SOps::sq_total(sacc);
}

// Fills the float entries (fp32, fp16, bf16) of a table from VO/SO.
inline void fill_float_entries(KernelTable& t) {
  t.adam[FLOAT32] = &adam_range<VO, SO, FLOAT32>;
  t.adam[FLOAT16] = &adam_range<VO, SO, FLOAT16>;
  t.adam[BFLOAT16] = &adam_range<VO, SO, BFLOAT16>;
  t.sgd[FLOAT32] = &sgd_range<VO, SO, FLOAT32>;
  t.sgd[FLOAT16] = &sgd_range<VO, SO, FLOAT16>;
  t.sgd[BFLOAT16] = &sgd_range<VO, SO, BFLOAT16>;
  t.lamb1[FLOAT32] = &lamb1_range<VO, SO, FLOAT32>;
  t.lamb1[FLOAT16] = &lamb1_range<VO, SO, FLOAT16>;
  t.lamb1[BFLOAT16] = &lamb1_range<VO, SO, BFLOAT16>;
  t.lamb2[FLOAT32] = &lamb2_range<VO, SO, FLOAT32>;
  t.lamb2[FLOAT16] = &lamb2_range<VO, SO, FLOAT16>;
  t.lamb2[BFLOAT16] = &lamb2_range<VO, SO, BFLOAT16>;
  t.sumsq[FLOAT32] = &sumsq_range<VO, SO, FLOAT32>;
  t.sumsq[FLOAT16] = &sumsq_range<VO, SO, FLOAT16>;
  t.sumsq[BFLOAT16] = &sumsq_range<VO, SO, BFLOAT16>;
#ifdef AIAK_WITH_F64
  t.adam[FLOAT64] = &adam_range<DO, DO, FLOAT64>;
  t.sgd[FLOAT64] = &sgd_range<DO, DO, FLOAT64>;
  t.lamb1[FLOAT64] = &lamb1_range<DO, DO, FLOAT64>;
  t.lamb2[FLOAT64] = &lamb2_range<DO, DO, FLOAT64>;
  t.sumsq[FLOAT64] = &sumsq_range<DO, DO, FLOAT64>;
#endif
}

// The kernel table of this translation unit, named after its ISA.
inline KernelTable make_table(const char* name) {
  KernelTable t;
  std::memset(&t, 0, sizeof(t));
  t.name = name;
  fill_float_entries(t);
  return t;
}
