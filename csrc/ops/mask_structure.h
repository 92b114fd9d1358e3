#pragma once

// What an explicit mask says, when it says no more than the kernels can
// without reading it: key padding per batch index (left, right, or both) and
// a band (causal, sliding window). Such masks are common: transformers
// passes its causal mask with padding as a bool (B, 1, L, S) (older versions
// as a float of 0 and torch.finfo(dtype).min), and nn.Transformer's square
// subsequent mask is a float (L, S) of 0 and -inf.
// Read as a band and key spans, their hidden key blocks are skipped (half of
// a causal call's) instead of computed and masked.

#include <ATen/core/Tensor.h>

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace fusedmha::ops {

// Row i of batch index b sees keys [max(begin_b, i + diagonal − window_left),
// min(end_b, i + diagonal + 1)): the bounds that involve diagonal or
// window_left only where they are set.
struct MaskStructure {
  // (begin_b, end_b) per batch index, or one pair that every batch index
  // shares (a mask without a batch dim). Empty rows are [0, 0).
  std::vector<int64_t> spans;
  // Set: causal, query i sees no key right of i + diagonal.
  std::optional<int64_t> diagonal;
  // Set (only with diagonal): a sliding window, query i sees no key left of
  // i + diagonal − window_left.
  std::optional<int64_t> window_left;
};

// The structure of mask (CPU; bool, true = may attend, or floating point of
// 0 and −inf only, or the dtype's lowest value where it hides a key exactly
// as −inf does: float32, bfloat16, float64, in rows that see a key, with
// lowest_hides) for an attention call of the given outer shape (batch
// first, then heads and others), len_q queries and len_kv keys, read in
// place through its strides; nullopt where it is not of that form, or varies
// over any outer dim but the first (one whose indices all hold the same
// bytes, as a mask copied for every head, does not vary), or has an empty
// batch. with_band false: key spans only (a band would change something
// else, such as ALiBi's distances, or the call has a band already).
// lowest_hides false: the lowest value is a value (the call has a band of its
// own, which could leave a row only keys that value hides: they would be
// averaged, not skipped).
std::optional<MaskStructure> find_mask_structure(const at::Tensor& mask,
                                                 c10::IntArrayRef outer_shape, int64_t len_q,
                                                 int64_t len_kv, bool with_band,
                                                 bool lowest_hides);

}  // namespace fusedmha::ops
