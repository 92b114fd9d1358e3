// Fused attention forward on the CPU, compiled once per ISA level.
//
// One work item = one (batch·head, block of query rows). For each block of
// keys it computes the scores S = (scale·Q)·Kᵀ with a register-blocked
// micro-kernel, folds them into a running (max, sum) per row (online
// softmax), and accumulates P·V into an fp32 (fp64 for double) accumulator
// that is normalised once at the end. Extra memory is a few tiles per
// thread; nothing of size L×S exists.
//
// This file sees only the params struct and ATen's header-only Vectorized:
// no tensors, no allocation, no threading (the host wrapper does those).

#include "cpu/kernels.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Rows of the register-blocked micro-kernels: as many as leave room for two
// vector columns of accumulators plus operands in the register file.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kMicroRows = 12;  // 24 of 32 zmm registers accumulate
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kMicroRows = 6;   // 12 of 16 ymm registers accumulate
#else
constexpr int64_t kMicroRows = 4;
#endif
constexpr int64_t kBlockQ = kMicroRows * 12;
constexpr int64_t kBlockKV = 256;

template <typename acc_t>
constexpr int64_t panel_width() {
  return 2 * Vectorized<acc_t>::size();
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <typename scalar_t> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };

// Scratch layout of one thread, in acc_t elements.
template <typename acc_t>
struct Workspace {
  int64_t rows, kv, dqk, dv;  // padded sizes
  acc_t* q;      // rows × dqk          scaled query block
  acc_t* k;      // kv × dqk            key block in column panels (Kᵀ)
  acc_t* v;      // kv × dv             value block in column panels
  acc_t* s;      // rows × kv           scores, then probabilities
  acc_t* o;      // rows × dv           unnormalised output
  acc_t* m;      // rows                running max
  acc_t* l;      // rows                running sum

  Workspace(const ForwardParams& p, void* base) {
    constexpr int64_t nr = panel_width<acc_t>();
    rows = round_up(p.block_q, kMicroRows);
    kv = round_up(p.block_kv, nr);
    dqk = p.dim_qk;
    dv = round_up(p.dim_v, nr);
    acc_t* at = static_cast<acc_t*>(base);
    q = at; at += rows * dqk;
    k = at; at += kv * dqk;
    v = at; at += kv * dv;
    s = at; at += rows * kv;
    o = at; at += rows * dv;
    m = at; at += rows;
    l = at; at += rows;
  }
  static size_t bytes(const ForwardParams& p) {
    constexpr int64_t nr = panel_width<acc_t>();
    const int64_t rows = round_up(p.block_q, kMicroRows);
    const int64_t kv = round_up(p.block_kv, nr);
    const int64_t dv = round_up(p.dim_v, nr);
    return sizeof(acc_t) *
           (rows * p.dim_qk + kv * p.dim_qk + kv * dv + rows * kv + rows * dv + 2 * rows);
  }
};

// s[kMicroRows × nr] = q[kMicroRows × d] · panel[d × nr]
template <typename acc_t>
inline void scores_microkernel(const acc_t* q, int64_t ldq, const acc_t* panel,
                               int64_t d, acc_t* s, int64_t lds) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t w = Vec::size();
  Vec c0[kMicroRows], c1[kMicroRows];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kMicroRows; ++i) {
    c0[i] = Vec(acc_t(0));
    c1[i] = Vec(acc_t(0));
  }
  for (int64_t e = 0; e < d; ++e) {
    const Vec b0 = Vec::loadu(panel + e * 2 * w);
    const Vec b1 = Vec::loadu(panel + e * 2 * w + w);
#pragma GCC unroll 16
    for (int64_t i = 0; i < kMicroRows; ++i) {
      const Vec a(q[i * ldq + e]);
      c0[i] = at::vec::fmadd(a, b0, c0[i]);
      c1[i] = at::vec::fmadd(a, b1, c1[i]);
    }
  }
#pragma GCC unroll 16
  for (int64_t i = 0; i < kMicroRows; ++i) {
    c0[i].store(s + i * lds);
    c1[i].store(s + i * lds + w);
  }
}

