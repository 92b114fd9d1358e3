#include "ops/mask_tiles.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/attention_params.h"

namespace fusedmha::ops {
namespace {

// One element's MaskTileState: a bool's nonzero byte may be seen (as the
// kernels read it); a float's 0 is seen, −inf hidden, anything else a value.
template <typename T>
uint8_t element_state(T x) {
  if constexpr (std::is_same_v<T, uint8_t>) {
    return x != 0 ? kTileVisible : kTileHidden;
  } else {
    const double f = static_cast<double>(x);
    if (f == 0) return kTileVisible;
    return std::isinf(f) && f < 0 ? kTileHidden : kTileMixed;
  }
}

// The state of n elements of a row (stride apart): a contiguous row a
// word of 8 bytes at a time, read element by element only where a word
// mixes states (element by element, the scan of a float mask as large as
// the scores cost a call as much as its skipped tiles saved).
template <typename T>
uint8_t row_state(const T* row, int64_t stride, int64_t n) {
  constexpr int64_t kPerWord = sizeof(uint64_t) / sizeof(T);
  constexpr bool kBool = std::is_same_v<T, uint8_t>;
  uint8_t state = 0;
  int64_t j = 0;
  if (stride == 1) {
    uint64_t hidden = 0;  // (a word of −inf; a bool's hidden word is 0)
    if constexpr (!kBool) {
      const T neg_inf(-std::numeric_limits<float>::infinity());
      for (int64_t e = 0; e < kPerWord; ++e) {
        std::memcpy(reinterpret_cast<char*>(&hidden) + e * sizeof(T), &neg_inf, sizeof(T));
      }
      // 8 words at a time while all are 0 or all −inf (vectorized).
      constexpr int64_t kPerLine = 8 * kPerWord;
      for (; j + kPerLine <= n && state != kTileMixed; j += kPerLine) {
        uint64_t line[8], seen = 0, unhidden = 0;
        std::memcpy(line, row + j, sizeof(line));
        for (int k = 0; k < 8; ++k) seen |= line[k], unhidden |= line[k] ^ hidden;
        if (seen != 0 && unhidden != 0) break;
        state |= seen == 0 ? kTileVisible : kTileHidden;
      }
    }
    for (; j + kPerWord <= n && state != kTileMixed; j += kPerWord) {
      uint64_t w;
      std::memcpy(&w, row + j, sizeof(w));
      if constexpr (kBool) {
        constexpr uint64_t kOnes = 0x0101010101010101ull, kHighs = 0x8080808080808080ull;
        const bool zero_byte = ((w - kOnes) & ~w & kHighs) != 0;
        state |= (w != 0 ? kTileVisible : 0) | (zero_byte ? kTileHidden : 0);
      } else if (w == 0) {
        state |= kTileVisible;
      } else if (w == hidden) {
        state |= kTileHidden;
      } else {
        for (int64_t e = 0; e < kPerWord; ++e) state |= element_state(row[j + e]);
      }
    }
  }
  for (; j < n && state != kTileMixed; ++j) state |= element_state(row[j * stride]);
  return state;
}

// Mask bytes per thread's share of the tile rows, at least.
constexpr int64_t kGrainBytes = 256 * 1024;

template <typename T>
void scan(const at::Tensor& mask, const std::vector<int64_t>& offsets, int64_t len_q,
          int64_t len_kv, uint8_t* states) {
  const T* data = static_cast<const T*>(mask.const_data_ptr());
  const int64_t dims = mask.dim();
  const int64_t row_stride = dims >= 2 && mask.size(-2) != 1 ? mask.stride(-2) : 0;
  const int64_t key_stride = mask.size(-1) != 1 ? mask.stride(-1) : 0;
  const int64_t tq = (len_q + kMaskTileRows - 1) / kMaskTileRows;
  const int64_t tk = (len_kv + kMaskTileKeys - 1) / kMaskTileKeys;
  const int64_t units = static_cast<int64_t>(offsets.size()) * tq;
  const int64_t unit_bytes = kMaskTileRows * len_kv * static_cast<int64_t>(sizeof(T));
  at::parallel_for(0, units, std::max<int64_t>(kGrainBytes / std::max<int64_t>(unit_bytes, 1), 1),
                   [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t r = u % tq, q0 = r * kMaskTileRows;
      uint8_t* out = states + u * tk;
      std::fill(out, out + tk, uint8_t{0});
      for (int64_t i = q0; i < std::min(q0 + kMaskTileRows, len_q); ++i) {
        const T* row = data + offsets[u / tq] + i * row_stride;
        for (int64_t c = 0; c < tk; ++c) {
          const int64_t k0 = c * kMaskTileKeys;
          if (out[c] == kTileMixed) continue;
          out[c] |= row_state(row + k0 * key_stride, key_stride,
                              std::min(kMaskTileKeys, len_kv - k0));
        }
      }
    }
  });
}

}  // namespace

