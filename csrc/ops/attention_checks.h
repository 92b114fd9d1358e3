#pragma once

// Input validation of the fusedmha ops, shared by every backend (CPU, CUDA,
// Meta) so that they accept the same inputs and raise the same errors.
// Each check raises c10::Error (RuntimeError in Python) whose message starts
// with the op it is given (the entry point the user called) and names the
// bad argument. Works on symbolic sizes, so the Meta kernels run it under
// torch.compile.

#include <ATen/core/Tensor.h>
#include <fusedmha/attention.h>

#include <optional>
#include <utility>

#include "ops/op_args.h"
#include "ops/packed_batch.h"

namespace fusedmha::ops {

// The ops' names, as error messages start.
inline constexpr const char* kForwardOp = "fusedmha.attention_forward";
inline constexpr const char* kBackwardOp = "fusedmha.attention_backward";
inline constexpr const char* kWeightsOp = "fusedmha.attention_weights";
inline constexpr const char* kSdpaOp = "fusedmha.scaled_dot_product_attention";
inline constexpr const char* kVarlenForwardOp = "fusedmha.varlen_attention_forward";
inline constexpr const char* kVarlenBackwardOp = "fusedmha.varlen_attention_backward";

// dropout_state of attention_forward: int64 [seed, offset] or [seed, offset,
// row, column] with row >= 0 and column a multiple of 4, >= 0.
// (Its values, where they are read: check_dropout_position.)
void check_dropout_state(const char* op, const std::optional<at::Tensor>& dropout_state);
void check_dropout_position(const char* op, int64_t row, int64_t column);

// The rng_state a forward call returns: the one it drew (allocated as
// `drawn`), or dropout_state when given (a copy, on drawn's device: the
// query's).
at::Tensor returned_rng_state(const at::Tensor& drawn,
                              const std::optional<at::Tensor>& dropout_state);

// The variants of a call whose outer shape (batch dims..., H) is `outer`:
// window bounds >= -1, softcap finite and >= 0, alibi_slopes (H) or (B, H)
// and sinks (H), floating, on the query's device.
void check_variants(const char* op, const at::Tensor& query, const std::vector<c10::SymInt>& outer,
                    const AttentionVariants& variants);

// Whether a mask of these sizes broadcasts to target (no more dims, and each
// of its trailing dims 1 or target's).
bool mask_broadcasts_to(c10::SymIntArrayRef mask, c10::SymIntArrayRef target);

// The inputs of each op, as its record (ops/op_args.h) holds them:
//  - forward: query (..., L, E), key (..., S, E), value (..., S, Ev): dtypes,
//    devices, matching dims, broadcastable batch/head dims (or GQA),
//    attn_mask dtype and shape, dropout_p in [0, 1), scale finite and >= 0,
//    the variants (check_variants) and dropout_state;
//  - backward: the forward's, plus grad_out and out of the forward output's
//    shape and the query's dtype, logsumexp and rng_state as
//    attention_forward returned them, grad_logsumexp (when given) of the
//    logsumexp's shape;
//  - weights: the forward's (key standing in for value), plus logsumexp and
//    rng_state as attention_forward returned them;
//  - varlen forward: a packed batch (ops/packed_batch.h), query (total_q, H,
//    E), key (total_k, H_kv, E), value (total_k, H_kv, Ev), H a multiple of
//    H_kv, dtypes and devices as the forward's; the lengths' dtypes, shapes
//    and devices (not their values: see check_packed_batch_values);
//    alibi_slopes (H) or (B, H);
//  - varlen backward: the varlen forward's, plus grad_out and out (total_q,
//    H, Ev), logsumexp (H, total_q) and rng_state as varlen_attention_forward
//    returned them, grad_logsumexp of the logsumexp's shape.
void check_forward_inputs(const char* op, const ForwardArgs& args);
void check_backward_inputs(const char* op, const BackwardArgs& args);
void check_weights_inputs(const char* op, const WeightsArgs& args);
void check_varlen_forward_inputs(const char* op, const VarlenForwardArgs& args);
void check_varlen_backward_inputs(const char* op, const VarlenBackwardArgs& args);

// A varlen call's packed batch (its block_table: the forward's only).
PackedBatch packed_batch(const VarlenForwardArgs& args);
PackedBatch packed_batch(const VarlenBackwardArgs& args);

// The values of a packed batch's lengths, where reading them costs nothing
// (the CPU; on a GPU it would wait for the device): cumulative lengths
// non-decreasing from >= 0 up to the rows there are, seqused_k within each
// sequence's keys, and max_seqlen_q/k at least every length (a smaller
// bound would leave rows uncomputed); with block_table, page indices in
// range and every sequence within the pages its table row holds. Returns
// the longest query and key sequences (keys: as seqused_k has them).
std::pair<int64_t, int64_t> check_packed_batch_values(const char* op, const PackedBatch& batch,
                                                      int64_t total_q, const at::Tensor& key);

}  // namespace fusedmha::ops