// o[kMicroRows × nr] += p[kMicroRows × n] · panel[n × nr]
template <typename acc_t>
inline void pv_microkernel(const acc_t* p, int64_t ldp, const acc_t* panel,
                           int64_t n, acc_t* o, int64_t ldo) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t w = Vec::size();
  Vec c0[kMicroRows], c1[kMicroRows];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kMicroRows; ++i) {
    c0[i] = Vec::loadu(o + i * ldo);
    c1[i] = Vec::loadu(o + i * ldo + w);
  }
  for (int64_t c = 0; c < n; ++c) {
    const Vec b0 = Vec::loadu(panel + c * 2 * w);
    const Vec b1 = Vec::loadu(panel + c * 2 * w + w);
#pragma GCC unroll 16
    for (int64_t i = 0; i < kMicroRows; ++i) {
      const Vec a(p[i * ldp + c]);
      c0[i] = at::vec::fmadd(a, b0, c0[i]);
      c1[i] = at::vec::fmadd(a, b1, c1[i]);
    }
  }
#pragma GCC unroll 16
  for (int64_t i = 0; i < kMicroRows; ++i) {
    c0[i].store(o + i * ldo);
    c1[i].store(o + i * ldo + w);
  }
}

template <typename scalar_t, typename acc_t>
class ForwardKernel {
 public:
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t nr = panel_width<acc_t>();

  ForwardKernel(const ForwardParams& p, void* workspace) : p_(p), ws_(p, workspace) {}

  void run(int64_t item) {
    const int64_t nqb = num_query_blocks(p_);
    const int64_t o = item / nqb;
    const int64_t q0 = (item % nqb) * p_.block_q;
    const int64_t rows = std::min(p_.block_q, p_.len_q - q0);
    const int64_t rows_padded = round_up(rows, kMicroRows);

    pack_query(o, q0, rows, rows_padded);
    std::fill(ws_.o, ws_.o + rows_padded * ws_.dv, acc_t(0));
    std::fill(ws_.m, ws_.m + rows, -std::numeric_limits<acc_t>::infinity());
    std::fill(ws_.l, ws_.l + rows, acc_t(0));

    // Causal (top-left): row i sees keys 0..i, so this block needs keys
    // below q0 + rows; blocks entirely above the diagonal are never visited.
    const int64_t kv_end = p_.is_causal ? std::min(p_.len_kv, q0 + rows) : p_.len_kv;
    for (int64_t k0 = 0; k0 < kv_end; k0 += p_.block_kv) {
      const int64_t cols = std::min(p_.block_kv, kv_end - k0);
      pack_key(o, k0, cols);
      pack_value(o, k0, cols);
      for (int64_t r = 0; r < rows_padded; r += kMicroRows) {
        for (int64_t c = 0; c < cols; c += nr) {
          scores_microkernel(ws_.q + r * ws_.dqk, ws_.dqk, ws_.k + c * ws_.dqk, ws_.dqk,
                             ws_.s + r * ws_.kv + c, ws_.kv);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        softmax_step(o, q0 + r, k0, cols, r);
      }
      for (int64_t r = 0; r < rows_padded; r += kMicroRows) {
        for (int64_t c = 0; c < ws_.dv; c += nr) {
          pv_microkernel(ws_.s + r * ws_.kv, ws_.kv, ws_.v + c * ws_.kv, cols,
                         ws_.o + r * ws_.dv + c, ws_.dv);
        }
      }
    }
    write_output(o, q0, rows);
  }

 private:
  const scalar_t* row_ptr(const MatrixView& t, int64_t o, int64_t i) const {
    return static_cast<const scalar_t*>(t.data) + t.offsets[o] + i * t.row_stride;
  }

  void pack_query(int64_t o, int64_t q0, int64_t rows, int64_t rows_padded) {
    const acc_t scale = static_cast<acc_t>(p_.scale);
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* src = row_ptr(p_.q, o, q0 + r);
      acc_t* dst = ws_.q + r * ws_.dqk;
      for (int64_t e = 0; e < p_.dim_qk; ++e) dst[e] = static_cast<acc_t>(src[e]) * scale;
    }
    std::fill(ws_.q + rows * ws_.dqk, ws_.q + rows_padded * ws_.dqk, acc_t(0));
  }

