// FlexAttention's block masks: the dense mask a block mask stands for (op
// fusedmha::block_mask_dense, shared by Python's flex_attention and the C++
// API), C++'s create_block_mask, and BlockMask::dense's cache. Composed of
// ATen ops and registered as a composite: every backend and device.

#include <fusedmha/flex.h>

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace fusedmha {
namespace {

constexpr const char* kDenseOp = "fusedmha.block_mask_dense";
constexpr const char* kCreateOp = "fusedmha::create_block_mask";

int64_t blocks_of(int64_t length, int64_t block) { return (length + block - 1) / block; }

// The (count, 4) coordinates (b, h, query block, list position) of the
// entries of a block list that num marks as listed, in list order, and
// each one's key block; listed key blocks outside [0, nk) are refused.
std::tuple<at::Tensor, at::Tensor> listed_blocks(const at::Tensor& num, const at::Tensor& indices,
                                                 int64_t nk, const char* name) {
  const at::Tensor positions = at::arange(indices.size(3), num.options().dtype(at::kLong));
  const at::Tensor entries = (positions < num.unsqueeze(-1)).nonzero();
  const at::Tensor kb = indices.index({entries.select(1, 0), entries.select(1, 1),
                                       entries.select(1, 2), entries.select(1, 3)})
                            .to(at::kLong);
  TORCH_CHECK(kb.numel() == 0 || (kb.min().item<int64_t>() >= 0 && kb.max().item<int64_t>() < nk),
              kDenseOp, ": ", name, " lists key blocks outside [0, ", nk, ")");
  return {entries, kb};
}

void check_block_list(const at::Tensor& num, const at::Tensor& indices, int64_t nq,
                      const char* num_name, const char* indices_name) {
  TORCH_CHECK(num.dim() == 3 && (num.scalar_type() == at::kInt || num.scalar_type() == at::kLong),
              kDenseOp, ": expected ", num_name, " of dtype int32 or int64 and shape (B, H, ",
              nq, "), got ", num.scalar_type(), " of shape ", num.sizes());
  TORCH_CHECK(num.size(2) == nq, kDenseOp, ": expected ", num_name, " to have ", nq,
              " query blocks (the last dim: ceil(L / QB)), got ", num.sizes());
  TORCH_CHECK(indices.dim() == 4 && indices.sizes().slice(0, 3) == num.sizes() &&
                  indices.scalar_type() == num.scalar_type() && indices.device() == num.device(),
              kDenseOp, ": expected ", indices_name, " of ", num_name, "'s dtype and device and "
              "shape (", num.sizes(), ", K), got ", indices.scalar_type(), " of shape ",
              indices.sizes(), " on ", indices.device());
  TORCH_CHECK(num.numel() == 0 ||
                  (num.min().item<int64_t>() >= 0 && num.max().item<int64_t>() <= indices.size(3)),
              kDenseOp, ": expected ", num_name, " in [0, ", indices.size(3), "] (", indices_name,
              "'s last dim)");
}

// The batch (dim 0) or head (dim 1) index each listed entry is written to,
// as (n, 1, 1) or (1, n, 1) to broadcast against the entries' (1, 1,
// count): every index of the output's n where the lists have 1 there, else
// the entry's own.
at::Tensor target_index(const at::Tensor& entries, int64_t dim, int64_t lists, int64_t n) {
  if (lists == 1 && n > 1) {
    return at::arange(n, entries.options()).view(dim == 0 ? std::vector<int64_t>{-1, 1, 1}
                                                          : std::vector<int64_t>{1, -1, 1});
  }
  return entries.select(1, dim).view({1, 1, -1});
}

at::Tensor block_mask_dense_composite(const at::Tensor& kv_num_blocks,
                                      const at::Tensor& kv_indices,
                                      const at::Tensor& partial_bits, at::IntArrayRef block_size,
                                      at::IntArrayRef seq_lengths,
                                      const std::optional<at::Tensor>& full_kv_num_blocks,
                                      const std::optional<at::Tensor>& full_kv_indices) {
  TORCH_CHECK(block_size.size() == 2 && block_size[0] > 0 && block_size[1] > 0, kDenseOp,
              ": expected block_size (QB, KB) of two positive sizes, got ", block_size);
  TORCH_CHECK(seq_lengths.size() == 2 && seq_lengths[0] >= 0 && seq_lengths[1] >= 0, kDenseOp,
              ": expected seq_lengths (L, S) of two sizes >= 0, got ", seq_lengths);
  const int64_t QB = block_size[0], KB = block_size[1], L = seq_lengths[0], S = seq_lengths[1];
  const int64_t nq = blocks_of(L, QB), nk = blocks_of(S, KB);
  check_block_list(kv_num_blocks, kv_indices, nq, "kv_num_blocks", "kv_indices");
  TORCH_CHECK(full_kv_num_blocks.has_value() == full_kv_indices.has_value(), kDenseOp,
              ": expected full_kv_num_blocks and full_kv_indices both or neither");
  if (full_kv_num_blocks) {
    check_block_list(*full_kv_num_blocks, *full_kv_indices, nq, "full_kv_num_blocks",
                     "full_kv_indices");
    TORCH_CHECK(full_kv_num_blocks->device() == kv_num_blocks.device(), kDenseOp,
                ": expected full_kv_num_blocks on kv_num_blocks' device ",
                kv_num_blocks.device(), ", got ", full_kv_num_blocks->device());
  }
  const auto [entries, kb] = listed_blocks(kv_num_blocks, kv_indices, nk, "kv_indices");
  const int64_t count = entries.size(0);
  at::Tensor bits = partial_bits.dim() == 3 ? partial_bits.unsqueeze(0).unsqueeze(0) : partial_bits;
  TORCH_CHECK(bits.dim() == 5 && bits.scalar_type() == at::kBool && bits.size(2) == count &&
                  bits.size(3) == QB && bits.size(4) == KB,
              kDenseOp, ": expected partial_bits bool (", count, ", ", QB, ", ", KB,
              ") (the listed partial blocks, (QB, KB)) or (B, H, ", count, ", ", QB, ", ", KB,
              "), got ", partial_bits.scalar_type(), " of shape ", partial_bits.sizes());
  TORCH_CHECK(bits.device() == kv_num_blocks.device(), kDenseOp,
              ": expected partial_bits on the block lists' device ", kv_num_blocks.device(),
              ", got ", bits.device());
  // The output's batch and heads: the largest of the lists' and the bits';
  // each of them 1 or that.
  const int64_t Bm = kv_num_blocks.size(0), Hm = kv_num_blocks.size(1);
  const int64_t Bf = full_kv_num_blocks ? full_kv_num_blocks->size(0) : 1;
  const int64_t Hf = full_kv_num_blocks ? full_kv_num_blocks->size(1) : 1;
  const int64_t Bo = std::max({Bm, Bf, bits.size(0)}), Ho = std::max({Hm, Hf, bits.size(1)});
  for (int64_t d : {0, 1}) {
    const int64_t lists = d == 0 ? Bm : Hm, full = d == 0 ? Bf : Hf, own = bits.size(d);
    const int64_t n = d == 0 ? Bo : Ho;
    const char* what = d == 0 ? "batch" : "heads";
    TORCH_CHECK((lists == 1 || lists == n) && (full == 1 || full == n) && (own == 1 || own == n),
                kDenseOp, ": the ", what, " of kv_num_blocks (", lists, "), full_kv_num_blocks (",
                full, ") and partial_bits (", own, ") must each be 1 or ", n);
    TORCH_CHECK(own == 1 || lists == 1, kDenseOp, ": partial_bits has ", own, " ", what,
                " and the block lists ", lists, ": bits of their own per index need lists "
                "of 1 there");
  }
  const auto on = kv_num_blocks.options();

  // The mask padded to whole blocks, and its view as (Bo, Ho, nq, nk, QB,
  // KB) blocks: each block is written whole, by one index of four.
  at::Tensor padded = at::zeros({Bo, Ho, nq * QB, nk * KB}, on.dtype(at::kBool));
  at::Tensor blocks = padded.view({Bo, Ho, nq, QB, nk, KB}).permute({0, 1, 2, 4, 3, 5});
  if (count > 0) {
    blocks.index_put_({target_index(entries, 0, Bm, Bo), target_index(entries, 1, Hm, Ho),
                       entries.select(1, 2).view({1, 1, -1}), kb.view({1, 1, -1})},
                      bits);
  }
  if (full_kv_num_blocks) {  // (after the partial bits: a block listed as both is full)
    const auto [full, full_kb] =
        listed_blocks(*full_kv_num_blocks, *full_kv_indices, nk, "full_kv_indices");
    if (full.size(0) > 0) {
      blocks.index_put_({target_index(full, 0, Bf, Bo), target_index(full, 1, Hf, Ho),
                         full.select(1, 2).view({1, 1, -1}), full_kb.view({1, 1, -1})},
                        at::ones({}, on.dtype(at::kBool)));
    }
  }
  if (nq * QB == L && nk * KB == S) return padded;
  return padded.narrow(2, 0, L).narrow(3, 0, S).contiguous();
}

}  // namespace

at::Tensor block_mask_dense(const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices,
                            const at::Tensor& partial_bits, std::array<int64_t, 2> block_size,
                            std::array<int64_t, 2> seq_lengths,
                            const std::optional<at::Tensor>& full_kv_num_blocks,
                            const std::optional<at::Tensor>& full_kv_indices) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fusedmha::block_mask_dense", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            at::IntArrayRef, at::IntArrayRef, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&)>();
  return op.call(kv_num_blocks, kv_indices, partial_bits, block_size, seq_lengths,
                 full_kv_num_blocks, full_kv_indices);
}

