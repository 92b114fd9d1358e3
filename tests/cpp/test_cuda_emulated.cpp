// The CUDA kernels' own code run on the CPU through cuda/emulation.h (one
// fiber per GPU thread, ldmatrix/mma/shuffles computed from their PTX
// definitions), against a float64 reference: the tensor-core forward and
// backward for every head-dim group and both 16-bit types, and the simple
// kernels, across lengths that are not multiples of the tiles, causal
// masking with L != S, bool/float masks with broadcasting, GQA, strided
// rows, dropout (the common/philox.h stream), rows with nothing to see, and
// the variants: bottom-right causal, sliding windows, softcap, ALiBi, sinks;
// the gradient of a float mask (summed with atomics into its broadcast shape);
// and packed sequences (varlen) and paged caches, sequence by sequence.
//
// Built without torch (plain C++ and the CUDA headers), so it is quick to
// compile, and it runs wherever the CUDA toolkit is installed, GPU or not.

#include "cuda/flash_backward.cuh"
#include "cuda/flash_config.h"
#include "cuda/flash_forward.cuh"
#include "cuda/simple_kernels.cuh"
#include "cuda_emulated_matrix.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace fusedmha::cuda {
namespace {

struct Case {
  int B = 1, H = 2, Hkv = 2, L = 70, S = 130, E = 64, Ev = 64;
  bool causal = false;
  int mask = 0;  // 0 none, 1 bool (B,1,L,S) with an empty row, 2 float (S,) row
  double dropout = 0.0;
  int row_pad = 0;  // extra elements per row of q/k/v/dO (rows stay multiples of 8 long)
  // The variants (common/attention_params.h).
  int window_left = -1, window_right = -1;
  bool bottom_right = false;
  double softcap = 0.0;
  bool alibi = false, sinks = false;
  std::string variants() const {
    std::string v;
    if (window_left >= 0 || window_right >= 0) {
      v += " window(" + std::to_string(window_left) + "," + std::to_string(window_right) + ")";
    }
    if (bottom_right) v += " bottom-right";
    if (softcap > 0) v += " softcap";
    if (alibi) v += " alibi";
    if (sinks) v += " sinks";
    return v;
  }
  std::string name() const {
    return "B" + std::to_string(B) + " H" + std::to_string(H) + "/" + std::to_string(Hkv) +
           " L" + std::to_string(L) + " S" + std::to_string(S) + " E" + std::to_string(E) +
           "/" + std::to_string(Ev) + (causal ? " causal" : "") +
           (mask == 1 ? " bool-mask" : mask == 2 ? " float-mask" : "") +
           (dropout > 0 ? " dropout" : "") + (row_pad ? " strided" : "") + variants();
  }
};

template <typename T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(static_cast<float>(x));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(static_cast<float>(x));
  else return static_cast<T>(x);
}
template <typename T>
double to_double(T x) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(x);
  else return static_cast<double>(x);
}

template <typename T>
DType dtype_of() {
  if constexpr (std::is_same_v<T, __half>) return DType::Float16;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return DType::BFloat16;
  else if constexpr (std::is_same_v<T, double>) return DType::Float64;
  else return DType::Float32;
}

// A (B, H, rows, cols) tensor with rows `ld` apart, values as stored (T)
// and as double.
template <typename T>
struct Tensor4 {
  int B, H, rows, cols, ld;
  std::vector<T> data;
  Tensor4(int B_, int H_, int rows_, int cols_, int pad = 0)
      : B(B_), H(H_), rows(rows_), cols(cols_), ld(cols_ + pad),
        data(size_t(B_) * H_ * rows_ * (cols_ + pad) + 8, from_double<T>(1e4)) {}
  size_t at(int b, int h, int r, int c) const { return ((size_t(b) * H + h) * rows + r) * ld + c; }
  double get(int b, int h, int r, int c) const { return to_double(data[at(b, h, r, c)]); }
  void set(int b, int h, int r, int c, double x) { data[at(b, h, r, c)] = from_double<T>(x); }
  void randomize(std::mt19937& rng) {
    std::normal_distribution<double> n(0.0, 1.0);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < cols; ++c) set(b, h, r, c, n(rng));
  }
  // The kernels' view, indexed by the output's outer dims (B, H_out).
  Matrix matrix(int H_out) const {
    Matrix m;
    m.data = const_cast<T*>(data.data());
    m.outer_stride[0] = int64_t(H) * rows * ld;
    m.outer_stride[1] = int64_t(rows) * ld;
    m.divisor[0] = 1;
    m.divisor[1] = H_out / H;
    m.row_stride = ld;
    m.col_stride = 1;
    return m;
  }
};

struct Problem {
  Case c;
  std::vector<double> q, k, v, dout;  // float64 copies of the rounded inputs
  std::vector<unsigned char> bool_mask;  // (B, L, S)
  std::vector<float> float_mask;         // (S)
  double scale;
  DropoutStream stream{0x1234567890abcdefull, 42};
  uint32_t threshold = 0;

