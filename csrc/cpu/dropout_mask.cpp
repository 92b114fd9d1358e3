// fusedmha::_dropout_keep_mask: the keep-mask a call's dropout applies, from
// the same stream the kernels use (common/philox.h). For tests: a reference
// implementation can then apply exactly the kernels' mask.

#include "common/philox.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace fusedmha::cpu {
namespace {

at::Tensor dropout_keep_mask(const at::Tensor& rng_state, int64_t outer, int64_t len_q,
                             int64_t len_kv, double dropout_p) {
  TORCH_CHECK((rng_state.numel() == 2 || rng_state.numel() == 4) &&
                  rng_state.scalar_type() == at::kLong,
              "fusedmha._dropout_keep_mask: expected rng_state int64 of shape [2] or [4]");
  TORCH_CHECK(outer >= 0 && len_q >= 0 && len_kv >= 0 && outer * len_q * len_kv <= (1 << 28),
              "fusedmha._dropout_keep_mask: a test aid for small sizes, got ", outer, " x ",
              len_q, " x ", len_kv);
  const at::Tensor state = rng_state.cpu();
  DropoutStream stream{static_cast<uint64_t>(state[0].item<int64_t>()),
                       static_cast<uint64_t>(state[1].item<int64_t>())};
  if (state.numel() == 4) {
    stream.row = state[2].item<int64_t>();
    stream.col4 = state[3].item<int64_t>() / 4;
  }
  const uint32_t threshold = dropout_threshold(dropout_p);
  at::Tensor mask = at::empty({outer, len_q, len_kv}, rng_state.options().dtype(at::kBool));
  bool* m = mask.mutable_data_ptr<bool>();
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < len_q; ++i) {
      for (int64_t j = 0; j < len_kv; ++j) {
        *m++ = stream.block(o, i, j / 4).v[j % 4] >= threshold;
      }
    }
  }
  return mask;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) {
  m.impl("_dropout_keep_mask", TORCH_FN(dropout_keep_mask));
}

}  // namespace fusedmha::cpu
