#pragma once

// The arguments of each attention op as its kernels take them: one record
// per op, on every backend (CPU, CUDA, Meta, Autograd, Autocast), so that no
// internal signature spells the arguments out. The fields follow the op's
// schema (ops/registration.cpp), except that the schema's six variant
// keywords arrive as one AttentionVariants. A record refers to the call's
// arguments and lives as long as the call.
//
// FUSEDMHA_OP_IMPL(m, fn) registers fn, a function of one record, for the
// op that record belongs to: the adapter below turns the schema's flat
// arguments into the variants and the record. call_op and find_op go the
// other way, for code that calls the ops through the dispatcher. A new
// variant is then one field of AttentionVariants, one schema keyword, and
// one argument in each of the three conversions below (SplitAtVariants,
// schema_args, variants_from_ivalue).

#include <ATen/core/dispatch/Dispatcher.h>
#include <fusedmha/attention.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace fusedmha::ops {

using OptTensor = std::optional<at::Tensor>;

// fusedmha::scaled_dot_product_attention.
struct SdpaArgs {
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& value;
  const OptTensor& attn_mask;
  double dropout_p;
  bool is_causal;
  std::optional<double> scale;
  bool enable_gqa;
  const AttentionVariants& variants;
};

// fusedmha::attention_forward.
struct ForwardArgs {
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& value;
  const OptTensor& attn_mask;
  double dropout_p;
  bool is_causal;
  std::optional<double> scale;
  bool enable_gqa;
  const AttentionVariants& variants;
  const OptTensor& dropout_state;
};

// fusedmha::attention_backward.
struct BackwardArgs {
  const at::Tensor& grad_out;
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& value;
  const at::Tensor& out;
  const at::Tensor& logsumexp;
  const at::Tensor& rng_state;
  const OptTensor& attn_mask;
  double dropout_p;
  bool is_causal;
  std::optional<double> scale;
  bool enable_gqa;
  const AttentionVariants& variants;
  const OptTensor& grad_logsumexp;
  bool grad_attn_mask;
};

// fusedmha::attention_weights.
struct WeightsArgs {
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& logsumexp;
  const at::Tensor& rng_state;
  const OptTensor& attn_mask;
  double dropout_p;
  bool is_causal;
  std::optional<double> scale;
  bool enable_gqa;
  bool average_heads;
  const AttentionVariants& variants;
};

// fusedmha::varlen_attention_forward.
struct VarlenForwardArgs {
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& value;
  const at::Tensor& cu_seqlens_q;
  const at::Tensor& cu_seqlens_k;
  int64_t max_seqlen_q;
  int64_t max_seqlen_k;
  double dropout_p;
  bool is_causal;
  std::optional<double> scale;
  const AttentionVariants& variants;
  const OptTensor& seqused_k;
  const OptTensor& block_table;
  const OptTensor& k_scale;
  const OptTensor& v_scale;
};

// fusedmha::varlen_attention_backward.
struct VarlenBackwardArgs {
  const at::Tensor& grad_out;
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& value;
  const at::Tensor& out;
  const at::Tensor& logsumexp;
  const at::Tensor& rng_state;
  const at::Tensor& cu_seqlens_q;
  const at::Tensor& cu_seqlens_k;
  int64_t max_seqlen_q;
  int64_t max_seqlen_k;
  double dropout_p;
  bool is_causal;
  std::optional<double> scale;
  const AttentionVariants& variants;
  const OptTensor& seqused_k;
  const OptTensor& grad_logsumexp;
};

// fusedmha::attention_with_kvcache (whose schema is its own: FlashAttention's
// flash_attn_with_kvcache, the variants aligned bottom-right).
struct KVCacheArgs {
  const at::Tensor& q;
  at::Tensor& k_cache;
  at::Tensor& v_cache;
  const OptTensor& k;
  const OptTensor& v;
  const OptTensor& rotary_cos;
  const OptTensor& rotary_sin;
  const OptTensor& cache_seqlens;
  const OptTensor& cache_batch_idx;
  const OptTensor& cache_leftpad;
  const OptTensor& block_table;
  std::optional<double> scale;
  bool is_causal;
  bool rotary_interleaved;
  int64_t window_left;
  int64_t window_right;
  double softcap;
  const OptTensor& alibi_slopes;
  const OptTensor& sinks;
  std::optional<c10::SymInt> cache_seqlens_value;
  const OptTensor& k_scale;
  const OptTensor& v_scale;

  AttentionVariants variants() const {
    return {window_left, window_right, /*bottom_right=*/true, softcap, alibi_slopes, sinks};
  }
};

// Each record's op: its name and its C++ form, the public function of
// <fusedmha/attention.h> (the schema's arguments, the variants as one).
template <typename Args>
struct OpOf;

#define FUSEDMHA_OP_OF(ARGS, NAME)                                    \
  template <>                                                         \
  struct OpOf<ARGS> {                                                 \
    static constexpr const char* kName = #NAME;                       \
    static constexpr const char* kQualifiedName = "fusedmha::" #NAME; \
    using Function = decltype(::fusedmha::NAME);                      \
  };
FUSEDMHA_OP_OF(SdpaArgs, scaled_dot_product_attention)
FUSEDMHA_OP_OF(ForwardArgs, attention_forward)
FUSEDMHA_OP_OF(BackwardArgs, attention_backward)
FUSEDMHA_OP_OF(WeightsArgs, attention_weights)
FUSEDMHA_OP_OF(VarlenForwardArgs, varlen_attention_forward)
FUSEDMHA_OP_OF(VarlenBackwardArgs, varlen_attention_backward)
#undef FUSEDMHA_OP_OF