// What the kept dense mask was computed from: the tensors themselves (held,
// so that another tensor cannot take a dropped one's place) and their
// versions (so that a change in place is seen), and the sizes. Copies of a
// BlockMask share it, from any thread.
struct BlockMask::DenseCache {
  std::mutex lock;
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> key;
  at::Tensor dense;
};

BlockMask::BlockMask() : dense_cache_(std::make_shared<DenseCache>()) {}

at::Tensor BlockMask::dense() const {
  TORCH_CHECK(kv_num_blocks.defined() && kv_indices.defined() && partial_bits.defined(),
              "fusedmha::BlockMask: kv_num_blocks, kv_indices and partial_bits must be set (no "
              "partial blocks: kv_num_blocks of zeros and partial_bits of shape (0, QB, KB))");
  std::vector<at::Tensor> tensors{kv_num_blocks, kv_indices, partial_bits,
                                  full_kv_num_blocks.value_or(at::Tensor()),
                                  full_kv_indices.value_or(at::Tensor())};
  std::vector<int64_t> key{q_length, kv_length, q_block_size, kv_block_size};
  // (An inference tensor has no version counter: only its replacement is seen.)
  for (const at::Tensor& t : tensors) {
    key.push_back(!t.defined() || t.is_inference() ? -1 : static_cast<int64_t>(t._version()));
  }
  std::lock_guard<std::mutex> guard(dense_cache_->lock);
  DenseCache& c = *dense_cache_;
  bool same = c.dense.defined() && c.key == key;
  for (size_t i = 0; same && i < tensors.size(); ++i) same = c.tensors[i].is_same(tensors[i]);
  if (!same) {
    c.dense = block_mask_dense(kv_num_blocks, kv_indices, partial_bits,
                               {q_block_size, kv_block_size}, {q_length, kv_length},
                               full_kv_num_blocks, full_kv_indices);
    c.tensors = std::move(tensors);
    c.key = std::move(key);
  }
  return c.dense;
}

