// Autocast for the fusedmha ops, registered next to the other backends: under
// torch.autocast the attention runs in the autocast dtype, as PyTorch's
// scaled_dot_product_attention does (its policy: lower precision). Floating
// q, k, v and a float attn_mask are cast (bool masks, ALiBi slopes and sinks
// are left as they are), then the op runs with autocast off. The backward
// needs no kernel: autograd calls it with the tensors the forward saved,
// already cast. scaled_dot_product_attention and _multihead_attention_core are
// composites of these ops and follow them.

#include <fusedmha/attention.h>

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace fusedmha::ops {
namespace {

using OptTensor = std::optional<at::Tensor>;

template <c10::DeviceType kDevice>
struct Autocast {
  static at::ScalarType dtype() { return at::autocast::get_lower_precision_fp_from_device_type(kDevice); }
  static at::Tensor cast(const at::Tensor& t) { return at::autocast::cached_cast(dtype(), t, kDevice); }
  static OptTensor cast(const OptTensor& t) { return at::autocast::cached_cast(dtype(), t, kDevice); }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
      const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
      const OptTensor& attn_mask, double dropout_p, bool is_causal, std::optional<double> scale,
      bool enable_gqa, int64_t window_left, int64_t window_right, bool bottom_right,
      double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks,
      const OptTensor& dropout_state) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(
        at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
    return attention_forward(cast(query), cast(key), cast(value), cast(attn_mask), dropout_p,
                             is_causal, scale, enable_gqa,
                             {window_left, window_right, bottom_right, softcap, alibi_slopes, sinks},
                             dropout_state);
  }

  static at::Tensor weights(const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& logsumexp, const at::Tensor& rng_state,
                            const OptTensor& attn_mask, double dropout_p, bool is_causal,
                            std::optional<double> scale, bool enable_gqa, bool average_heads,
                            int64_t window_left, int64_t window_right, bool bottom_right,
                            double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(
        at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
    return attention_weights(cast(query), cast(key), logsumexp, rng_state, cast(attn_mask),
                             dropout_p, is_causal, scale, enable_gqa, average_heads,
                             {window_left, window_right, bottom_right, softcap, alibi_slopes, sinks});
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, AutocastCPU, m) {
  m.impl("attention_forward", TORCH_FN(Autocast<c10::DeviceType::CPU>::forward));
  m.impl("attention_weights", TORCH_FN(Autocast<c10::DeviceType::CPU>::weights));
}

TORCH_LIBRARY_IMPL(fusedmha, AutocastCUDA, m) {
  m.impl("attention_forward", TORCH_FN(Autocast<c10::DeviceType::CUDA>::forward));
  m.impl("attention_weights", TORCH_FN(Autocast<c10::DeviceType::CUDA>::weights));
}

}  // namespace fusedmha::ops
