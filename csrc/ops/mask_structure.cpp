#include "ops/mask_structure.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace fusedmha::ops {
namespace {

// Whether a float mask's lowest finite value (torch.finfo(dtype).min, which
// transformers' float masks and many models use for "hidden") hides a key as
// −inf does. In float32, bfloat16 and float64 it does, to the bit: added to
// a score below 2^103 in size it stays below −3.3e38, whose exp relative to
// any score a query sees is exactly 0, so skipping the key changes nothing.
// Except in a row that sees no key: there every score is that same value,
// and the softmax averages the hidden keys (where −inf gives zeros), so such
// a row is not a run (run_of_trues); and where the call has a band of its
// own, which could leave a row only keys the mask hides so, the value is
// read as a value (find_mask_structure's lowest_hides). float16's lowest,
// −65504, is not read so: fp16 scores may differ by more than that.
template <typename T>
constexpr bool kLowestHides = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                              std::is_same_v<T, c10::BFloat16>;

// An element as 1 (may attend), 0 (hidden) or -1 (neither: any other value
// of a float mask, which adds it to the score; the lowest value unless
// lowest_hides).
template <typename T>
int truth(T x, bool lowest_hides) {
  if constexpr (std::is_same_v<T, uint8_t>) {
    return x != 0;  // (a bool's bytes, nonzero = true, as the kernels read them)
  } else {
    using F = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const F f = static_cast<F>(x);
    if (f == 0) return 1;
    if (std::isinf(f) && f < 0) return 0;
    if constexpr (kLowestHides<T>) {
      if (lowest_hides && f == static_cast<F>(std::numeric_limits<T>::lowest())) return 0;
    }
    return -1;
  }
}

// The 8-byte word of x repeated (sizeof(T) divides 8).
template <typename T>
uint64_t repeated(T x) {
  uint64_t word = 0;
  for (size_t i = 0; i < sizeof(word) / sizeof(T); ++i) {
    std::memcpy(reinterpret_cast<char*>(&word) + i * sizeof(T), &x, sizeof(T));
  }
  return word;
}

// j moved past the elements from j on that equal `word`'s (or `other`'s),
// 64 bytes at a time while they are all one of the two words, then a word at
// a time, where the row is contiguous (elsewhere not at all): the
// element-wise loops then take the rest. (Scanned element by element, a
// mask that turned out not to be a band cost the call a noticeable share of
// its time for nothing; a word at a time, the scan runs near the memory's
// speed: docs/performance.md, "Mask structure scan".)
template <typename T>
int64_t skip_words(const T* row, int64_t stride, int64_t j, int64_t len, uint64_t word,
                   uint64_t other) {
  constexpr int64_t per_word = sizeof(word) / sizeof(T), per_line = 8 * per_word;
  if (stride != 1) return j;
  for (; j + per_line <= len; j += per_line) {
    uint64_t line[8], off_word = 0, off_other = 0;
    std::memcpy(line, row + j, sizeof(line));
    for (int k = 0; k < 8; ++k) {  // (vectorized)
      off_word |= line[k] ^ word;
      off_other |= line[k] ^ other;
    }
    if (off_word != 0 && off_other != 0) break;
  }
  for (uint64_t w; j + per_word <= len; j += per_word) {
    std::memcpy(&w, row + j, sizeof(w));
    if (w != word && w != other) break;
  }
  return j;
}

// Mask bytes per thread's share of the rows, at least: a share of a
// key padding mask's few short rows is not worth a thread.
constexpr int64_t kRowsGrainBytes = 256 * 1024;

// Keys [begin, end) that a row sees; [0, 0) for none.
struct Run {
  int64_t begin = 0, end = 0;
  bool empty() const { return begin == end; }
};

// The one run of trues in row (len elements, stride apart), or false where
// it has two, or a value that is neither true nor false.
template <typename T>
bool run_of_trues(const T* row, int64_t stride, int64_t len, bool lowest_hides, Run& run) {
  // (A bool's true is byte 1, a float mask's 0; false is 0, and −inf or the
  // lowest value.)
  uint64_t neg_inf = 0, lowest = 0, trues = 0;
  if constexpr (std::is_same_v<T, uint8_t>) {
    trues = repeated(T(1));
  } else {
    neg_inf = lowest = repeated(T(-std::numeric_limits<float>::infinity()));
    if constexpr (kLowestHides<T>) {
      if (lowest_hides) lowest = repeated(std::numeric_limits<T>::lowest());
    }
  }
  int64_t j = skip_words(row, stride, 0, len, neg_inf, lowest);
  int t = 0;
  while (j < len && (t = truth(row[j * stride], lowest_hides)) == 0) ++j;
  if (t < 0) return false;
  const int64_t begin = j;
  j = skip_words(row, stride, j, len, trues, trues);
  while (j < len && (t = truth(row[j * stride], lowest_hides)) == 1) ++j;
  if (t < 0) return false;
  run = j > begin ? Run{begin, j} : Run{};
  for (j = skip_words(row, stride, j, len, neg_inf, lowest); j < len; ++j) {
    if (truth(row[j * stride], lowest_hides) != 0) return false;
  }
  if (run.empty() && neg_inf != lowest) {
    // A row that sees no key: one only where every key is hidden by −inf
    // (kLowestHides says why).
    for (j = skip_words(row, stride, 0, len, neg_inf, neg_inf); j < len; ++j) {
      if (!std::isinf(static_cast<double>(row[j * stride]))) return false;
    }
  }
  return true;
}

// The runs of rows × batches rows (batch b's row i at runs[b·rows + i]),
// rows row_stride and batches batch_stride elements apart; false where a
// row is not one run, or (same_rows) differs from its batch index's first.
// The rows are split among the threads (a mask as large as the scores is a
// long read for one thread: docs/performance.md, "Mask structure scan"),
// each stopping once any has found a row that is not a run.
template <typename T>
bool runs_of(const at::Tensor& mask, int64_t batches, int64_t batch_stride, int64_t rows,
             int64_t row_stride, bool same_rows, bool lowest_hides, std::vector<Run>& runs) {
  const T* data = static_cast<const T*>(mask.const_data_ptr());
  const int64_t len = mask.size(-1), key_stride = mask.stride(-1);
  runs.resize(batches * rows);
  auto read_row = [&](int64_t r) {
    const T* row = data + (r / rows) * batch_stride + (r % rows) * row_stride;
    return run_of_trues(row, key_stride, len, lowest_hides, runs[r]);
  };
  // (Each batch index's first row first: the others are compared with it.)
  for (int64_t b = 0; same_rows && b < batches; ++b) {
    if (!read_row(b * rows)) return false;
  }
  std::atomic<bool> all_runs{true};
  const int64_t row_bytes = std::max<int64_t>(len * static_cast<int64_t>(sizeof(T)), 1);
  at::parallel_for(0, batches * rows, std::max<int64_t>(kRowsGrainBytes / row_bytes, 1),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end && all_runs.load(std::memory_order_relaxed); ++r) {
      if (same_rows && r % rows == 0) continue;
      const Run& first = runs[r / rows * rows];
      if (!read_row(r) ||
          (same_rows && (runs[r].begin != first.begin || runs[r].end != first.end))) {
        all_runs = false;
      }
    }
  });
  return all_runs;
}

