// One instance of the tensor-core backward kernel: bf16, head dims up to 128.
#include "cuda/flash_backward.cuh"

namespace fusedmha::cuda {
template cudaError_t run_flash_backward<__nv_bfloat16, 128>(const BackwardParams&, cudaStream_t);
}  // namespace fusedmha::cuda