// The schema of attention_with_kvcache, flat: no C++ function has its form
// (fusedmha::attention_with_kvcache takes a KVCacheStep).
template <>
struct OpOf<KVCacheArgs> {
  static constexpr const char* kName = "attention_with_kvcache";
  static constexpr const char* kQualifiedName = "fusedmha::attention_with_kvcache";
  using Function = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, at::Tensor&, at::Tensor&, const OptTensor&, const OptTensor&,
      const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
      const OptTensor&, std::optional<double>, bool, bool, int64_t, int64_t, double,
      const OptTensor&, const OptTensor&, std::optional<c10::SymInt>, const OptTensor&,
      const OptTensor&);
};

namespace op_args_detail {

template <typename... T>
struct Types {};

// A parameter list split at its `const AttentionVariants&`: Flat is the
// schema's signature (the six variant arguments in its place), and
// Kernel<fn>::call takes those and calls fn with the variants as one.
template <typename R, typename Before, typename... Rest>
struct SplitAtVariants;

template <typename R, typename... B, typename... A>
struct SplitAtVariants<R, Types<B...>, const AttentionVariants&, A...> {
  using Flat = R(B..., int64_t, int64_t, bool, double, const OptTensor&, const OptTensor&, A...);

  template <auto fn>
  struct Kernel {
    static R call(B... before, int64_t window_left, int64_t window_right, bool bottom_right,
                  double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks,
                  A... after) {
      const AttentionVariants variants{window_left, window_right, bottom_right,
                                       softcap,     alibi_slopes, sinks};
      return fn(std::forward<B>(before)..., variants, std::forward<A>(after)...);
    }
  };
};

template <typename R, typename... B, typename T, typename... A>
struct SplitAtVariants<R, Types<B...>, T, A...> : SplitAtVariants<R, Types<B..., T>, A...> {};

// A list without one (a schema of its own): the flat signature as it is.
template <typename R, typename... B>
struct SplitAtVariants<R, Types<B...>> {
  using Flat = R(B...);

  template <auto fn>
  struct Kernel {
    static R call(B... args) { return fn(std::forward<B>(args)...); }
  };
};

template <typename F>
struct Form;

template <typename R, typename... P>
struct Form<R(P...)> {
  using Split = SplitAtVariants<R, Types<>, P...>;
  // The op's C++ form, calling fn with the record Args of its parameters.
  template <typename Args, auto fn>
  static R record(P... p) {
    return fn(Args{p...});
  }
};

template <typename F>
struct RecordOf;

template <typename R, typename Args>
struct RecordOf<R (*)(const Args&)> {
  using type = Args;
};

}  // namespace op_args_detail

// The schema's signature of the op whose C++ form is F.
template <typename F>
using SchemaSignature = typename op_args_detail::Form<F>::Split::Flat;

// fn, a function of one record, as a kernel of the schema's arguments.
template <auto fn>
struct OpKernel {
  using Args = typename op_args_detail::RecordOf<decltype(fn)>::type;
  using Form = op_args_detail::Form<typename OpOf<Args>::Function>;
  static constexpr auto kRecord = &Form::template record<Args, fn>;
  static constexpr auto kFlat = &Form::Split::template Kernel<kRecord>::call;
};

#define FUSEDMHA_OP_IMPL(m, fn)                                                  \
  (m).impl(::fusedmha::ops::OpOf<::fusedmha::ops::OpKernel<&(fn)>::Args>::kName, \
           TORCH_FN(::fusedmha::ops::OpKernel<&(fn)>::kFlat))

// The typed dispatcher handle of the op that record Args belongs to.
template <typename Args>
c10::TypedOperatorHandle<SchemaSignature<typename OpOf<Args>::Function>> find_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(OpOf<Args>::kQualifiedName, "")
      .template typed<SchemaSignature<typename OpOf<Args>::Function>>();
}

namespace op_args_detail {

// An argument of call_op as a tuple of schema arguments.
template <typename T>
auto schema_args(T&& arg) {
  if constexpr (std::is_same_v<std::decay_t<T>, AttentionVariants>) {
    return std::forward_as_tuple(arg.window_left, arg.window_right, arg.bottom_right, arg.softcap,
                                 arg.alibi_slopes, arg.sinks);
  } else {
    return std::forward_as_tuple(std::forward<T>(arg));
  }
}

}  // namespace op_args_detail

// The variants as one IValue (a tuple of the schema's six arguments) and
// back: how autograd keeps them for the backward.
inline c10::IValue variants_ivalue(const AttentionVariants& v) {
  return std::apply(
      [](const auto&... arg) {
        return c10::IValue(c10::ivalue::Tuple::create(c10::IValue(arg)...));
      },
      op_args_detail::schema_args(v));
}

inline AttentionVariants variants_from_ivalue(const c10::IValue& value) {
  const auto& e = value.toTupleRef().elements();
  auto tensor = [](const c10::IValue& t) {
    return t.isNone() ? OptTensor() : OptTensor(t.toTensor());
  };
  return {e[0].toInt(), e[1].toInt(), e[2].toBool(), e[3].toDouble(), tensor(e[4]), tensor(e[5])};
}

// Calls op with args, in its C++ form (an AttentionVariants for the six).
template <typename Signature, typename... Args>
decltype(auto) call_op(const c10::TypedOperatorHandle<Signature>& op, Args&&... args) {
  return std::apply(
      [&](auto&&... flat) -> decltype(auto) {
        return op.call(std::forward<decltype(flat)>(flat)...);
      },
      std::tuple_cat(op_args_detail::schema_args(std::forward<Args>(args))...));
}

}  // namespace fusedmha::ops
