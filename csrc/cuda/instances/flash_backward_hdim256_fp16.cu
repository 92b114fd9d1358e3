// One instance of the tensor-core backward kernel: fp16, head dims up to 256.
#include "cuda/flash_backward.cuh"

namespace fusedmha::cuda {
template cudaError_t run_flash_backward<__half, 256>(const BackwardParams&, cudaStream_t);
}  // namespace fusedmha::cuda