  std::vector<double> slopes, sinks;  // per head
  bool visible(int b, int i, int j) const {
    const int d = i + (c.bottom_right ? c.S - c.L : 0);
    const int right = c.causal ? 0 : c.window_right;
    if (right >= 0 && j > d + right) return false;
    if (c.window_left >= 0 && j < d - c.window_left) return false;
    if (c.mask == 1 && !bool_mask[(size_t(b) * c.L + i) * c.S + j]) return false;
    return true;
  }
  double mask_add(int j) const { return c.mask == 2 ? float_mask[j] : 0.0; }
  // softcap then ALiBi on x = scale·q·k; *dcap = d/dx.
  double transform(double x, int h, int i, int j, double* dcap) const {
    *dcap = 1.0;
    if (c.softcap > 0) {
      const double t = std::tanh(x / c.softcap);
      x = c.softcap * t;
      *dcap = 1 - t * t;
    }
    if (c.alibi) x -= slopes[h] * std::abs(i + (c.bottom_right ? c.S - c.L : 0) - j);
    return x;
  }
  double keep(int o, int i, int j) const {
    if (c.dropout <= 0) return 1.0;
    return dropout_keeps(o, i, j) ? 1.0 / (1.0 - c.dropout) : 0.0;
  }
  bool dropout_keeps(int o, int i, int j) const {
    return stream.block(o, i, j / 4).v[j % 4] >= threshold;
  }
};

struct Reference {
  std::vector<double> out, lse, dq, dk, dv;  // dk/dv per output head (B, H, S, E)
  std::vector<double> weights;                // P∘Z/(1−p), (B, H, L, S)
  std::vector<double> dmask;                  // the (S,) float mask's gradient
};

// Float64 attention and its gradients (per output head), the library's rules.
Reference reference(const Problem& pr) {
  const Case& c = pr.c;
  Reference r;
  const int O = c.B * c.H;
  r.out.assign(size_t(O) * c.L * c.Ev, 0);
  r.lse.assign(size_t(O) * c.L, INFINITY);
  r.dq.assign(size_t(O) * c.L * c.E, 0);
  r.dk.assign(size_t(O) * c.S * c.E, 0);
  r.dv.assign(size_t(O) * c.S * c.Ev, 0);
  r.dmask.assign(c.S, 0);
  r.weights.assign(size_t(O) * c.L * c.S, 0);
  const int group = c.H / c.Hkv;
  for (int b = 0; b < c.B; ++b) {
    for (int h = 0; h < c.H; ++h) {
      const int o = b * c.H + h, hk = h / group;
      auto Q = [&](int i, int e) { return pr.q[((size_t(b) * c.H + h) * c.L + i) * c.E + e]; };
      auto K = [&](int j, int e) { return pr.k[((size_t(b) * c.Hkv + hk) * c.S + j) * c.E + e]; };
      auto V = [&](int j, int e) { return pr.v[((size_t(b) * c.Hkv + hk) * c.S + j) * c.Ev + e]; };
      auto dO = [&](int i, int e) { return pr.dout[((size_t(b) * c.H + h) * c.L + i) * c.Ev + e]; };
      for (int i = 0; i < c.L; ++i) {
        std::vector<double> s(c.S, -INFINITY), p(c.S, 0.0), dcap(c.S, 1.0);
        // A sink is a score with no value in the denominator.
        const double sink = c.sinks ? double(pr.sinks[h]) : -INFINITY;
        double m = sink;
        for (int j = 0; j < c.S; ++j) {
          if (!pr.visible(b, i, j)) continue;
          double x = 0;
          for (int e = 0; e < c.E; ++e) x += Q(i, e) * K(j, e);
          s[j] = pr.transform(x * pr.scale, h, i, j, &dcap[j]) + pr.mask_add(j);
          m = std::max(m, s[j]);
        }
        if (m == -INFINITY) continue;  // nothing to attend to: 0, lse +inf, no gradient
        double l = c.sinks ? std::exp(sink - m) : 0.0;
        for (int j = 0; j < c.S; ++j) l += (p[j] = s[j] == -INFINITY ? 0.0 : std::exp(s[j] - m));
        for (double& x : p) x /= l;
        r.lse[size_t(o) * c.L + i] = m + std::log(l);
        for (int j = 0; j < c.S; ++j) r.weights[(size_t(o) * c.L + i) * c.S + j] = p[j] * pr.keep(o, i, j);
        std::vector<double> dp(c.S, 0.0);
        double delta = 0;
        for (int e = 0; e < c.Ev; ++e) {
          double acc = 0;
          for (int j = 0; j < c.S; ++j) acc += p[j] * pr.keep(o, i, j) * V(j, e);
          r.out[(size_t(o) * c.L + i) * c.Ev + e] = acc;
          delta += acc * dO(i, e);
        }
        for (int j = 0; j < c.S; ++j) {
          if (p[j] == 0) continue;
          double x = 0;
          for (int e = 0; e < c.Ev; ++e) x += dO(i, e) * V(j, e);
          dp[j] = x * pr.keep(o, i, j);
          r.dmask[j] += p[j] * (dp[j] - delta);  // (where the mask is added)
          const double ds = p[j] * (dp[j] - delta) * dcap[j] * pr.scale;
          for (int e = 0; e < c.E; ++e) {
            r.dq[(size_t(o) * c.L + i) * c.E + e] += ds * K(j, e);
            r.dk[(size_t(o) * c.S + j) * c.E + e] += ds * Q(i, e);
          }
          for (int e = 0; e < c.Ev; ++e) {
            r.dv[(size_t(o) * c.S + j) * c.Ev + e] += p[j] * pr.keep(o, i, j) * dO(i, e);
          }
        }
      }
    }
  }
  return r;
}

