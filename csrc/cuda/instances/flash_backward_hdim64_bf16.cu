// One instance of the tensor-core backward kernel: bf16, head dims up to 64.
#include "cuda/flash_backward.cuh"

namespace fusedmha::cuda {
template cudaError_t run_flash_backward<__nv_bfloat16, 64>(const BackwardParams&, cudaStream_t);
}  // namespace fusedmha::cuda
