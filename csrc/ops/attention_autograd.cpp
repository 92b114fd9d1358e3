// Autograd for the fusedmha ops, registered once, in C++, so C++ callers
// train exactly like Python ones. The forward's backward is its own op
// (fusedmha::attention_backward) with its own kernels; the attention
// weights' backward is composed of ATen ops (it is O(L·S) like the weights).

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <fusedmha/attention.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/attention_checks.h"
#include "ops/attention_shapes.h"
#include "ops/op_args.h"

namespace fusedmha::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The arguments of an attention call besides its tensors q, k, v, kept for
// its backward. (The Functions below also take the sinks on their own: autograd
// differentiates only the tensors it is given as arguments.)
struct SavedCall {
  std::optional<at::Tensor> attn_mask;
  double dropout_p;
  bool is_causal;
  std::optional<double> scale;
  bool enable_gqa;
  AttentionVariants variants;

  static c10::IValue optional(const std::optional<at::Tensor>& t) {
    return t.has_value() ? c10::IValue(*t) : c10::IValue();
  }
  static std::optional<at::Tensor> optional_tensor(const c10::IValue& v) {
    return v.isNone() ? std::nullopt : std::optional<at::Tensor>(v.toTensor());
  }

  void save(AutogradContext* ctx) const {
    ctx->saved_data["attn_mask"] = optional(attn_mask);
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
    ctx->saved_data["enable_gqa"] = enable_gqa;
    ctx->saved_data["variants"] = variants_ivalue(variants);
  }

  static SavedCall load(AutogradContext* ctx) {
    const c10::IValue& scale = ctx->saved_data["scale"];
    return {optional_tensor(ctx->saved_data["attn_mask"]),
            ctx->saved_data["dropout_p"].toDouble(),
            ctx->saved_data["is_causal"].toBool(),
            scale.isNone() ? std::nullopt : std::optional<double>(scale.toDouble()),
            ctx->saved_data["enable_gqa"].toBool(),
            variants_from_ivalue(ctx->saved_data["variants"])};
  }
};

// The gradient of the sinks from a per-row term r (..., H, L), shaped like
// lse: a sink is a logit with no value, so every row's probability of it,
// exp(sink - lse), takes −p_sink·r: d loss / d sink = −Σ_rows p_sink·r.
// For the output r = rowsum(dO ∘ O); for the weights r = rowsum(G ∘ W).
at::Tensor sinks_gradient(const at::Tensor& sinks, const at::Tensor& lse,
                          const at::Tensor& row_terms) {
  const at::Tensor sink =
      lse.dim() >= 2 ? sinks.to(lse.scalar_type()).unsqueeze(-1) : sinks.to(lse.scalar_type());
  const at::Tensor per_row = sink.sub(lse).exp().mul(row_terms).neg();
  const at::Tensor per_head = lse.dim() >= 2 ? per_row.sum(-1) : per_row.sum().reshape({1});
  return at::sum_to(per_head, sinks.sizes()).to(sinks.scalar_type());
}