BlockMask create_block_mask(const MaskMod& mask_mod, int64_t B, int64_t H, int64_t q_length,
                            int64_t kv_length, const BlockMaskOptions& options) {
  const int64_t QB = options.q_block_size, KB = options.kv_block_size;
  TORCH_CHECK(B > 0 && H > 0 && q_length > 0 && kv_length > 0, kCreateOp,
              ": expected B, H, q_length and kv_length > 0, got ", B, ", ", H, ", ", q_length,
              ", ", kv_length);
  TORCH_CHECK(QB > 0 && KB > 0, kCreateOp, ": expected block sizes > 0, got (", QB, ", ", KB,
              ")");
  TORCH_CHECK(static_cast<bool>(mask_mod), kCreateOp, ": mask_mod is empty");
  const int64_t nq = blocks_of(q_length, QB), nk = blocks_of(kv_length, KB);
  const auto longs = at::TensorOptions().dtype(at::kLong).device(options.device);
  const at::Tensor b = at::arange(B, longs).view({-1, 1, 1, 1});
  const at::Tensor h = at::arange(H, longs).view({1, -1, 1, 1});
  // Keys padded to whole blocks. A block is full when every element inside
  // the lengths is true (a last, shorter block too), partial when some is.
  const at::Tensor kv = at::arange(nk * KB, longs).view({1, 1, 1, -1});
  // A band of query blocks at a time: about 2^24 mask elements, or one query
  // block (B · H · QB · S) where that is more.
  const int64_t band = std::max<int64_t>(1, (int64_t{1} << 24) / (B * H * QB * nk * KB));
  std::vector<at::Tensor> states, bits;
  for (int64_t q0 = 0; q0 < nq; q0 += band) {
    const int64_t n = std::min(band, nq - q0);
    const at::Tensor q = at::arange(q0 * QB, (q0 + n) * QB, longs).view({1, 1, -1, 1});
    const at::Tensor allowed =
        mask_mod(b, h, q.clamp_max(q_length - 1), kv.clamp_max(kv_length - 1));
    TORCH_CHECK(allowed.defined() && allowed.dim() <= 4, kCreateOp,
                ": mask_mod must return a tensor broadcastable to (B, H, q_idx, kv_idx)");
    TORCH_CHECK(allowed.device() == options.device, kCreateOp, ": mask_mod returned a tensor on ",
                allowed.device(), " for indices on ", options.device);
    const at::Tensor inside = (q < q_length).logical_and(kv < kv_length);
    auto as_blocks = [&](const at::Tensor& t) {  // (B, H, n, nk, QB · KB)
      return t.expand({B, H, n * QB, nk * KB})
          .reshape({B, H, n, QB, nk, KB})
          .permute({0, 1, 2, 4, 3, 5})
          .reshape({B, H, n, nk, QB * KB});
    };
    const at::Tensor blocks = as_blocks(allowed.to(at::kBool).logical_and(inside));
    const at::Tensor any = blocks.any(-1);
    const at::Tensor all = blocks.logical_or(as_blocks(inside.logical_not())).all(-1);
    // 2 full, 1 partial, 0 empty.
    const at::Tensor state = all.to(at::kByte).mul(2).add(any.logical_and(~all).to(at::kByte));
    states.push_back(state);
    // (The partial blocks' bits, (count, QB, KB), in (b, h, block) order.)
    bits.push_back(blocks.index({state == 1}).view({-1, QB, KB}));
  }
  const at::Tensor state = at::cat(states, 2);  // (B, H, nq, nk)
  at::Tensor all_bits = at::cat(bits, 0);
  // The bands list their partial blocks band by band; list order runs over
  // (b, h, query block) first: reorder by each block's position.
  if (states.size() > 1) {
    std::vector<at::Tensor> positions;
    const at::Tensor grid = at::arange(B * H * nq * nk, longs).view({B, H, nq, nk});
    for (size_t i = 0; i < states.size(); ++i) {
      const int64_t q0 = static_cast<int64_t>(i) * band;
      const at::Tensor part = grid.narrow(2, q0, states[i].size(2));
      positions.push_back(part.index({states[i] == 1}));
    }
    all_bits = all_bits.index({at::argsort(at::cat(positions))});
  }
  // Each row's blocks of one kind first, in key order: a stable sort of
  // "not this kind".
  auto list_of = [&](int64_t kind) {
    const at::Tensor is = state == kind;
    const at::Tensor order = std::get<1>(
        at::sort((~is).to(at::kByte), std::optional<bool>(true), /*dim=*/-1, false));
    return std::make_tuple(is.sum(-1).to(at::kInt), order.to(at::kInt));
  };
  BlockMask mask;
  std::tie(mask.kv_num_blocks, mask.kv_indices) = list_of(1);
  auto [full_num, full_indices] = list_of(2);
  mask.full_kv_num_blocks = full_num;
  mask.full_kv_indices = full_indices;
  mask.partial_bits = all_bits.contiguous();
  mask.q_length = q_length;
  mask.kv_length = kv_length;
  mask.q_block_size = QB;
  mask.kv_block_size = KB;
  return mask;
}

TORCH_LIBRARY_IMPL(fusedmha, CompositeImplicitAutograd, m) {
  m.impl("block_mask_dense", TORCH_FN(block_mask_dense_composite));
}

}  // namespace fusedmha
