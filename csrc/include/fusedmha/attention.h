#pragma once

#include <fusedmha/macros.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace fusedmha {

// What fusedmha's attention takes beyond scaled_dot_product_attention's
// arguments: FlashAttention's variants, all off by default. Every forward,
// backward and weights call takes them, so a backward must be given the
// forward's.
struct AttentionVariants {
  // The sliding window (FlashAttention's window_size): query i sees keys j
  // with d - window_left <= j <= d + window_right around its diagonal d;
  // -1 is unbounded. is_causal sets window_right to 0.
  int64_t window_left = -1;
  int64_t window_right = -1;
  // The diagonal: d = i (false: top-left, SDPA's is_causal) or
  // d = i + S - L (true: bottom-right, FlashAttention's causal). Also the
  // diagonal ALiBi measures from.
  bool bottom_right = false;
  // > 0: a score s becomes softcap * tanh(s / softcap), after scaling and
  // before masks and softmax (Gemma 2).
  double softcap = 0.0;
  // (H) or (B, H), floating: -slope * |d - j| is added to score (i, j)
  // (BLOOM, MPT). No gradient.
  std::optional<at::Tensor> alibi_slopes;
  // (H): a logit per head that joins each row's softmax denominator and
  // carries no value (gpt-oss's sinks). Differentiable.
  std::optional<at::Tensor> sinks;
};

// Same signature and meaning as at::scaled_dot_product_attention (plus the
// variants above):
// query (..., H, L, E), key (..., H_kv, S, E), value (..., H_kv, S, Ev);
// attn_mask bool (true = may attend) or float (added to the scores),
// broadcastable to (..., H, L, S); is_causal is top-left aligned; scale
// defaults to 1/sqrt(E); enable_gqa lets H be a multiple of H_kv.
// A query row whose keys are all masked gets output 0, never NaN.
// Goes through the dispatcher (op fusedmha::scaled_dot_product_attention).
FUSEDMHA_API at::Tensor scaled_dot_product_attention(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask = std::nullopt,
    double dropout_p = 0.0,
    bool is_causal = false,
    std::optional<double> scale = std::nullopt,
    bool enable_gqa = false,
    const AttentionVariants& variants = {});

// The forward op itself (fusedmha::attention_forward): returns the output,
// the per-row log-sum-exp of the scaled, masked scores, shape (..., H, L),
// float32 (float64 for float64 inputs; +inf for rows with no key to attend
// to), and the dropout rng state, int64 [seed, offset] (drawn from the
// default generator of the query's device when dropout_p > 0, so
// torch::manual_seed makes runs repeatable).
FUSEDMHA_API std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask = std::nullopt,
    double dropout_p = 0.0,
    bool is_causal = false,
    std::optional<double> scale = std::nullopt,
    bool enable_gqa = false,
    const AttentionVariants& variants = {},
    const std::optional<at::Tensor>& dropout_state = std::nullopt);

// The backward op (fusedmha::attention_backward): gradients with respect to
// query, key and value, given the gradient of the output and what
// attention_forward returned, and with grad_attn_mask the gradient with
// respect to the float attn_mask (else an empty tensor). Autograd calls it;
// it is public for tests and for custom autograd code. grad_logsumexp, when
// given, is the gradient of the log-sum-exp (..., H, L), so that code
// differentiating through it (a merge of partial results) gets exact
// gradients. (The sinks' gradient is -sum over rows of exp(sink -
// logsumexp) * rowsum(grad_out * out), which autograd adds.)
//
// The mask's gradient has the mask's shape and dtype: summed over every dim
// the mask broadcasts along, inside the kernels. Along a dim the mask was
// expanded in (stride 0, size > 1) its elements share memory: each holds
// the sum over that dim divided by its size, so that the expand's own
// backward (a sum) gives the sum, as PyTorch's as_strided backward does for
// overlapping memory.
FUSEDMHA_API std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& out,
    const at::Tensor& logsumexp,
    const at::Tensor& rng_state,
    const std::optional<at::Tensor>& attn_mask = std::nullopt,
    double dropout_p = 0.0,
    bool is_causal = false,
    std::optional<double> scale = std::nullopt,
    bool enable_gqa = false,
    const AttentionVariants& variants = {},
    const std::optional<at::Tensor>& grad_logsumexp = std::nullopt,
    bool grad_attn_mask = false);

// The attention weights of a forward call (fusedmha::attention_weights):
// softmax(scale·Q·Kᵀ + mask) recomputed from the logsumexp and rng_state
// attention_forward returned, with the same dropout applied (pass the same
// attn_mask, dropout_p, is_causal, scale and enable_gqa). Shape
// (..., H, L, S), or (..., L, S) averaged over heads; query's dtype; rows
// with no key to attend to are 0. Differentiable with respect to query and
// key.
FUSEDMHA_API at::Tensor attention_weights(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& logsumexp,
    const at::Tensor& rng_state,
    const std::optional<at::Tensor>& attn_mask = std::nullopt,
    double dropout_p = 0.0,
    bool is_causal = false,
    std::optional<double> scale = std::nullopt,
    bool enable_gqa = false,
    bool average_heads = false,
    const AttentionVariants& variants = {});