double tolerance_for(DType t) {
  switch (t) {
    case DType::Float16: return 4e-3;
    case DType::BFloat16: return 3e-2;
    case DType::Float64: return 1e-10;
    default: return 2e-5;
  }
}

// Max |got - want| relative to max(1, max |want|).
template <typename Get>
double max_error(const std::vector<double>& want, Get got) {
  double err = 0, scale = 1;
  for (size_t n = 0; n < want.size(); ++n) {
    const double g = got(n);
    if (std::isnan(g)) return INFINITY;
    err = std::max(err, std::abs(g - want[n]));
    scale = std::max(scale, std::abs(want[n]));
  }
  return err / scale;
}

enum class Kernels { TensorCores, Simple };

template <typename T>
void run_case(const Case& c, Kernels kernels) {
  SCOPED_TRACE(c.name() + (kernels == Kernels::TensorCores ? " [tensor cores]" : " [simple]"));
  std::mt19937 rng(7 + c.L * 31 + c.S + c.E);
  Tensor4<T> q(c.B, c.H, c.L, c.E, c.row_pad), k(c.B, c.Hkv, c.S, c.E, c.row_pad),
      v(c.B, c.Hkv, c.S, c.Ev, c.row_pad), dout(c.B, c.H, c.L, c.Ev, c.row_pad);
  q.randomize(rng);
  k.randomize(rng);
  v.randomize(rng);
  dout.randomize(rng);

  Problem pr;
  pr.c = c;
  pr.scale = 1.0 / std::sqrt(double(c.E));
  auto copy = [](const auto& t, std::vector<double>& dst) {
    for (int b = 0; b < t.B; ++b)
      for (int h = 0; h < t.H; ++h)
        for (int r = 0; r < t.rows; ++r)
          for (int e = 0; e < t.cols; ++e) dst.push_back(t.get(b, h, r, e));
  };
  copy(q, pr.q);
  copy(k, pr.k);
  copy(v, pr.v);
  copy(dout, pr.dout);
  std::bernoulli_distribution coin(0.75);
  pr.bool_mask.resize(size_t(c.B) * c.L * c.S);
  for (auto& m : pr.bool_mask) m = coin(rng);
  if (c.mask == 1 && c.L > 3) std::fill_n(pr.bool_mask.begin() + 3 * c.S, c.S, 0);  // row 3 sees nothing
  std::uniform_real_distribution<float> u(-2.0f, 1.0f);
  pr.float_mask.resize(c.S);
  for (auto& m : pr.float_mask) m = u(rng);
  pr.threshold = c.dropout > 0 ? dropout_threshold(c.dropout) : 0;
  for (int h = 0; h < c.H; ++h) {
    pr.slopes.push_back(0.25 / (h + 1));
    pr.sinks.push_back(h - 0.5);
  }
  const Reference ref = reference(pr);

  AttentionParams p;
  p.dtype = dtype_of<T>();
  p.outer.dims = 2;
  p.outer.size[0] = c.B;
  p.outer.size[1] = c.H;
  p.num_outer = int64_t(c.B) * c.H;
  p.len_q = c.L;
  p.len_kv = c.S;
  p.dim_qk = c.E;
  p.dim_v = c.Ev;
  p.q = q.matrix(c.H);
  p.k = k.matrix(c.H);
  p.v = v.matrix(c.H);
  if (c.mask == 1) {
    p.mask_kind = MaskKind::Bool;
    p.mask.data = const_cast<unsigned char*>(pr.bool_mask.data());
    p.mask.outer_stride[0] = int64_t(c.L) * c.S;  // (B, 1, L, S): heads broadcast
    p.mask.divisor[0] = p.mask.divisor[1] = 1;
    p.mask.row_stride = c.S;
    p.mask.col_stride = 1;
  } else if (c.mask == 2) {
    p.mask_kind = MaskKind::AdditiveFloat32;
    p.mask.data = const_cast<float*>(pr.float_mask.data());
    p.mask.divisor[0] = p.mask.divisor[1] = 1;
    p.mask.row_stride = 0;  // (S,): rows, batch and heads broadcast
    p.mask.col_stride = 1;
  }
  p.scale = pr.scale;
  p.softcap = c.softcap;
  p.diagonal_offset = c.bottom_right ? c.S - c.L : 0;
  p.window_left = c.window_left;
  p.window_right = c.causal ? 0 : c.window_right;
  // One float per head: (1, H, 1, 1) broadcast over the batch.
  auto per_head = [&](std::vector<double>& values) {
    Matrix m;
    m.data = values.data();
    m.outer_stride[1] = 1;
    return m;
  };
  if (c.alibi) p.alibi_slopes = per_head(pr.slopes);
  if (c.sinks) p.sinks = per_head(pr.sinks);
  int64_t rng_state[2] = {-1, -1};
  if (c.dropout > 0) {
    p.dropout.p = c.dropout;
    p.dropout.threshold = pr.threshold;
    p.dropout.seed = pr.stream.seed;
    p.dropout.offset = pr.stream.offset;
  }
  p.dropout.state_out = rng_state;
  using A = typename simple::AccOf<T>::type;
  Tensor4<T> out(c.B, c.H, c.L, c.Ev);
  p.out = out.matrix(c.H);
  std::vector<A> lse(size_t(c.B) * c.H * c.L, A(-7));
  p.lse = dense(lse, c.H, c.L, 1);

  const int D = flash_head_dim_group(c.E, c.Ev);
  const unsigned rows_blocks = unsigned((p.num_outer * c.L + simple::kWarpsPerBlock - 1) / simple::kWarpsPerBlock);
  if (kernels == Kernels::TensorCores) {
    const unsigned blocks = unsigned((c.L + flash_fwd::kBlockQ - 1) / flash_fwd::kBlockQ * p.num_outer);
    emulation::launch(blocks, flash_fwd::kThreads, flash_fwd::smem_bytes(D), [&] {
      if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
        if (D == 64) flash_fwd::kernel<T, 64>(p);
        else if (D == 128) flash_fwd::kernel<T, 128>(p);
        else flash_fwd::kernel<T, 256>(p);
      }
    });
  } else {
    emulation::launch(rows_blocks, simple::kWarpsPerBlock * 32,
                      size_t(c.E + c.Ev) * sizeof(A) * simple::kWarpsPerBlock,
                      [&] { simple::forward_kernel<T, A>(p); });
  }
  // The forward reports its stream, (0, 0) without dropout.
  EXPECT_EQ(rng_state[0], c.dropout > 0 ? int64_t(pr.stream.seed) : 0);
  EXPECT_EQ(rng_state[1], c.dropout > 0 ? int64_t(pr.stream.offset) : 0);
  const double tol = tolerance_for(p.dtype);
  const int O = c.B * c.H;
  EXPECT_LE(max_error(ref.out, [&](size_t n) {
              const int o = int(n / (size_t(c.L) * c.Ev)), i = int(n / c.Ev % c.L), e = int(n % c.Ev);
              return out.get(o / c.H, o % c.H, i, e);
            }), tol) << "output";
  for (int n = 0; n < O * c.L; ++n) {
    if (std::isinf(ref.lse[n])) {
      ASSERT_TRUE(std::isinf(double(lse[n])) && lse[n] > 0) << "lse of an empty row, index " << n;
    } else {
      ASSERT_NEAR(double(lse[n]), ref.lse[n], 1e-4 * std::max(1.0, std::abs(ref.lse[n]))) << "lse " << n;
    }
  }

  // The attention weights pass (MultiheadAttention's need_weights), per head
  // and averaged over heads, from the forward's log-sum-exp.
  for (const int64_t heads : {int64_t(1), int64_t(c.H)}) {
    WeightsParams wp;
    wp.fwd = p;
    wp.fwd.dropout.state_out = nullptr;
    wp.fwd.dropout.state_in = c.dropout > 0 ? rng_state : nullptr;
    wp.fwd.lse = dense(lse, c.H, c.L, 1);
    wp.heads_per_item = heads;
    std::vector<T> weights(size_t(O / heads) * c.L * c.S, from_double<T>(-9));
    wp.weights = weights.data();
    const size_t w = simple::kWarpsPerBlock;
    emulation::launch(unsigned((O / heads * c.L + w - 1) / w), w * 32, size_t(heads * c.E) * sizeof(A) * w,
                      [&] { simple::weights_kernel<T, A>(wp); });
    std::vector<double> want(weights.size(), 0.0);
    for (size_t n = 0; n < ref.weights.size(); ++n) {
      const size_t o = n / (size_t(c.L) * c.S), rest = n % (size_t(c.L) * c.S);
      want[o / heads * c.L * c.S + rest] += ref.weights[n] / double(heads);
    }
    EXPECT_LE(max_error(want, [&](size_t n) { return to_double(weights[n]); }), tol)
        << "weights, averaged over " << heads << " heads";
  }

  // Backward, from the kernel's own output and log-sum-exp.
  std::vector<A> delta(size_t(O) * c.L);
  for (int o = 0; o < O; ++o)
    for (int i = 0; i < c.L; ++i) {
      double s = 0;
      for (int e = 0; e < c.Ev; ++e) s += out.get(o / c.H, o % c.H, i, e) * dout.get(o / c.H, o % c.H, i, e);
      delta[size_t(o) * c.L + i] = A(s);
    }
  BackwardParams bp;
  bp.fwd = p;
  bp.fwd.dropout.state_out = nullptr;
  bp.fwd.dropout.state_in = c.dropout > 0 ? rng_state : nullptr;
  bp.grad_out = dout.matrix(c.H);
  bp.fwd.lse = dense(lse, c.H, c.L, 1);
  bp.delta = dense(delta, c.H, c.L, 1);
  std::vector<A> grad_q(size_t(O) * c.L * c.E, A(0)), grad_k(size_t(O) * c.S * c.E, A(-3)),
      grad_v(size_t(O) * c.S * c.Ev, A(-3));
  bp.grad_q = dense(grad_q, c.H, c.L, c.E);
  bp.grad_k = dense(grad_k, c.H, c.S, c.E);
  bp.grad_v = dense(grad_v, c.H, c.S, c.Ev);
  // The float mask's gradient: every batch, head and row sums into its (S,).
  std::vector<A> grad_mask(c.S, A(0));
  if (c.mask == 2) {
    bp.grad_mask.data = grad_mask.data();
    bp.grad_mask.col_stride = 1;
  }
  if (kernels == Kernels::TensorCores) {
    const unsigned blocks = unsigned((c.S + flash_bwd::kBlockKV - 1) / flash_bwd::kBlockKV * O);
    emulation::launch(blocks, flash_bwd::kThreads, flash_bwd::smem_bytes(D), [&] {
      if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
        if (D == 64) flash_bwd::kernel<T, 64>(bp);
        else if (D == 128) flash_bwd::kernel<T, 128>(bp);
        else flash_bwd::kernel<T, 256>(bp);
      }
    });
  } else {
    const size_t w = simple::kWarpsPerBlock;
    emulation::launch(rows_blocks, w * 32, size_t(2 * c.E + c.Ev) * sizeof(A) * w,
                      [&] { simple::backward_dq_kernel<T, A>(bp); });
    emulation::launch(unsigned((O * c.S + w - 1) / w), w * 32, size_t(2 * c.E + 2 * c.Ev) * sizeof(A) * w,
                      [&] { simple::backward_dkdv_kernel<T, A>(bp); });
  }
  // Gradients round through 16-bit P and dS on tensor cores: a looser bound.
  const double gtol = kernels == Kernels::TensorCores ? 3 * tol : tol;
  EXPECT_LE(max_error(ref.dq, [&](size_t n) { return double(grad_q[n]); }), gtol) << "grad_q";
  EXPECT_LE(max_error(ref.dk, [&](size_t n) { return double(grad_k[n]); }), gtol) << "grad_k";
  EXPECT_LE(max_error(ref.dv, [&](size_t n) { return double(grad_v[n]); }), gtol) << "grad_v";
  if (c.mask == 2) {
    EXPECT_LE(max_error(ref.dmask, [&](size_t n) { return double(grad_mask[n]); }), gtol)
        << "grad of the float mask";
  }
}

