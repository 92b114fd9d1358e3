#pragma once

// Which tiles of a mask hide every key and which hide none: a mask that is
// not a band or key padding (ops/mask_structure.h) may still leave whole
// tiles of the scores hidden — document masking of packed sequences,
// prefix-LM, the BlockMasks of fusedmha.flex_attention — and the CPU kernels
// and CUDA's tensor-core kernels then skip those tiles (no scores, no
// softmax, no mask read) and add no mask to the tiles that hide nothing
// (AttentionParams::mask_tiles).

#include <ATen/core/Tensor.h>
#include <fusedmha/macros.h>

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

// The tiles of a bool mask found with ATen ops on the mask's own device,
// with no copy to the host and no wait for it (what a CUDA mask takes): one
// sum per tile, over the mask's own elements (a mask that broadcasts over
// the rows has one row of tiles, row stride 0 as the kernels read it).
// any_uniform is set and all_visible is not, as neither is known without a
// wait; nullopt for a float mask, whose tiles the kernels do not look for
// there. (Both functions are exported for the tests, which compare the two
// on the CPU.)
FUSEDMHA_API std::optional<MaskTiles> mask_tiles_on_device(const at::Tensor& mask, int64_t len_q,
                                                          int64_t len_kv);

// The tiles of mask (bool, true = may attend, or floating point, where 0 is
// seen and −inf hidden, and any other value is a value to add) for a call
// of len_q queries and len_kv keys: on the CPU read in place through its
// strides in one pass split among the threads, on another device
// mask_tiles_on_device's; nullopt for another dtype.
FUSEDMHA_API std::optional<MaskTiles> find_mask_tiles(const at::Tensor& mask, int64_t len_q,
                                                      int64_t len_kv);

}  // namespace fusedmha::ops