  // Kᵀ in panels of nr keys: element (key c, dim e) at [(c/nr)·dqk + e]·nr + c%nr.
  void pack_key(int64_t o, int64_t k0, int64_t cols) {
    const int64_t cols_padded = round_up(cols, nr);
    for (int64_t c = 0; c < cols_padded; ++c) {
      acc_t* dst = ws_.k + (c / nr) * ws_.dqk * nr + c % nr;
      if (c < cols) {
        const scalar_t* src = row_ptr(p_.k, o, k0 + c);
        for (int64_t e = 0; e < p_.dim_qk; ++e) dst[e * nr] = static_cast<acc_t>(src[e]);
      } else {
        for (int64_t e = 0; e < p_.dim_qk; ++e) dst[e * nr] = acc_t(0);
      }
    }
  }

  // V in panels of nr value dims: element (key c, dim e) at [(e/nr)·kv + c]·nr + e%nr.
  void pack_value(int64_t o, int64_t k0, int64_t cols) {
    for (int64_t c = 0; c < cols; ++c) {
      const scalar_t* src = row_ptr(p_.v, o, k0 + c);
      for (int64_t e0 = 0; e0 < ws_.dv; e0 += nr) {
        acc_t* dst = ws_.v + ((e0 / nr) * ws_.kv + c) * nr;
        const int64_t n = std::min(nr, p_.dim_v - e0);
        for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<acc_t>(src[e0 + j]);
        for (int64_t j = std::max<int64_t>(n, 0); j < nr; ++j) dst[j] = acc_t(0);
      }
    }
  }

  // Masks row r (query i) of the score block, folds it into the running
  // max/sum and turns it into probabilities relative to the new max.
  void softmax_step(int64_t o, int64_t i, int64_t k0, int64_t cols, int64_t r) {
    constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    acc_t* s = ws_.s + r * ws_.kv;
    const int64_t valid = p_.is_causal ? std::clamp<int64_t>(i + 1 - k0, 0, cols) : cols;
    apply_mask(o, i, k0, valid, s);

    const acc_t m_old = ws_.m[r];
    const acc_t m_new = std::max(m_old, row_max(s, valid));
    if (m_new == neg_inf) {  // nothing to attend to yet: contributes nothing
      std::fill(s, s + cols, acc_t(0));
      return;
    }
    const acc_t sum = exp_and_sum(s, valid, m_new);
    std::fill(s + valid, s + cols, acc_t(0));
    const acc_t alpha = std::exp(m_old - m_new);  // 0 when m_old = -inf
    ws_.l[r] = ws_.l[r] * alpha + sum;
    ws_.m[r] = m_new;
    if (alpha != acc_t(1)) {
      acc_t* acc = ws_.o + r * ws_.dv;
      const Vec va(alpha);
      for (int64_t e = 0; e < ws_.dv; e += Vec::size()) (Vec::loadu(acc + e) * va).store(acc + e);
    }
  }

  void apply_mask(int64_t o, int64_t i, int64_t k0, int64_t n, acc_t* s) const {
    const MatrixView& mk = p_.mask;
    const int64_t offset = mk.offsets == nullptr ? 0 : mk.offsets[o] + i * mk.row_stride + k0 * mk.col_stride;
    switch (p_.mask_kind) {
      case MaskKind::None:
        return;
      case MaskKind::Bool:
        return mask_bool(static_cast<const bool*>(mk.data) + offset, mk.col_stride, n, s);
      case MaskKind::Additive:
        return mask_add(static_cast<const scalar_t*>(mk.data) + offset, mk.col_stride, n, s);
      case MaskKind::AdditiveFloat32:
        return mask_add(static_cast<const float*>(mk.data) + offset, mk.col_stride, n, s);
    }
  }

  // The branches on cs == 1 let the compiler vectorise the common case.
  static void mask_bool(const bool* m, int64_t cs, int64_t n, acc_t* s) {
    constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    if (cs == 1) {
      for (int64_t c = 0; c < n; ++c) s[c] = m[c] ? s[c] : neg_inf;
    } else {
      for (int64_t c = 0; c < n; ++c) s[c] = m[c * cs] ? s[c] : neg_inf;
    }
  }

  template <typename mask_t>
  static void mask_add(const mask_t* m, int64_t cs, int64_t n, acc_t* s) {
    if (cs == 1) {
      for (int64_t c = 0; c < n; ++c) s[c] += static_cast<acc_t>(m[c]);
    } else {
      for (int64_t c = 0; c < n; ++c) s[c] += static_cast<acc_t>(m[c * cs]);
    }
  }