// Whether a float mask's gradient is asked for (Function::apply runs
// forward with grad mode off: read before it).
bool mask_needs_grad(const std::optional<at::Tensor>& attn_mask) {
  return attn_mask.has_value() && attn_mask->requires_grad() && at::GradMode::is_enabled();
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value,
                               const std::optional<at::Tensor>& /*attn_mask*/,
                               const SavedCall& call, bool mask_grad,
                               const std::optional<at::Tensor>& /*sinks*/,
                               const std::optional<at::Tensor>& dropout_state) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse, rng_state] = fusedmha::attention_forward(
        query, key, value, call.attn_mask, call.dropout_p, call.is_causal, call.scale,
        call.enable_gqa, call.variants, dropout_state);
    // The log-sum-exp is differentiable (a merge of partial results weighs by
    // it); the rng state is not.
    ctx->mark_non_differentiable({rng_state});
    ctx->save_for_backward({query, key, value, out, lse, rng_state});
    call.save(ctx);
    ctx->saved_data["mask_grad"] = mask_grad;
    return {out, lse, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& out = saved[3];
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const SavedCall call = SavedCall::load(ctx);
    const std::optional<at::Tensor> grad_lse =
        grads[1].defined() ? std::optional<at::Tensor>(grads[1]) : std::nullopt;
    // (Only where it is still wanted: torch.autograd.grad(out, q) skips it.)
    const bool mask_grad = ctx->saved_data["mask_grad"].toBool() && ctx->needs_input_grad(3);
    auto [dq, dk, dv, dmask] = fusedmha::attention_backward(
        grad_out, saved[0], saved[1], saved[2], out, saved[4], saved[5], call.attn_mask,
        call.dropout_p, call.is_causal, call.scale, call.enable_gqa, call.variants, grad_lse,
        mask_grad);
    // (query, key, value, attn_mask, call, mask_grad, sinks, dropout_state)
    variable_list result(8);
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    if (mask_grad) result[3] = dmask;
    if (call.variants.sinks.has_value()) {
      const auto acc = saved[4].scalar_type();
      at::Tensor row_terms = grad_out.to(acc).mul(out.to(acc)).sum(-1);
      if (grad_lse.has_value()) row_terms = row_terms.sub(grad_lse->to(acc));
      result[6] = sinks_gradient(*call.variants.sinks, saved[4], row_terms);
    }
    return result;
  }
};

// The backward op is differentiable only in name: with create_graph=True its
// outputs carry a node that refuses a second backward with a clear message.
class AttentionBackwardFunction : public torch::autograd::Function<AttentionBackwardFunction> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor& grad_out,
                               const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const at::Tensor& out,
                               const at::Tensor& logsumexp, const at::Tensor& rng_state,
                               const SavedCall& call,
                               const std::optional<at::Tensor>& grad_logsumexp,
                               bool grad_attn_mask) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv, dmask] = fusedmha::attention_backward(
        grad_out, query, key, value, out, logsumexp, rng_state, call.attn_mask, call.dropout_p,
        call.is_causal, call.scale, call.enable_gqa, call.variants, grad_logsumexp, grad_attn_mask);
    return {dq, dk, dv, dmask};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, kBackwardOp,
                ": double backward (differentiating its gradients again) is not supported");
  }
};