std::vector<Case> cases() {
  std::vector<Case> all;
  Case base;
  all.push_back(base);                                   // plain, L != S, tails on both
  Case c = base; c.causal = true; all.push_back(c);      // causal, L < S
  c = base; c.L = 130; c.S = 70; c.causal = true; all.push_back(c);  // causal, L > S
  c = base; c.mask = 1; all.push_back(c);                // bool mask with an empty row
  c = base; c.mask = 2; c.causal = true; all.push_back(c);  // float mask + causal
  c = base; c.H = 4; c.Hkv = 2; all.push_back(c);        // GQA
  c = base; c.dropout = 0.3; all.push_back(c);           // dropout
  c = base; c.row_pad = 4; c.E = 36; c.Ev = 20; all.push_back(c);  // strided rows, E != Ev, partial chunks
  c = base; c.L = 1; c.S = 1; all.push_back(c);          // one query, one key
  c = base; c.L = 5; c.S = 0; all.push_back(c);          // no keys: output 0, lse +inf
  c = base; c.L = 65; c.S = 200; c.E = c.Ev = 128; c.causal = true; c.dropout = 0.2; all.push_back(c);
  c = base; c.H = 1; c.Hkv = 1; c.L = 66; c.S = 70; c.E = c.Ev = 256; c.mask = 1; all.push_back(c);
  // The variants, alone and together.
  c = base; c.causal = true; c.bottom_right = true; c.alibi = true; all.push_back(c);  // L < S
  c = base; c.L = 130; c.S = 70; c.causal = true; c.bottom_right = true; c.sinks = true;
  all.push_back(c);                                      // L > S: the first rows see no key
  c = base; c.window_left = 32; c.window_right = 0; c.softcap = 5.0; all.push_back(c);
  c = base; c.window_left = 20; c.window_right = 10; c.bottom_right = true; c.mask = 2;
  c.dropout = 0.2; all.push_back(c);
  c = base; c.H = 4; c.Hkv = 2; c.softcap = 2.0; c.dropout = 0.3; c.sinks = true; c.mask = 1;
  all.push_back(c);                                      // an empty row with a sink
  c = base; c.L = 65; c.S = 200; c.E = c.Ev = 128; c.window_left = 40; c.window_right = 3;
  c.softcap = 8.0; c.alibi = true; c.sinks = true; all.push_back(c);
  return all;
}