  struct Max { acc_t operator()(acc_t a, acc_t b) const { return std::max(a, b); } };
  struct Sum { acc_t operator()(acc_t a, acc_t b) const { return a + b; } };
  template <typename Op>
  static acc_t horizontal(const Vec& v) {
    acc_t lanes[Vec::size()];
    v.store(lanes);
    acc_t r = lanes[0];
    for (int64_t j = 1; j < Vec::size(); ++j) r = Op()(r, lanes[j]);
    return r;
  }

  static acc_t row_max(const acc_t* s, int64_t n) {
    acc_t result = -std::numeric_limits<acc_t>::infinity();
    int64_t c = 0;
    if (n >= Vec::size()) {
      Vec vmax = Vec::loadu(s);
      for (c = Vec::size(); c + Vec::size() <= n; c += Vec::size()) {
        vmax = at::vec::maximum(vmax, Vec::loadu(s + c));
      }
      result = horizontal<Max>(vmax);
    }
    for (; c < n; ++c) result = std::max(result, s[c]);
    return result;
  }

  // s[c] = exp(s[c] - max) for c < n; returns their sum.
  static acc_t exp_and_sum(acc_t* s, int64_t n, acc_t max) {
    const Vec vmax(max);
    Vec vsum(acc_t(0));
    int64_t c = 0;
    for (; c + Vec::size() <= n; c += Vec::size()) {
      const Vec e = (Vec::loadu(s + c) - vmax).exp_u20();
      e.store(s + c);
      vsum = vsum + e;
    }
    acc_t sum = horizontal<Sum>(vsum);
    for (; c < n; ++c) {
      s[c] = std::exp(s[c] - max);
      sum += s[c];
    }
    return sum;
  }

  void write_output(int64_t o, int64_t q0, int64_t rows) {
    scalar_t* out = static_cast<scalar_t*>(p_.out) + p_.out_offsets[o];
    acc_t* lse = static_cast<acc_t*>(p_.lse) + o * p_.len_q;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = q0 + r;
      const acc_t l = ws_.l[r];
      // A row with no key to attend to: output 0 and lse +inf, so that
      // exp(score - lse) is 0 for every key in the backward.
      const acc_t inv = l > acc_t(0) ? acc_t(1) / l : acc_t(0);
      const acc_t* acc = ws_.o + r * ws_.dv;
      scalar_t* dst = out + i * p_.out_row_stride;
      for (int64_t e = 0; e < p_.dim_v; ++e) dst[e] = static_cast<scalar_t>(acc[e] * inv);
      lse[i] = l > acc_t(0) ? ws_.m[r] + std::log(l) : std::numeric_limits<acc_t>::infinity();
    }
  }

  const ForwardParams& p_;
  Workspace<acc_t> ws_;
};

template <typename scalar_t>
void run_items(const ForwardParams& p, int64_t begin, int64_t end, void* workspace) {
  ForwardKernel<scalar_t, typename AccType<scalar_t>::type> kernel(p, workspace);
  for (int64_t item = begin; item < end; ++item) kernel.run(item);
}

}  // namespace

size_t forward_configure(ForwardParams& p) {
  // Short sequences get fewer query rows per item (less padding, more items
  // for the threads); the row count stays a multiple of the micro-kernel's.
  p.block_q = std::min(kBlockQ, round_up(std::max<int64_t>(p.len_q, 1), kMicroRows));
  p.block_kv = std::min(kBlockKV, round_up(std::max<int64_t>(p.len_kv, 1), 2 * int64_t(16)));
  return p.dtype == DType::Float64 ? Workspace<double>::bytes(p) : Workspace<float>::bytes(p);
}

void forward_items(const ForwardParams& p, int64_t begin, int64_t end, void* workspace) {
  switch (p.dtype) {
    case DType::Float32: return run_items<float>(p, begin, end, workspace);
    case DType::Float64: return run_items<double>(p, begin, end, workspace);
    case DType::BFloat16: return run_items<c10::BFloat16>(p, begin, end, workspace);
    case DType::Float16: return run_items<c10::Half>(p, begin, end, workspace);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
