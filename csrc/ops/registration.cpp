// The schemas of every fusedmha op, defined once. Kernels are registered
// next to their implementations (csrc/cpu, csrc/cuda/attention_cuda.cpp,
// csrc/modules, and in csrc/ops the composites, the Meta, Autograd and
// Autocast kernels and attention_with_kvcache's).

#include <torch/library.h>

// The variants every attention op takes after SDPA's arguments, keyword-only
// (fusedmha::AttentionVariants in <fusedmha/attention.h> says what each means).
#define VARIANTS                                                                          \
  "*, int window_left=-1, int window_right=-1, bool bottom_right=False, float softcap=0.0, " \
  "Tensor? alibi_slopes=None, Tensor? sinks=None"

TORCH_LIBRARY(fusedmha, m) {
  // The fused forward: output (..., H, L, Ev), the log-sum-exp of each
  // query row's scaled, masked scores (..., H, L), and the dropout stream's
  // (seed, offset) as int64[2] (drawn from the default generator of the
  // query's device when dropout_p > 0): what the backward needs to
  // recompute and replay it.
  // Unlike scaled_dot_product_attention it accepts attn_mask together with
  // is_causal: both apply. dropout_state, int64 [seed, offset] or [seed,
  // offset, row, column], is a stream to use instead of drawing one: with
  // row and column, the call is the part of a longer sequence that starts
  // there (a ring step of context parallelism), and drops what a call on
  // the whole sequence would; it is returned as rng_state.
  m.def(
      "attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
      "float dropout_p=0.0, bool is_causal=False, float? scale=None, bool enable_gqa=False, "
      VARIANTS ", Tensor? dropout_state=None) -> (Tensor output, Tensor logsumexp, Tensor rng_state)");
  // Gradients of attention_forward's output (and, when grad_logsumexp is
  // given, of its log-sum-exp) with respect to query, key and value, and
  // with grad_attn_mask with respect to the float attn_mask (in its shape
  // and dtype; else an empty tensor), recomputed tile by tile from the
  // saved output and log-sum-exp.
  m.def(
      "attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
      "Tensor logsumexp, Tensor rng_state, Tensor? attn_mask, float dropout_p, bool is_causal, "
      "float? scale, bool enable_gqa, " VARIANTS ", Tensor? grad_logsumexp=None, "
      "bool grad_attn_mask=False"
      ") -> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_attn_mask)");
  // The attention probabilities softmax(scale·Q·Kᵀ + mask) of a forward call,
  // recomputed from its log-sum-exp, with its dropout applied (rng_state and
  // dropout_p as given to and returned by attention_forward): (..., H, L, S),
  // or (..., L, S) averaged over heads. MultiheadAttention's need_weights.
  m.def(
      "attention_weights(Tensor query, Tensor key, Tensor logsumexp, Tensor rng_state, "
      "Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, float? scale=None, "
      "bool enable_gqa=False, bool average_heads=False, " VARIANTS ") -> Tensor");
  // A packed batch of sequences (FlashAttention's varlen layout, see
  // ops/packed_batch.h): query (total_q, H, E), key/value (total_k, H_kv,
  // E/Ev); sequence b is rows cu_seqlens_q[b].. and cu_seqlens_k[b].., and
  // uses seqused_k[b] keys when given. Each sequence is attended to on its
  // own (is_causal, windows and ALiBi measured within it); no work is done
  // for padding. Returns the output (total_q, H, Ev), the log-sum-exp (H,
  // total_q) and the rng state; dropout element (b·H + h, i, j) (i, j within
  // the sequence) is drawn as attention_forward's. With block_table, k and v
  // are a paged cache (forward only; see ops/packed_batch.h). With k_scale
  // and v_scale, k and v hold 8-bit codes (int8, float8_e4m3fn or
  // float8_e5m2) and each key row's float32 scale per head: a quantized
  // cache, read as code · scale (forward only).
  m.def(
      "varlen_attention_forward(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float dropout_p=0.0, "
      "bool is_causal=False, float? scale=None, " VARIANTS ", Tensor? seqused_k=None, "
      "Tensor? block_table=None, Tensor? k_scale=None, Tensor? v_scale=None"
      ") -> (Tensor output, Tensor logsumexp, Tensor rng_state)");
  m.def(
      "varlen_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
      "Tensor out, Tensor logsumexp, Tensor rng_state, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, float dropout_p, bool is_causal, float? scale, "
      VARIANTS ", Tensor? seqused_k=None, Tensor? grad_logsumexp=None"
      ") -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  // One generation step against a KV cache (FlashAttention's
  // flash_attn_with_kvcache, csrc/ops/kvcache_attention.cpp): k/v appended
  // to k_cache/v_cache in place at cache_seqlens (rotary embedding applied
  // to q and k first, when given), then q (B, L, H, E) attends over each
  // sequence's cache, bottom-right aligned. Returns the output (B, L, H, Ev)
  // and the log-sum-exp (B, H, L). Inference only. cache_seqlens_value: one
  // cache_seqlens for every sequence, in place of the tensor (flash_attn's
  // int form: a step then makes no tensor for it; a SymInt, so that
  // torch.compile keeps it dynamic instead of recompiling each step).
  // k_scale/v_scale: the caches are quantized (int8, float8_e4m3fn or
  // float8_e5m2 codes), each row and head with its float32 scale, shape
  // (B_cache, S_cache, H_kv) or (num_pages, page_size, H_kv); new rows are
  // quantized as they are appended (quantize_kv's rule).
  m.def(
      "attention_with_kvcache(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor? k=None, Tensor? v=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
      "Tensor? cache_seqlens=None, Tensor? cache_batch_idx=None, Tensor? cache_leftpad=None, "
      "Tensor? block_table=None, float? scale=None, bool is_causal=False, "
      "bool rotary_interleaved=True, *, int window_left=-1, int window_right=-1, "
      "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, "
      "SymInt? cache_seqlens_value=None, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None"
      ") -> (Tensor output, Tensor logsumexp)");
  // Private test hook, not API: the dropout keep-mask (outer, len_q,
  // len_kv) that a call with this rng_state and dropout_p applies (outer =
  // batch dims x heads), so tests can build the exact reference.
  m.def(
      "_dropout_keep_mask(Tensor rng_state, int outer, int len_q, int len_kv, float dropout_p) "
      "-> Tensor");
  // MultiheadAttention's forward between its input and output projections,
  // for the Python and C++ modules alike (csrc/modules/multihead_attention_core.h):
  // module masks (bool true = masked), extra keys, the causal hint, dropout
  // 1, the fused attention and weights. weights is empty unless need_weights.
  m.def(
      "_multihead_attention_core(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, "
      "Tensor? key_padding_mask, Tensor? bias_k, Tensor? bias_v, bool add_zero_attn, "
      "float dropout_p, bool need_weights, bool average_attn_weights, bool is_causal) "
      "-> (Tensor output, Tensor weights)");
  // Partial results over disjoint sets of keys, in flash_attn_func's layouts
  // (outputs (B, L, H, E), lses (B, H, L)), combined by their log-sum-exp:
  // the output and lse over all the keys (csrc/ops/merge_attention.cpp).
  m.def("merge_attention(Tensor[] outputs, Tensor[] lses) -> (Tensor output, Tensor lse)");
  // A quantized KV cache's rows (csrc/ops/kv_quantization.cpp): x (..., E)
  // as 8-bit codes of dtype (int8, float8_e4m3fn, float8_e5m2) and one
  // float32 scale per row (...), max|row| / the dtype's largest code; and
  // back, codes · scale in dtype.
  m.def("quantize_kv(Tensor x, ScalarType dtype) -> (Tensor codes, Tensor scale)");
  m.def("dequantize_kv(Tensor codes, Tensor scale, ScalarType dtype=float) -> Tensor");
  // The bool mask (B, H, L, S) a FlexAttention block mask stands for
  // (csrc/ops/block_mask.cpp): per (batch, head, query block), the key
  // blocks kv_indices[..., :kv_num_blocks] attended to where partial_bits
  // (the listed blocks' (QB, KB) bits, in list order) are true, and
  // full_kv_indices[..., :full_kv_num_blocks] attended to whole.
  m.def(
      "block_mask_dense(Tensor kv_num_blocks, Tensor kv_indices, Tensor partial_bits, "
      "int[2] block_size, int[2] seq_lengths, Tensor? full_kv_num_blocks=None, "
      "Tensor? full_kv_indices=None) -> Tensor");
  // torch.nn.functional.scaled_dot_product_attention's signature; a
  // composite of attention_forward (csrc/ops/attention.cpp).
  m.def(
      "scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, "
      "Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, float? scale=None, "
      "bool enable_gqa=False, " VARIANTS ") -> Tensor");
}

#undef VARIANTS
