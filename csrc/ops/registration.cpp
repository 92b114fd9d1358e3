// The schemas of every fusedmha op, defined once. Kernels are registered
// next to their implementations (csrc/cpu, csrc/ops/attention_meta.cpp,
// csrc/ops/attention_autograd.cpp).

#include <torch/library.h>

TORCH_LIBRARY(fusedmha, m) {
  // The fused forward: output (..., H, L, Ev) and the log-sum-exp of each
  // query row's scaled, masked scores (..., H, L), which the backward needs.
  m.def(
      "attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
      "float dropout_p=0.0, bool is_causal=False, float? scale=None, bool enable_gqa=False) "
      "-> (Tensor output, Tensor logsumexp)");
  // torch.nn.functional.scaled_dot_product_attention's signature; a
  // composite of attention_forward (csrc/ops/attention.cpp).
  m.def(
      "scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, "
      "Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, float? scale=None, "
      "bool enable_gqa=False) -> Tensor");
}