std::optional<MaskTiles> mask_tiles_on_device(const at::Tensor& mask, int64_t len_q,
                                              int64_t len_kv) {
  if (mask.scalar_type() != at::kBool || mask.dim() < 1 || len_q <= 0 || len_kv <= 0) {
    return std::nullopt;
  }
  // The mask's own elements: one matrix where a dim broadcasts, and its rows
  // or keys where it has one (a key padding row gives one row of tiles,
  // which the kernels read for every query tile: its row stride is 0).
  at::Tensor m = mask.dim() < 2 ? mask.unsqueeze(0) : mask;
  for (int64_t d = 0; d < m.dim(); ++d) {  // (rows or keys expanded with stride 0 too)
    if (m.size(d) > 1 && m.stride(d) == 0) m = m.narrow(d, 0, 1);
  }
  const int64_t rows = m.size(-2), keys = m.size(-1);  // (1, or the call's lengths)
  const int64_t tq = (rows + kMaskTileRows - 1) / kMaskTileRows;
  const int64_t tk = (keys + kMaskTileKeys - 1) / kMaskTileKeys;
  const int64_t pad_rows = tq * kMaskTileRows - rows, pad_keys = tk * kMaskTileKeys - keys;
  const at::Tensor padded =
      pad_rows || pad_keys ? at::constant_pad_nd(m, {0, pad_keys, 0, pad_rows}, 0) : m;
  std::vector<int64_t> tiles(m.sizes().begin(), m.sizes().end() - 2);
  for (const int64_t n : {tq, kMaskTileRows, tk, kMaskTileKeys}) tiles.push_back(n);
  const int64_t last = static_cast<int64_t>(tiles.size()) - 1;
  // Seen elements per tile (padding is hidden), against the tile's count.
  const at::Tensor seen = padded.reshape(tiles).sum({last - 2, last}, false, at::kInt);
  const at::TensorOptions counts = seen.options();
  const at::Tensor tile_rows = at::clamp_max(
      rows - at::arange(tq, counts) * kMaskTileRows, kMaskTileRows).unsqueeze(1);
  const at::Tensor tile_keys = at::clamp_max(keys - at::arange(tk, counts) * kMaskTileKeys,
                                             kMaskTileKeys);
  MaskTiles t;
  t.states = at::where(seen == tile_rows * tile_keys, int64_t{kTileVisible},
                       at::where(seen == 0, int64_t{kTileHidden}, int64_t{kTileMixed}))
                 .to(at::kByte);
  if (keys == 1 && len_kv > 1) {  // (the kernels index the tiles of the keys themselves)
    std::vector<int64_t> sizes(t.states.sizes().begin(), t.states.sizes().end());
    sizes.back() = (len_kv + kMaskTileKeys - 1) / kMaskTileKeys;
    t.states = t.states.expand(sizes).contiguous();
  }
  t.any_uniform = true;
  return t;
}

std::optional<MaskTiles> find_mask_tiles(const at::Tensor& mask, int64_t len_q,
                                         int64_t len_kv) {
  if (mask.dim() < 1 || len_q <= 0 || len_kv <= 0) return std::nullopt;
  if (!mask.is_cpu()) return mask_tiles_on_device(mask, len_q, len_kv);
  // The tiles of each distinct matrix of the mask: dims of size 1 or stride
  // 0 hold one, and so do the tiles' there.
  std::vector<int64_t> sizes, offsets{0};
  for (int64_t d = 0; d < mask.dim() - 2; ++d) {
    const bool broadcast = mask.size(d) == 1 || mask.stride(d) == 0;
    sizes.push_back(broadcast ? 1 : mask.size(d));
    if (broadcast) continue;
    std::vector<int64_t> next;
    next.reserve(offsets.size() * mask.size(d));
    for (const int64_t o : offsets) {
      for (int64_t i = 0; i < mask.size(d); ++i) next.push_back(o + i * mask.stride(d));
    }
    offsets = std::move(next);
  }
  if (offsets.empty()) return std::nullopt;
  sizes.push_back((len_q + kMaskTileRows - 1) / kMaskTileRows);
  sizes.push_back((len_kv + kMaskTileKeys - 1) / kMaskTileKeys);
  MaskTiles t;
  t.states = at::empty(sizes, mask.options().dtype(at::kByte));
  uint8_t* states = t.states.mutable_data_ptr<uint8_t>();
  switch (mask.scalar_type()) {
    case at::kBool: scan<uint8_t>(mask, offsets, len_q, len_kv, states); break;
    case at::kFloat: scan<float>(mask, offsets, len_q, len_kv, states); break;
    case at::kDouble: scan<double>(mask, offsets, len_q, len_kv, states); break;
    case at::kHalf: scan<c10::Half>(mask, offsets, len_q, len_kv, states); break;
    case at::kBFloat16: scan<c10::BFloat16>(mask, offsets, len_q, len_kv, states); break;
    default: return std::nullopt;
  }
  const int64_t n = t.states.numel();
  t.all_visible = std::all_of(states, states + n, [](uint8_t s) { return s == kTileVisible; });
  t.any_uniform = std::any_of(states, states + n, [](uint8_t s) { return s != kTileMixed; });
  return t;
}

}  // namespace fusedmha::ops