// A packed batch of sequences of their own lengths, FlashAttention's
// "varlen" layout (fusedmha::varlen_attention_forward): query (total_q, H,
// E), key (total_k, H_kv, E), value (total_k, H_kv, Ev), H a multiple of
// H_kv; sequence b is query rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] and
// key rows cu_seqlens_k[b] .., of which it uses seqused_k[b] when given
// (int32 tensors of B + 1 and B entries on the query's device);
// max_seqlen_q/k are at least every sequence's length. Each sequence is
// attended to on its own, exactly as scaled_dot_product_attention would
// attend to it alone: is_causal and the variants' windows and ALiBi count
// from its own diagonal (variants.bottom_right = true for FlashAttention's
// alignment), no work is spent on padding. Returns the output (total_q, H,
// Ev), the log-sum-exp (H, total_q) and the dropout rng state.
// Differentiable with respect to query, key, value and the sinks. With
// block_table (int32, (B, pages per sequence)), key and value are a paged
// cache (num_pages, page_size, H_kv, E/Ev) instead, and cu_seqlens_k (or
// seqused_k) only gives each sequence's key count: forward only. With
// k_scale and v_scale (float32, key's and value's shapes without the last
// dim), key and value are quantized: 8-bit codes (int8, float8_e4m3fn or
// float8_e5m2; see quantize_kv) whose values are code · scale, read as
// such by the kernels: forward only.
FUSEDMHA_API std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_forward(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q,
    int64_t max_seqlen_k,
    double dropout_p = 0.0,
    bool is_causal = false,
    std::optional<double> scale = std::nullopt,
    const AttentionVariants& variants = {},
    const std::optional<at::Tensor>& seqused_k = std::nullopt,
    const std::optional<at::Tensor>& block_table = std::nullopt,
    const std::optional<at::Tensor>& k_scale = std::nullopt,
    const std::optional<at::Tensor>& v_scale = std::nullopt);

// The backward of varlen_attention_forward (fusedmha::varlen_attention_backward),
// as attention_backward is attention_forward's.
FUSEDMHA_API std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward(
    const at::Tensor& grad_out,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& out,
    const at::Tensor& logsumexp,
    const at::Tensor& rng_state,
    const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q,
    int64_t max_seqlen_k,
    double dropout_p = 0.0,
    bool is_causal = false,
    std::optional<double> scale = std::nullopt,
    const AttentionVariants& variants = {},
    const std::optional<at::Tensor>& seqused_k = std::nullopt,
    const std::optional<at::Tensor>& grad_logsumexp = std::nullopt);

// What one generation step adds to a KV cache (attention_with_kvcache), all
// optional: the new keys and values k/v (B, L_new, H_kv, E), appended in
// place at rows cache_seqlens[b] (int32 (B); default: the cache is full and
// nothing is appended) of cache cache_batch_idx[b] (default b); rotary
// embedding tables rotary_cos/rotary_sin (S_rotary, R / 2) applied to q and
// the new k at their positions, counted from cache_leftpad[b] (the rows
// before it are skipped), as adjacent pairs (rotary_interleaved) or halves;
// block_table (int32 (B, pages per sequence)) for a paged cache (num_pages,
// page_size, H_kv, E); k_scale/v_scale (float32, the caches' shapes
// without their last dim) for quantized caches of 8-bit codes (int8,
// float8_e4m3fn or float8_e5m2): a cached value is code · scale, and the
// new rows are quantized into them and their scales in place (quantize_kv).
struct KVCacheStep {
  std::optional<at::Tensor> k, v;
  std::optional<at::Tensor> rotary_cos, rotary_sin;
  bool rotary_interleaved = true;
  std::optional<at::Tensor> cache_seqlens, cache_batch_idx, cache_leftpad, block_table;
  std::optional<at::Tensor> k_scale, v_scale;
};

// One generation step against a KV cache (fusedmha::attention_with_kvcache,
// FlashAttention's flash_attn_with_kvcache): step's k/v are appended to
// k_cache/v_cache in place, then q (B, L, H, E) attends over each sequence's
// cache; is_causal and the variants' window are aligned bottom-right (the new
// queries are the last positions; variants.bottom_right is not read).
// Returns the output (B, L, H, Ev) and the log-sum-exp (B, H, L). Inference
// only (no gradients).
FUSEDMHA_API std::tuple<at::Tensor, at::Tensor> attention_with_kvcache(
    const at::Tensor& q,
    at::Tensor& k_cache,
    at::Tensor& v_cache,
    const KVCacheStep& step = {},
    std::optional<double> scale = std::nullopt,
    bool is_causal = false,
    const AttentionVariants& variants = {});

// Partial attention results over disjoint sets of keys, combined into the
// result over all of them by their log-sum-exp (fusedmha::merge_attention):
// outputs (B, L, H, E) and lses (B, H, L), as flash_attn_func returns them
// with return_attn_probs. A partial whose lse is +inf for a row (no key
// there) weighs nothing; a row no partial saw gets 0 and lse +inf.
// Differentiable.
FUSEDMHA_API std::tuple<at::Tensor, at::Tensor> merge_attention(at::TensorList outputs,
                                                               at::TensorList lses);

// A quantized KV cache's rows (fusedmha::quantize_kv): x (..., E) as 8-bit
// codes of dtype (at::kChar, at::kFloat8_e4m3fn or at::kFloat8_e5m2) and
// one float32 scale per row (...), scale = max|row| / qmax (qmax = 127, 448
// or 57344; a row of zeros gets scale 0), codes = x / scale rounded to the
// nearest (int8: halves to even, as torch.round) or converted to fp8
// (round to nearest even). What attention_with_kvcache appends with.
FUSEDMHA_API std::tuple<at::Tensor, at::Tensor> quantize_kv(const at::Tensor& x,
                                                           at::ScalarType dtype);

// The values codes · scale of a quantized cache, in dtype
// (fusedmha::dequantize_kv): for tests and debugging (the kernels never
// make this copy).
FUSEDMHA_API at::Tensor dequantize_kv(const at::Tensor& codes, const at::Tensor& scale,
                                      at::ScalarType dtype = at::kFloat);

}  // namespace fusedmha