// Packed sequences (FlashAttention's varlen layout) and a paged cache, read
// through the params' Sequences and Pages: every sequence against the
// float64 reference of that sequence alone.
struct Packed {
  std::vector<int> lens_q, lens_k;
  int H = 4, Hkv = 2, E = 64;
  bool causal = true;
  KVStorage storage = KVStorage::Dense;  // quantized K/V: codes and a scale per row and head
};

// Rows (rows, heads, E) as 8-bit codes of `storage` and a float scale per
// row and head (scale = max|row| / the largest code, as quantize_kv); the
// rows are replaced by the values the codes hold, code · scale.
template <typename T>
std::pair<std::vector<uint8_t>, std::vector<float>> quantized_rows(std::vector<T>& rows, int E,
                                                                   KVStorage storage) {
  const double qmax = storage == KVStorage::Int8 ? 127 : storage == KVStorage::Float8E4M3 ? 448 : 57344;
  std::vector<uint8_t> codes(rows.size());
  std::vector<float> scales(rows.size() / E);
  for (size_t r = 0; r < scales.size(); ++r) {
    double top = 0;
    for (int e = 0; e < E; ++e) top = std::max(top, std::abs(to_double(rows[r * E + e])));
    scales[r] = float(top / qmax);
    for (int e = 0; e < E; ++e) {
      const double x = scales[r] > 0 ? to_double(rows[r * E + e]) / scales[r] : 0.0;
      uint8_t c = 0;
      if (storage == KVStorage::Int8) {
        c = uint8_t(int8_t(std::nearbyint(std::clamp(x, -qmax, qmax))));
      } else {  // (the nearest fp8 value: the reference reads whichever code it is)
        for (int n = 1; n < 256; ++n) {
          const double value = code_value(storage, uint8_t(n));
          if (std::abs(value - x) < std::abs(code_value(storage, c) - x)) c = uint8_t(n);
        }
      }
      codes[r * E + e] = c;
      rows[r * E + e] = from_double<T>(double(code_value(storage, c) * scales[r]));
    }
  }
  return {codes, scales};
}

