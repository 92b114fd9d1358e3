// Autocast for attention_forward and attention_weights (the varlen ops and
// attention_with_kvcache have none), registered next to the other backends:
// under torch.autocast the attention runs in the autocast dtype, as PyTorch's
// scaled_dot_product_attention does (its policy: lower precision). Floating
// q, k, v and a float attn_mask are cast (bool masks, ALiBi slopes and sinks
// are left as they are), then the op runs with autocast off. The backward
// needs no kernel: autograd calls it with the tensors the forward saved,
// already cast. scaled_dot_product_attention and _multihead_attention_core are
// composites of these ops and follow them.

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <fusedmha/attention.h>
#include <torch/library.h>

#include "ops/op_args.h"

namespace fusedmha::ops {
namespace {

template <c10::DeviceType kDevice>
struct Autocast {
  static at::ScalarType dtype() {
    return at::autocast::get_lower_precision_fp_from_device_type(kDevice);
  }
  static at::Tensor cast(const at::Tensor& t) {
    return at::autocast::cached_cast(dtype(), t, kDevice);
  }
  static OptTensor cast(const OptTensor& t) {
    return at::autocast::cached_cast(dtype(), t, kDevice);
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const ForwardArgs& a) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(
        at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
    return attention_forward(cast(a.query), cast(a.key), cast(a.value), cast(a.attn_mask),
                             a.dropout_p, a.is_causal, a.scale, a.enable_gqa, a.variants,
                             a.dropout_state);
  }

  static at::Tensor weights(const WeightsArgs& a) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(
        at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
    return attention_weights(cast(a.query), cast(a.key), a.logsumexp, a.rng_state,
                             cast(a.attn_mask), a.dropout_p, a.is_causal, a.scale, a.enable_gqa,
                             a.average_heads, a.variants);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, AutocastCPU, m) {
  FUSEDMHA_OP_IMPL(m, Autocast<c10::DeviceType::CPU>::forward);
  FUSEDMHA_OP_IMPL(m, Autocast<c10::DeviceType::CPU>::weights);
}

TORCH_LIBRARY_IMPL(fusedmha, AutocastCUDA, m) {
  FUSEDMHA_OP_IMPL(m, Autocast<c10::DeviceType::CUDA>::forward);
  FUSEDMHA_OP_IMPL(m, Autocast<c10::DeviceType::CUDA>::weights);
}

}  // namespace fusedmha::ops
