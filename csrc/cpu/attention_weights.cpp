// CPU kernel of fusedmha::attention_weights: check, allocate, fill the
// params, run the work items (one per batch index or batch·head and block
// of query rows) on the threads.

#include <torch/library.h>

#include "cpu/isa_kernels.h"
#include "cpu/work_items.h"
#include "ops/attention_checks.h"
#include "ops/attention_params_filler.h"
#include "ops/attention_shapes.h"

namespace fusedmha::cpu {
namespace {

at::Tensor attention_weights_cpu(const ops::WeightsArgs& a) {
  auto [weights, positive] = ops::start_weights(a);
  if (!positive) return weights;  // (and the work split would divide by zero)
  ops::AttentionCall call(ops::kWeightsOp, a);
  const WeightsParams wp =
      call.weights(a.logsumexp, a.rng_state, a.dropout_p, a.average_heads, weights);
  const IsaKernels kernels = selected_kernels();
  const WorkSplit split = kernels.weights_split(wp, available_threads());
  run_items_in_parallel(split.items, split.workspace_bytes, [&](int64_t item, void* workspace) {
    kernels.weights_item(wp, split, item, workspace);
  });
  return weights;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) { FUSEDMHA_OP_IMPL(m, attention_weights_cpu); }

}  // namespace fusedmha::cpu