// The weights W = P∘K (P the probabilities, K the dropout's keep factors,
// all ones without dropout), averaged over heads or not. With G the
// gradient of W per head, the softmax backward gives the gradient of the
// scaled scores dS = P∘(G∘K − rowsum(G∘K∘P)) = G∘W − P∘rowsum(G∘W), so
// the backward needs W per head and P (one more weights pass each), never
// the keep mask itself. lse and rng_state get no gradient: the softmax
// Jacobian already covers lse's dependence on query and key.
class AttentionWeightsFunction : public torch::autograd::Function<AttentionWeightsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& logsumexp, const at::Tensor& rng_state,
                               const std::optional<at::Tensor>& /*attn_mask*/,
                               const SavedCall& call, bool mask_grad, bool average_heads,
                               const std::optional<at::Tensor>& /*sinks*/) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor weights = fusedmha::attention_weights(
        query, key, logsumexp, rng_state, call.attn_mask, call.dropout_p, call.is_causal,
        call.scale, call.enable_gqa, average_heads, call.variants);
    ctx->save_for_backward({query, key, logsumexp, rng_state});
    call.save(ctx);
    ctx->saved_data["average_heads"] = average_heads;
    ctx->saved_data["mask_grad"] = mask_grad;
    return {weights};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // (query, key, logsumexp, rng_state, attn_mask, call, mask_grad, average_heads, sinks)
    variable_list result(9);
    if (!grads[0].defined()) return result;
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &query = saved[0], &key = saved[1], &lse = saved[2];
    const auto acc = lse.scalar_type();
    const SavedCall call = SavedCall::load(ctx);
    // P and W recomputed from the inputs widened to lse's dtype (float for
    // half precision: the same scores), not in the input dtype: rounded to
    // bf16, each probability carried an error of up to 2^-9, and the
    // gradients of q and k came out about twice as far from the truth as
    // their own rounding. (A half-precision float mask is widened with them;
    // a float32 one is taken as it is.) With autocast off for the whole
    // pass: active here when backward() runs inside torch.autocast, it cast
    // the widened inputs back down, and ran the matmuls below in bf16.
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor q = query.to(acc), k_acc = key.to(acc);
    std::optional<at::Tensor> mask = call.attn_mask;
    if (mask.has_value() && at::isReducedFloatingType(mask->scalar_type())) mask = mask->to(acc);
    auto weights_per_head = [&](double dropout_p) {
      return fusedmha::attention_weights(q, k_acc, lse, saved[3], mask, dropout_p, call.is_causal,
                                         call.scale, call.enable_gqa,
                                         /*average_heads=*/false, call.variants);
    };
    const at::Tensor kept = weights_per_head(call.dropout_p);
    const at::Tensor probs = call.dropout_p > 0 ? weights_per_head(0.0) : kept;
    at::Tensor grad = grads[0].to(acc);
    if (grad.dim() < kept.dim()) grad = grad.unsqueeze(-3).div(kept.size(-3));  // averaged heads
    const at::Tensor grad_kept = grad.mul(kept);
    const at::Tensor row_sums = grad_kept.sum(-1, /*keepdim=*/true);
    // The gradient of the scores after softcap, ALiBi and masks (those add
    // constants, or zero P).
    at::Tensor grad_scores = grad_kept.sub(probs.mul(row_sums));
    if (ctx->saved_data["mask_grad"].toBool() && ctx->needs_input_grad(4)) {
      result[4] = mask_gradient(
          *call.attn_mask,
          scaled_mask_gradient_sums(
              at::sum_to(grad_scores, mask_gradient_sums_shape(*call.attn_mask)), *call.attn_mask));
    }

    at::Tensor k = k_acc;
    if (key.dim() >= 3 && k.size(-3) != 1 && k.size(-3) != grad_scores.size(-3)) {
      k = k.repeat_interleave(grad_scores.size(-3) / k.size(-3), -3);  // GQA groups
    }
    const double scale = attention_scale(query, call.scale);
    if (call.variants.softcap > 0) {
      // s = c·tanh(r / c) of the scaled product r: ds/dr = 1 − tanh².
      const at::Tensor t = q.matmul(k.transpose(-2, -1)).mul(scale / call.variants.softcap).tanh();
      grad_scores = grad_scores.mul(t.mul(t).neg_().add_(1.0));
    }
    grad_scores = grad_scores.mul(scale);
    result[0] = reduce_to_input(grad_scores.matmul(k), query);
    result[1] = reduce_to_input(grad_scores.transpose(-2, -1).matmul(q), key);
    if (call.variants.sinks.has_value()) {
      result[8] = sinks_gradient(*call.variants.sinks, lse, row_sums.squeeze(-1));
    }
    return result;
  }
};

// A packed batch's lengths (ops/packed_batch.h), kept for its backward.
void save_packed_batch(AutogradContext* ctx, const PackedBatch& batch) {
  ctx->saved_data["cu_seqlens_q"] = batch.cu_seqlens_q;
  ctx->saved_data["cu_seqlens_k"] = batch.cu_seqlens_k;
  ctx->saved_data["max_seqlen_q"] = batch.max_seqlen_q;
  ctx->saved_data["max_seqlen_k"] = batch.max_seqlen_k;
  ctx->saved_data["seqused_k"] = SavedCall::optional(batch.seqused_k);
}

PackedBatch load_packed_batch(AutogradContext* ctx) {
  return {ctx->saved_data["cu_seqlens_q"].toTensor(), ctx->saved_data["cu_seqlens_k"].toTensor(),
          ctx->saved_data["max_seqlen_q"].toInt(), ctx->saved_data["max_seqlen_k"].toInt(),
          SavedCall::optional_tensor(ctx->saved_data["seqused_k"])};
}