template <typename T>
void run_packed(const Packed& pk, Kernels kernels, int page) {
  SCOPED_TRACE(std::string(kernels == Kernels::TensorCores ? "[tensor cores]" : "[simple]") +
               (page ? " paged" : "") + (pk.causal ? " causal" : ""));
  using A = typename simple::AccOf<T>::type;
  const int B = int(pk.lens_q.size()), H = pk.H, Hkv = pk.Hkv, E = pk.E;
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (int b = 0; b < B; ++b) {
    cu_q.push_back(cu_q.back() + pk.lens_q[b]);
    cu_k.push_back(cu_k.back() + pk.lens_k[b]);
  }
  const int total_q = cu_q.back(), total_k = cu_k.back();
  const int max_q = *std::max_element(pk.lens_q.begin(), pk.lens_q.end());
  const int max_k = *std::max_element(pk.lens_k.begin(), pk.lens_k.end());
  std::mt19937 rng(11);
  std::normal_distribution<double> n01(0.0, 1.0);
  auto randoms = [&](size_t count) {
    std::vector<T> x(count);
    for (auto& e : x) e = from_double<T>(n01(rng));
    return x;
  };
  // (rows, heads, E) arrays, rows one after another.
  std::vector<T> q = randoms(size_t(total_q) * H * E), k = randoms(size_t(total_k) * Hkv * E),
                 v = randoms(size_t(total_k) * Hkv * E), dout = randoms(size_t(total_q) * H * E);
  auto rows_matrix = [&](void* data, int heads, int divisor) {
    Matrix m;
    m.data = data;
    m.outer_stride[1] = E;  // (the sequence dim: its rows are found through cu_q / cu_k)
    m.divisor[1] = divisor;
    m.row_stride = int64_t(heads) * E;
    return m;
  };
  AttentionParams p;
  p.dtype = dtype_of<T>();
  p.outer.dims = 2;
  p.outer.size[0] = B;
  p.outer.size[1] = H;
  p.num_outer = int64_t(B) * H;
  p.len_q = max_q;
  p.len_kv = max_k;
  p.dim_qk = p.dim_v = E;
  p.q = rows_matrix(q.data(), H, 1);
  p.k = rows_matrix(k.data(), Hkv, H / Hkv);
  p.v = rows_matrix(v.data(), Hkv, H / Hkv);
  p.seq.cu_q = cu_q.data();
  p.seq.cu_k = cu_k.data();
  p.seq.heads = H;
  p.scale = 1.0 / std::sqrt(double(E));
  // Quantized K/V: the kernel reads the codes, the reference their values.
  std::pair<std::vector<uint8_t>, std::vector<float>> k_codes, v_codes;
  if (pk.storage != KVStorage::Dense) {
    k_codes = quantized_rows(k, E, pk.storage);
    v_codes = quantized_rows(v, E, pk.storage);
    p.kv_storage = pk.storage;
    auto scale_matrix = [&](float* data) {  // (rows, Hkv) one-column matrices
      Matrix m;
      m.data = data;
      m.outer_stride[1] = 1;
      m.divisor[1] = H / Hkv;
      m.row_stride = Hkv;
      return m;
    };
    p.k.data = k_codes.first.data();
    p.v.data = v_codes.first.data();
    p.k_scale = scale_matrix(k_codes.second.data());
    p.v_scale = scale_matrix(v_codes.second.data());
  }
  p.bottom_right = true;
  p.window_right = pk.causal ? 0 : -1;
  // A paged copy of K/V: each sequence's keys in pages of `page` rows, the
  // pages in reverse order, so that nothing is where the packed rows were.
  const int per_sequence = (max_k + std::max(page, 1) - 1) / std::max(page, 1);
  std::vector<T> k_pages, v_pages;
  std::vector<int32_t> table;
  if (page) {
    const int pages = B * per_sequence;
    k_pages.assign(size_t(pages) * page * Hkv * E, from_double<T>(1e4));
    v_pages = k_pages;
    for (int b = 0; b < B; ++b) {
      for (int t = 0; t < per_sequence; ++t) table.push_back(pages - 1 - (b * per_sequence + t));
      for (int j = 0; j < pk.lens_k[b]; ++j) {
        const size_t dst = (size_t(table[b * per_sequence + j / page]) * page + j % page) * Hkv * E;
        const size_t src = size_t(cu_k[b] + j) * Hkv * E;
        std::copy_n(k.begin() + src, Hkv * E, k_pages.begin() + dst);
        std::copy_n(v.begin() + src, Hkv * E, v_pages.begin() + dst);
      }
    }
    p.k.data = k_pages.data();
    p.v.data = v_pages.data();
    p.pages.table = table.data();
    p.pages.table_stride = per_sequence;
    p.pages.size = page;
    p.pages.page_stride_k = p.pages.page_stride_v = int64_t(page) * Hkv * E;
  }
  std::vector<T> out(size_t(total_q) * H * E, from_double<T>(-7));
  std::vector<A> lse(size_t(H) * total_q, A(-7));
  p.out = rows_matrix(out.data(), H, 1);
  p.lse.data = lse.data();  // (H, total_q)
  p.lse.outer_stride[1] = total_q;
  p.lse.row_stride = 1;
  int64_t rng_state[2];
  p.dropout.state_out = rng_state;

  const size_t w = simple::kWarpsPerBlock;
  if (kernels == Kernels::TensorCores) {
    const unsigned blocks = unsigned((max_q + flash_fwd::kBlockQ - 1) / flash_fwd::kBlockQ * p.num_outer);
    emulation::launch(blocks, flash_fwd::kThreads, flash_fwd::smem_bytes(64), [&] {
      if constexpr (std::is_same_v<T, __half>) flash_fwd::kernel<T, 64>(p);
    });
  } else {
    emulation::launch(unsigned((p.num_outer * max_q + w - 1) / w), w * 32, size_t(2 * E) * sizeof(A) * w,
                      [&] { simple::forward_kernel<T, A>(p); });
  }

  // The backward (not for pages or codes: a paged cache and quantized K/V are forward only).
  std::vector<A> delta(size_t(H) * total_q), grad_q(size_t(total_q) * H * E, A(0)),
      grad_k(size_t(total_k) * H * E, A(0)), grad_v(size_t(total_k) * H * E, A(0));
  const bool forward_only = page || pk.storage != KVStorage::Dense;
  if (!forward_only) {
    for (int r = 0; r < total_q; ++r)
      for (int h = 0; h < H; ++h) {
        double d = 0;
        for (int e = 0; e < E; ++e) {
          const size_t n = (size_t(r) * H + h) * E + e;
          d += to_double(out[n]) * to_double(dout[n]);
        }
        delta[size_t(h) * total_q + r] = A(d);
      }
    BackwardParams bp;
    bp.fwd = p;
    bp.fwd.dropout.state_out = nullptr;
    bp.grad_out = rows_matrix(dout.data(), H, 1);
    bp.delta = p.lse;
    bp.delta.data = delta.data();
    bp.grad_q = rows_matrix(grad_q.data(), H, 1);
    bp.grad_k = rows_matrix(grad_k.data(), H, 1);
    bp.grad_v = rows_matrix(grad_v.data(), H, 1);
    if (kernels == Kernels::TensorCores) {
      const unsigned blocks = unsigned((max_k + flash_bwd::kBlockKV - 1) / flash_bwd::kBlockKV * p.num_outer);
      emulation::launch(blocks, flash_bwd::kThreads, flash_bwd::smem_bytes(64), [&] {
        if constexpr (std::is_same_v<T, __half>) flash_bwd::kernel<T, 64>(bp);
      });
    } else {
      emulation::launch(unsigned((p.num_outer * max_q + w - 1) / w), w * 32,
                        size_t(3 * E) * sizeof(A) * w, [&] { simple::backward_dq_kernel<T, A>(bp); });
      emulation::launch(unsigned((p.num_outer * max_k + w - 1) / w), w * 32,
                        size_t(4 * E) * sizeof(A) * w, [&] { simple::backward_dkdv_kernel<T, A>(bp); });
    }
  }

  // Each sequence alone through the float64 reference.
  const double tol = tolerance_for(p.dtype);
  const double gtol = kernels == Kernels::TensorCores ? 3 * tol : tol;
  for (int b = 0; b < B; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    Problem pr;
    pr.c.B = 1;
    pr.c.H = H;
    pr.c.Hkv = Hkv;
    pr.c.L = pk.lens_q[b];
    pr.c.S = pk.lens_k[b];
    pr.c.E = pr.c.Ev = E;
    pr.c.causal = pk.causal;
    pr.c.bottom_right = true;
    pr.scale = p.scale;
    // (B = 1, heads, rows, E) copies of the sequence's rows.
    auto gather = [&](const std::vector<T>& src, int heads, int first, int rows) {
      std::vector<double> dst;
      for (int h = 0; h < heads; ++h)
        for (int r = 0; r < rows; ++r)
          for (int e = 0; e < E; ++e) dst.push_back(to_double(src[(size_t(first + r) * heads + h) * E + e]));
      return dst;
    };
    pr.q = gather(q, H, cu_q[b], pr.c.L);
    pr.k = gather(k, Hkv, cu_k[b], pr.c.S);
    pr.v = gather(v, Hkv, cu_k[b], pr.c.S);
    pr.dout = gather(dout, H, cu_q[b], pr.c.L);
    const Reference ref = reference(pr);
    const int L = pr.c.L, S = pr.c.S;
    EXPECT_LE(max_error(ref.out, [&](size_t n) {
                const int h = int(n / (size_t(L) * E)), i = int(n / E % L), e = int(n % E);
                return to_double(out[(size_t(cu_q[b] + i) * H + h) * E + e]);
              }), tol) << "output";
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < L; ++i) {
        const double want = ref.lse[size_t(h) * L + i], got = lse[size_t(h) * total_q + cu_q[b] + i];
        if (std::isinf(want)) EXPECT_TRUE(std::isinf(got) && got > 0);
        else EXPECT_NEAR(got, want, 1e-4 * std::max(1.0, std::abs(want)));
      }
    if (forward_only) continue;
    EXPECT_LE(max_error(ref.dq, [&](size_t n) {
                const int h = int(n / (size_t(L) * E)), i = int(n / E % L), e = int(n % E);
                return double(grad_q[(size_t(cu_q[b] + i) * H + h) * E + e]);
              }), gtol) << "grad_q";
    // (Per output head, as the kernels write them.)
    EXPECT_LE(max_error(ref.dk, [&](size_t n) {
                const int h = int(n / (size_t(S) * E)), j = int(n / E % S), e = int(n % E);
                return double(grad_k[(size_t(cu_k[b] + j) * H + h) * E + e]);
              }), gtol) << "grad_k";
    EXPECT_LE(max_error(ref.dv, [&](size_t n) {
                const int h = int(n / (size_t(S) * E)), j = int(n / E % S), e = int(n % E);
                return double(grad_v[(size_t(cu_k[b] + j) * H + h) * E + e]);
              }), gtol) << "grad_v";
  }
}

