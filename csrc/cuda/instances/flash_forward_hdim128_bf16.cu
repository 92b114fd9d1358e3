// One instance of the tensor-core forward kernel: bf16, head dims up to 128.
#include "cuda/flash_forward.cuh"

namespace fusedmha::cuda {
template cudaError_t run_flash_forward<__nv_bfloat16, 128>(const AttentionParams&, cudaStream_t);
}  // namespace fusedmha::cuda