// Whether every index of the dims `repeated` of mask holds the same bytes as
// index 0 of them all does: row by row (the last dim contiguous; otherwise
// false), in one pass over the rows stored (dims of stride 0 hold one copy),
// split among the threads, each stopping once any has found a difference.
bool repeats_along(const at::Tensor& mask, const std::vector<int64_t>& repeated) {
  if (mask.stride(-1) != 1) return false;
  const int64_t len = mask.size(-1), size = static_cast<int64_t>(mask.element_size());
  struct Dim {
    int64_t size, stride;
    bool repeated;
  };
  std::vector<Dim> dims;  // (the stored dims before the last, outermost first)
  int64_t rows = 1;
  for (int64_t d = 0; d < mask.dim() - 1; ++d) {
    if (mask.size(d) == 1 || mask.stride(d) == 0) continue;
    const bool r = std::find(repeated.begin(), repeated.end(), d) != repeated.end();
    dims.push_back({mask.size(d), mask.stride(d), r});
    rows *= mask.size(d);
  }
  const char* data = static_cast<const char*>(mask.const_data_ptr());
  std::atomic<bool> same{true};
  at::parallel_for(0, rows, std::max<int64_t>(kRowsGrainBytes / (len * size), 1),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end && same.load(std::memory_order_relaxed); ++r) {
      // Row r's offset, and that of its copy at index 0 of the repeated dims.
      int64_t offset = 0, first = 0;
      for (int64_t k = static_cast<int64_t>(dims.size()) - 1, rest = r; k >= 0; --k) {
        const int64_t index = rest % dims[k].size;
        rest /= dims[k].size;
        offset += index * dims[k].stride;
        if (!dims[k].repeated) first += index * dims[k].stride;
      }
      if (offset != first &&
          std::memcmp(data + offset * size, data + first * size, len * size) != 0) {
        same = false;
      }
    }
  });
  return same;
}

}  // namespace

