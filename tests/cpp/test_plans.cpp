// The CPU work split (csrc/cpu/plan.h) for representative calls, per ISA
// level and cache size, computed by hand from the rules plan.cpp states:
// the plans are host code, so they are tested here without any kernel.

#include <gtest/gtest.h>

#include <initializer_list>

#include "cpu/plan.h"

namespace fusedmha::cpu {
namespace {

// The traits of the three levels' kernels for float32 calls on x86.
KernelTraits avx2() { return {/*float_lanes=*/8, /*micro_rows=*/6, 16, 8}; }
KernelTraits avx512() { return {/*float_lanes=*/16, /*micro_rows=*/12, 16, 8}; }

constexpr int64_t kKiB = 1024;

// A float32 call with outer dims `outer`, L query rows, S keys, head dim E,
// q/k/v/out laid out (..., L or S, E) contiguously.
AttentionParams call(std::initializer_list<int64_t> outer, int64_t L, int64_t S, int64_t E) {
  AttentionParams p;
  p.outer.dims = static_cast<int>(outer.size());
  p.num_outer = 1;
  int d = 0;
  for (int64_t s : outer) p.outer.size[d++] = s, p.num_outer *= s;
  p.len_q = L, p.len_kv = S, p.dim_qk = E, p.dim_v = E;
  auto layout = [&](Matrix& m, int64_t rows) {
    m.row_stride = E;
    int64_t stride = rows * E;
    for (int i = p.outer.dims - 1; i >= 0; --i)
      m.outer_stride[i] = stride, stride *= p.outer.size[i];
  };
  layout(p.q, L), layout(p.k, S), layout(p.v, S), layout(p.out, L);
  return p;
}

TEST(Plans, PrefillTakesLongQueryBlocksWhereTheyFitInL2) {
  // B=2, H=8, L=S=1024, E=64: a block of 512 queries and a key block take
  // 4·(512·(64 + 3 + 64) + 64·128) = 294 KiB.
  const AttentionParams p = call({2, 8}, 1024, 1024, 64);
  const WorkSplit big = plan_forward(p, avx2(), {32 * kKiB, 512 * kKiB}, 2);
  EXPECT_FALSE(big.decode);
  EXPECT_EQ(big.block_q, 512);
  EXPECT_EQ(big.block_kv, 64);
  EXPECT_EQ(big.items, 16 * 2);
  EXPECT_EQ(big.heads, 1);
  const WorkSplit small = plan_forward(p, avx2(), {32 * kKiB, 256 * kKiB}, 2);
  EXPECT_EQ(small.block_q, 256);
  EXPECT_EQ(small.items, 16 * 4);
}

TEST(Plans, ShortCallsGiveEveryThreadSeveralItems) {
  // One head, 256 queries, 8 threads: 4 items for each thread would be
  // blocks of 8 rows, rounded up to the granule, a panel of 16 floats.
  const WorkSplit s = plan_forward(call({1, 1}, 256, 256, 64), avx2(), {}, 8);
  EXPECT_EQ(s.block_q, 16);
  EXPECT_EQ(s.items, 16);
}

TEST(Plans, HeadsSharingAMaskShareItems) {
  // An (L, S) float mask broadcast over B=2, H=8: all 8 heads of a batch
  // index in one item (their states, 8 · 4·128·(64 + 3 + 64) bytes, fit in
  // 1 MiB), over blocks of 128 queries.
  AttentionParams p = call({2, 8}, 1024, 1024, 64);
  p.mask_kind = MaskKind::Additive;
  p.mask.row_stride = 1024;  // outer strides 0: the same mask for every head
  const WorkSplit s = plan_forward(p, avx2(), {}, 2);
  EXPECT_EQ(s.heads, 8);
  EXPECT_EQ(s.block_q, 128);
  EXPECT_EQ(s.items, 2 * 8);
}

TEST(Plans, SlidingWindowsTakeBlocksOfAnEighthOfTheBand) {
  AttentionParams p = call({1, 4}, 4096, 4096, 64);
  p.window_left = 255, p.window_right = 0;
  EXPECT_EQ(plan_forward(p, avx2(), {}, 2).block_q, 32);
}

TEST(Plans, DecodingGivesEachThreadTwoItems) {
  // One query per head over 4096 keys, 8 heads with keys of their own
  // ((B, H, S, E)), E=128: key blocks of 32 keys (K and V rows of 4·256
  // bytes in 32 KiB of L1), 2 heads per item so that 2 threads get 2 items
  // each, no key split.
  const WorkSplit s = plan_forward(call({1, 8}, 1, 4096, 128), avx2(), {32 * kKiB, 512 * kKiB}, 2);
  EXPECT_TRUE(s.decode);
  EXPECT_EQ(s.block_kv, 32);
  EXPECT_EQ(s.heads, 2);
  EXPECT_EQ(s.kv_splits, 1);
  EXPECT_EQ(s.items, 4);
}

TEST(Plans, DecodingOneHeadSplitsItsKeys) {
  // One head over 8192 keys: 4 chunks, two for each of 2 threads.
  const WorkSplit s = plan_forward(call({1, 1}, 1, 8192, 128), avx512(), {}, 2);
  EXPECT_TRUE(s.decode);
  EXPECT_EQ(s.heads, 1);
  EXPECT_EQ(s.kv_splits, 4);
  EXPECT_EQ(s.items, 4);
}

TEST(Plans, DecodingMergesDraftRowsOfHeadsThatReadTheSameKeys) {
  // 2 query rows per head (a draft), 8 query heads over 2 K/V heads: the
  // rows of 4 heads of a K/V head (8 rows) share a score tile of up to 16.
  AttentionParams p = call({1, 8}, 2, 4096, 128);
  for (Matrix* m : {&p.k, &p.v}) m->divisor[1] = 4, m->outer_stride[1] = 4096 * 128;
  const WorkSplit s = plan_forward(p, avx2(), {32 * kKiB, 512 * kKiB}, 2);
  EXPECT_TRUE(s.decode);
  EXPECT_EQ(s.heads % 4, 0);
  EXPECT_EQ(s.merged, 4);
}

TEST(Plans, ManyQueryRowsAreNotDecoding) {
  EXPECT_FALSE(plan_forward(call({1, 8}, 65, 4096, 128), avx2(), {}, 2).decode);
  EXPECT_FALSE(plan_forward(call({1, 8}, 1, 64, 128), avx2(), {}, 2).decode);  // few keys
}

TEST(Plans, BackwardSplitsKeysSoThatEveryThreadGetsTwoItems) {
  // B·H = 2, L = S = 512 on AVX2 (micro-kernels of 6 rows): key blocks of
  // 128 (of 4·2 threads' worth of 132), each outer index's 4 key blocks in 2
  // sets, each with its dQ slice.
  BackwardParams bp;
  bp.fwd = call({1, 2}, 512, 512, 64);
  const WorkSplit s = plan_backward(bp, avx2(), 2);
  EXPECT_EQ(s.block_q, 64);
  EXPECT_EQ(s.block_kv, 128);
  EXPECT_EQ(bp.grad_q_splits, 2);
  EXPECT_EQ(s.items, 4);
  // Many outer indices: one set, no extra dQ slices.
  bp.fwd = call({8, 8}, 512, 512, 64);
  plan_backward(bp, avx2(), 2);
  EXPECT_EQ(bp.grad_q_splits, 1);
}

TEST(Plans, BackwardItemsOfOuterIndicesThatShareAMaskGradient) {
  // B=4, H=8, L=S=1024 with the gradient of an (H, L, S) bias: the 4 batch
  // indices of a head are one item's members, 8 items.
  float sums = 0;
  BackwardParams bp;
  bp.fwd = call({4, 8}, 1024, 1024, 64);
  bp.grad_mask.data = &sums;
  bp.grad_mask.outer_stride[1] = 1024 * 1024;  // (batch: stride 0)
  bp.grad_mask.row_stride = 1024;
  bp.grad_mask.col_stride = 1;
  WorkSplit s = plan_backward(bp, avx2(), 2);
  EXPECT_EQ(s.members, 4);
  EXPECT_EQ(bp.grad_q_splits, 1);
  EXPECT_EQ(s.items, 8);
  // An (L, S) bias every outer index shares, on 16 threads: key blocks sized
  // for one group (1024 / (4·16) = 16 keys, whole micro-kernels of 6: 18),
  // one set per thread, up to 1 + S / (4·E) = 5 sets (their dQ slices
  // within a quarter of the scores).
  bp.grad_mask.outer_stride[1] = 0;
  s = plan_backward(bp, avx2(), 16);
  EXPECT_EQ(s.members, 32);
  EXPECT_EQ(s.block_kv, 18);
  EXPECT_EQ(bp.grad_q_splits, 5);
  EXPECT_EQ(s.items, 5);
  // Broadcast over the keys too (an (L, 1) bias): one set, every key block
  // summing into it.
  bp.grad_mask.col_stride = 0;
  s = plan_backward(bp, avx2(), 16);
  EXPECT_EQ(bp.grad_q_splits, 1);
  EXPECT_EQ(s.items, 1);
}

TEST(Plans, WeightsBlocksOfQueryRows) {
  WeightsParams wp;
  wp.fwd = call({1, 4}, 100, 50, 64);
  const WorkSplit s = plan_weights(wp, avx512(), 2);
  EXPECT_EQ(s.block_q, 64);
  EXPECT_EQ(s.block_kv, 50);
  EXPECT_EQ(s.items, 8);
  wp.heads_per_item = 4;  // averaged over the heads: one matrix, in blocks of 32 rows
  EXPECT_EQ(plan_weights(wp, avx512(), 2).items, 4);
}

}  // namespace
}  // namespace fusedmha::cpu
