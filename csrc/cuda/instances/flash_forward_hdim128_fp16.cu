// One instance of the tensor-core forward kernel: fp16, head dims up to 128.
#include "cuda/flash_forward.cuh"

namespace fusedmha::cuda {
template cudaError_t run_flash_forward<__half, 128>(const AttentionParams&, cudaStream_t);
}  // namespace fusedmha::cuda