std::optional<MaskStructure> find_mask_structure(const at::Tensor& mask,
                                                 c10::IntArrayRef outer_shape, int64_t len_q,
                                                 int64_t len_kv, bool with_band,
                                                 bool lowest_hides) {
  const int64_t n = static_cast<int64_t>(outer_shape.size()), dims = mask.dim();
  if (!mask.is_cpu() || n == 0 || outer_shape[0] == 0 || dims < 1 || dims > n + 2) {
    return std::nullopt;  // (reading a device's mask would sync; an empty batch has no rows)
  }
  if (mask.size(-1) != len_kv || mask.numel() == 0) return std::nullopt;
  // Only the batch dim may tell outer indices apart (and only beside a head
  // dim: with one outer dim it may be the heads of a 3-d call). Dims of
  // stride 0 (expanded) tell nothing apart, and nor do others whose indices
  // all hold what index 0 does (a mask repeated per head, as a (N·H, L, S)
  // one made with repeat_interleave): those are read at index 0, and checked
  // once index 0 turns out to be a band and key spans.
  int64_t batches = 1, batch_stride = 0;
  std::vector<int64_t> repeated_dims;
  for (int64_t d = 0; d < dims - 2; ++d) {
    if (mask.size(d) == 1 || mask.stride(d) == 0) continue;
    if (d == dims - 2 - n && n >= 2) {  // (d aligned with outer dim 0)
      batches = mask.size(d), batch_stride = mask.stride(d);
    } else {
      repeated_dims.push_back(d);
    }
  }
  const int64_t rows = dims >= 2 && mask.stride(-2) != 0 ? mask.size(-2) : 1;
  if (rows != 1 && rows != len_q) return std::nullopt;
  const int64_t row_stride = rows > 1 ? mask.stride(-2) : 0;

  // Without a band every row of a batch index must be its first (the scan
  // stops at the first that is not).
  std::vector<Run> runs;
  auto read = [&](auto element) {
    using T = decltype(element);
    return runs_of<T>(mask, batches, batch_stride, rows, row_stride, !with_band, lowest_hides,
                      runs);
  };
  bool one_run_per_row = false;
  switch (mask.scalar_type()) {
    case at::kBool: one_run_per_row = read(uint8_t{}); break;
    case at::kFloat: one_run_per_row = read(float{}); break;
    case at::kDouble: one_run_per_row = read(double{}); break;
    case at::kHalf: one_run_per_row = read(c10::Half{}); break;
    case at::kBFloat16: one_run_per_row = read(c10::BFloat16{}); break;
    default: return std::nullopt;
  }
  if (!one_run_per_row) return std::nullopt;

  // Each batch index's span: from its first row that sees a key to its last
  // (rows' runs only move right as i grows, in a band).
  MaskStructure s;
  s.spans.resize(2 * batches);
  for (int64_t b = 0; b < batches; ++b) {
    const Run* r = runs.data() + b * rows;
    int64_t first = 0, last = rows - 1;
    while (first < rows && r[first].empty()) ++first;
    while (last > first && r[last].empty()) --last;
    if (first == rows) continue;  // (sees no key: [0, 0))
    s.spans[2 * b] = r[first].begin;
    s.spans[2 * b + 1] = r[last].end;
  }
  auto span = [&](int64_t b) { return Run{s.spans[2 * b], s.spans[2 * b + 1]}; };
  // The diagonal, from a row that ends before its span does; then the
  // window, from a row that begins after it.
  for (int64_t b = 0; b < batches && !s.diagonal; ++b) {
    for (int64_t i = 0; i < rows; ++i) {
      const Run r = runs[b * rows + i];
      if (!r.empty() && r.end < span(b).end) {
        s.diagonal = r.end - 1 - i;
        break;
      }
    }
  }
  for (int64_t b = 0; s.diagonal && b < batches && !s.window_left; ++b) {
    for (int64_t i = 0; i < rows; ++i) {
      const Run r = runs[b * rows + i];
      if (!r.empty() && r.begin > span(b).begin) {
        s.window_left = i + *s.diagonal - r.begin;
        if (*s.window_left < 0) return std::nullopt;
        break;
      }
    }
  }
  if (s.diagonal && !with_band) return std::nullopt;
  // Every row what the span and the band make of it.
  for (int64_t b = 0; b < batches; ++b) {
    for (int64_t i = 0; i < rows; ++i) {
      Run want = span(b);
      if (s.window_left) want.begin = std::max(want.begin, i + *s.diagonal - *s.window_left);
      if (s.diagonal) want.end = std::min(want.end, i + *s.diagonal + 1);
      if (want.begin >= want.end) want = Run{};
      const Run got = runs[b * rows + i];
      if (got.begin != want.begin || got.end != want.end) return std::nullopt;
    }
  }
  if (!repeated_dims.empty() && !repeats_along(mask, repeated_dims)) return std::nullopt;
  return s;
}

}  // namespace fusedmha::ops
