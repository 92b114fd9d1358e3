#pragma once

// What the CPU host wrappers (forward and backward) share: describing
// tensors to the kernels as plain params, picking the ISA level's kernels and
// sharing work items among the threads.

#include "cpu/attention_params.h"
#include "cpu/kernels.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <vector>

namespace fusedmha::cpu {

// The kernels of one ISA level.
struct IsaKernels {
  size_t (*forward_configure)(ForwardParams&);
  void (*forward_items)(const ForwardParams&, int64_t, int64_t, void*);
  size_t (*backward_configure)(BackwardParams&);
  void (*backward_items)(const BackwardParams&, int64_t, int64_t, void*);
  size_t (*weights_configure)(WeightsParams&);
  void (*weights_items)(const WeightsParams&, int64_t, int64_t, void*);
};

// The kernels of the ISA level selected now (see isa.h).
IsaKernels selected_kernels();

// Per outer index (batch dims..., head of the output), the element offset of
// the (rows, cols) matrix it reads in t, whose dims are (..., H_t, rows,
// cols) or just (rows, cols). Dims t lacks or has as size 1 broadcast; a
// head count that divides the output's maps head h to h / (H / H_t) (GQA).
std::vector<int64_t> outer_offsets(const at::Tensor& t, c10::IntArrayRef outer);

// The inputs of an attention call, described for the kernels. Owns the
// offset tables the params point into, so it must outlive the kernel run.
struct AttentionInputs {
  at::Tensor query, key, value;  // with contiguous last dims
  std::vector<int64_t> outer_shape;
  ForwardParams params;          // everything but the outputs

  AttentionInputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const std::optional<at::Tensor>& attn_mask, bool is_causal,
                  std::optional<double> scale, bool enable_gqa);

  // A (rows, cols) matrix per outer index of t, which keeps offsets alive.
  MatrixView view(const at::Tensor& t);

 private:
  std::vector<std::vector<int64_t>> offsets_;
};

// Sets p's dropout fields to replay the stream a forward call drew
// (rng_state as attention_forward returned it); leaves dropout off when
// dropout_p is 0.
void replay_dropout(ForwardParams& p, const at::Tensor& rng_state, double dropout_p);

// Runs items [0, n_items) on the intra-op threads, each thread with its own
// workspace of workspace_bytes (64-byte aligned). Items are handed out one at
// a time, costliest (highest index) first, so threads finish together even
// when items differ in cost.
void run_items_in_parallel(int64_t n_items, size_t workspace_bytes,
                           const std::function<void(int64_t item, void* workspace)>& run);

// Threads run_items_in_parallel will use.
int64_t available_threads();

}  // namespace fusedmha::cpu