// varlen_attention_forward: as AttentionFunction, on a packed batch.
class VarlenAttentionFunction : public torch::autograd::Function<VarlenAttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const PackedBatch& batch,
                               const SavedCall& call, const std::optional<at::Tensor>& /*sinks*/) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse, rng_state] = fusedmha::varlen_attention_forward(
        query, key, value, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q,
        batch.max_seqlen_k, call.dropout_p, call.is_causal, call.scale, call.variants,
        batch.seqused_k, batch.block_table);
    ctx->saved_data["paged"] = batch.block_table.has_value();
    ctx->mark_non_differentiable({rng_state});
    ctx->save_for_backward({query, key, value, out, lse, rng_state});
    call.save(ctx);
    save_packed_batch(ctx, batch);
    return {out, lse, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!ctx->saved_data["paged"].toBool(), kVarlenForwardOp,
                ": a paged K/V cache (block_table) is forward only; its backward is not "
                "supported");
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& out = saved[3];
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const SavedCall call = SavedCall::load(ctx);
    const PackedBatch batch = load_packed_batch(ctx);
    const std::optional<at::Tensor> grad_lse =
        grads[1].defined() ? std::optional<at::Tensor>(grads[1]) : std::nullopt;
    auto [dq, dk, dv] = fusedmha::varlen_attention_backward(
        grad_out, saved[0], saved[1], saved[2], out, saved[4], saved[5], batch.cu_seqlens_q,
        batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k, call.dropout_p, call.is_causal,
        call.scale, call.variants, batch.seqused_k, grad_lse);
    variable_list result(6);  // (query, key, value, batch, call, sinks)
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    if (call.variants.sinks.has_value()) {
      // Row terms (H, total_q), laid out as the lse.
      const auto acc = saved[4].scalar_type();
      at::Tensor row_terms = grad_out.to(acc).mul(out.to(acc)).sum(-1).t();
      if (grad_lse.has_value()) row_terms = row_terms.sub(grad_lse->to(acc));
      result[5] = sinks_gradient(*call.variants.sinks, saved[4], row_terms);
    }
    return result;
  }
};

// The varlen backward op, differentiable only in name (see
// AttentionBackwardFunction).
class VarlenBackwardFunction : public torch::autograd::Function<VarlenBackwardFunction> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor& grad_out,
                               const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const at::Tensor& out,
                               const at::Tensor& logsumexp, const at::Tensor& rng_state,
                               const PackedBatch& batch, const SavedCall& call,
                               const std::optional<at::Tensor>& grad_logsumexp) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv] = fusedmha::varlen_attention_backward(
        grad_out, query, key, value, out, logsumexp, rng_state, batch.cu_seqlens_q,
        batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k, call.dropout_p, call.is_causal,
        call.scale, call.variants, batch.seqused_k, grad_logsumexp);
    return {dq, dk, dv};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, kVarlenBackwardOp,
                ": double backward (differentiating its gradients again) is not supported");
  }
};

// Called before Function::apply: the slopes get no gradient.
void check_slopes_need_no_grad(const char* op, const std::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK(
      !alibi_slopes.has_value() || !alibi_slopes->requires_grad() || !at::GradMode::is_enabled(),
      op,
      ": gradients with respect to alibi_slopes are not supported; pass "
      "alibi_slopes.detach()");
}

// Whether a call leaves autograd nothing to record: no input requires grad
// (or grad mode is off) and none carries a forward-mode tangent (level 0, as
// PyTorch's generated autograd code tests). Such calls (inference, every
// flash_attn_with_kvcache step) run the op directly below autograd:
// Function::apply's node, saved tensors and saved arguments are work a
// decoding step would pay for nothing, and more where it finds that code
// cold (docs/performance.md, "A decoding call's fixed cost").
bool records_nothing(std::initializer_list<const at::Tensor*> tensors,
                     std::initializer_list<const std::optional<at::Tensor>*> optional) {
  const bool grad_mode = at::GradMode::is_enabled();
  auto involved = [&](const at::Tensor& t) {
    return t.defined() && ((grad_mode && t.requires_grad()) || t._fw_grad(/*level=*/0).defined());
  };
  for (const at::Tensor* t : tensors) {
    if (involved(*t)) return false;
  }
  for (const std::optional<at::Tensor>* t : optional) {
    if (t->has_value() && involved(**t)) return false;
  }
  return true;
}