TEST(CudaEmulated, PackedSequences) {
  Packed pk;
  pk.lens_q = {37, 0, 70, 1};
  pk.lens_k = {50, 3, 70, 130};
  run_packed<__half>(pk, Kernels::TensorCores, 0);
  run_packed<float>(pk, Kernels::Simple, 0);
  pk.causal = false;
  run_packed<float>(pk, Kernels::Simple, 0);
  run_packed<__half>(pk, Kernels::TensorCores, 0);
}

TEST(CudaEmulated, QuantizedKV) {
  // The simple kernels read int8 and fp8 codes, each key row's scale on its
  // score and each value row's on its probability.
  Packed pk;
  pk.lens_q = {1, 4, 1};
  pk.lens_k = {50, 17, 130};
  for (const KVStorage s : {KVStorage::Int8, KVStorage::Float8E4M3, KVStorage::Float8E5M2}) {
    pk.storage = s;
    run_packed<float>(pk, Kernels::Simple, 0);
  }
}

TEST(CudaEmulated, PagedCache) {
  Packed pk;
  pk.lens_q = {3, 1, 7};
  pk.lens_k = {50, 17, 130};
  for (const int page : {16, 48}) run_packed<float>(pk, Kernels::Simple, page);
}

TEST(CudaEmulated, TensorCoreKernelsHalf) {
  for (const Case& c : cases()) run_case<__half>(c, Kernels::TensorCores);
}

TEST(CudaEmulated, TensorCoreKernelsBFloat16) {
  for (const Case& c : cases()) run_case<__nv_bfloat16>(c, Kernels::TensorCores);
}

TEST(CudaEmulated, SimpleKernels) {
  // (Slow to emulate: a shuffle per key. Nothing in them is head-dim specific.)
  for (const Case& c : cases()) {
    if (c.E <= 64) run_case<float>(c, Kernels::Simple);
  }
  Case c;
  c.dropout = 0.3;
  c.mask = 1;
  run_case<double>(c, Kernels::Simple);
  c.dropout = 0.0;
  c.mask = 2;
  c.causal = true;
  run_case<__half>(c, Kernels::Simple);
}

}  // namespace
}  // namespace fusedmha::cuda
