#pragma once

// Which tiles of a mask hide every key and which hide none: a mask that is
// not a band or key padding (ops/mask_structure.h) may still leave whole
// tiles of the scores hidden — document masking of packed sequences,
// prefix-LM, the BlockMasks of fusedmha.flex_attention — and the CPU kernels
// then skip those tiles (no scores, no softmax, no mask read) and add no
// mask to the tiles that hide nothing (AttentionParams::mask_tiles).

#include <ATen/core/Tensor.h>

#include <optional>

namespace fusedmha::ops {

struct MaskTiles {
  // (mask's dims before its last two, 1 where the mask broadcasts,
  // ceil(len_q / kMaskTileRows), ceil(len_kv / kMaskTileKeys)) uint8, each
  // tile's MaskTileState (common/attention_params.h).
  at::Tensor states;
  bool all_visible = false;  // no tile hides a key: the mask can be dropped
  bool any_uniform = false;  // some tile hides every key or none
};

// The tiles of mask (CPU; bool, true = may attend, or floating point, where
// 0 is seen and −inf hidden, and any other value is a value to add) for a
// call of len_q queries and len_kv keys, read in place through its strides
// in one pass split among the threads; nullopt for another dtype or device.
std::optional<MaskTiles> find_mask_tiles(const at::Tensor& mask, int64_t len_q, int64_t len_kv);

}  // namespace fusedmha::ops