at::Tensor attention_weights_autograd(const WeightsArgs& a) {
  check_slopes_need_no_grad(kWeightsOp, a.variants.alibi_slopes);
  const SavedCall call{a.attn_mask, a.dropout_p, a.is_causal, a.scale, a.enable_gqa, a.variants};
  return AttentionWeightsFunction::apply(a.query, a.key, a.logsumexp, a.rng_state, a.attn_mask,
                                         call, mask_needs_grad(a.attn_mask), a.average_heads,
                                         a.variants.sinks)[0];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_autograd(
    const BackwardArgs& a) {
  const SavedCall call{a.attn_mask, a.dropout_p, a.is_causal, a.scale, a.enable_gqa, a.variants};
  auto grads =
      AttentionBackwardFunction::apply(a.grad_out, a.query, a.key, a.value, a.out, a.logsumexp,
                                       a.rng_state, call, a.grad_logsumexp, a.grad_attn_mask);
  return {grads[0], grads[1], grads[2], grads[3]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_autograd(const ForwardArgs& a) {
  check_slopes_need_no_grad(kForwardOp, a.variants.alibi_slopes);
  if (records_nothing({&a.query, &a.key, &a.value}, {&a.attn_mask, &a.variants.alibi_slopes,
                                                     &a.variants.sinks, &a.dropout_state})) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return fusedmha::attention_forward(a.query, a.key, a.value, a.attn_mask, a.dropout_p,
                                       a.is_causal, a.scale, a.enable_gqa, a.variants,
                                       a.dropout_state);
  }
  const SavedCall call{a.attn_mask, a.dropout_p, a.is_causal, a.scale, a.enable_gqa, a.variants};
  auto outputs =
      AttentionFunction::apply(a.query, a.key, a.value, a.attn_mask, call,
                               mask_needs_grad(a.attn_mask), a.variants.sinks, a.dropout_state);
  return {outputs[0], outputs[1], outputs[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_forward_autograd(
    const VarlenForwardArgs& a) {
  check_slopes_need_no_grad(kVarlenForwardOp, a.variants.alibi_slopes);
  const bool records = !records_nothing(
      {&a.query, &a.key, &a.value, &a.cu_seqlens_q, &a.cu_seqlens_k},
      {&a.variants.alibi_slopes, &a.variants.sinks, &a.seqused_k, &a.block_table, &a.k_scale,
       &a.v_scale});
  if (!records) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return fusedmha::varlen_attention_forward(
        a.query, a.key, a.value, a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k,
        a.dropout_p, a.is_causal, a.scale, a.variants, a.seqused_k, a.block_table, a.k_scale,
        a.v_scale);
  }
  TORCH_CHECK(!a.k_scale.has_value() && !a.v_scale.has_value(), kVarlenForwardOp,
              ": quantized key and value (k_scale, v_scale) are forward only; call it under "
              "torch.no_grad() or with inputs that do not require grad");
  const SavedCall call{std::nullopt, a.dropout_p,         a.is_causal,
                       a.scale,      /*enable_gqa=*/true, a.variants};
  auto outputs = VarlenAttentionFunction::apply(a.query, a.key, a.value, packed_batch(a), call,
                                                a.variants.sinks);
  return {outputs[0], outputs[1], outputs[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_autograd(
    const VarlenBackwardArgs& a) {
  const SavedCall call{std::nullopt, a.dropout_p,         a.is_causal,
                       a.scale,      /*enable_gqa=*/true, a.variants};
  auto grads =
      VarlenBackwardFunction::apply(a.grad_out, a.query, a.key, a.value, a.out, a.logsumexp,
                                    a.rng_state, packed_batch(a), call, a.grad_logsumexp);
  return {grads[0], grads[1], grads[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, Autograd, m) {
  FUSEDMHA_OP_IMPL(m, attention_forward_autograd);
  FUSEDMHA_OP_IMPL(m, attention_backward_autograd);
  FUSEDMHA_OP_IMPL(m, attention_weights_autograd);
  FUSEDMHA_OP_IMPL(m, varlen_attention_forward_autograd);
  FUSEDMHA_OP_IMPL(m, varlen_attention_backward_autograd);
}

}  // namespace fusedmha::ops
