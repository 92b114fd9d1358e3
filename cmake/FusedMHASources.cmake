# The source list of the library, read by CMakeLists.txt (and so by setup.py,
# which drives CMake). Nothing else lists sources.
set(FUSEDMHA_SOURCES
  csrc/ops/registration.cpp
  csrc/ops/attention.cpp
  csrc/ops/attention_checks.cpp
  csrc/ops/kernel_inputs.cpp
  csrc/ops/attention_meta.cpp
  csrc/ops/attention_autograd.cpp
  csrc/ops/build_info.cpp
  csrc/modules/multihead_attention.cpp
  csrc/cpu/attention_forward.cpp
  csrc/cpu/attention_backward.cpp
  csrc/cpu/attention_weights.cpp
  csrc/cpu/dropout_mask.cpp
  csrc/cpu/isa.cpp
  csrc/cpu/launch.cpp
)
# Compiled once per ISA level (see FUSEDMHA_CPU_ISA_LEVELS).
set(FUSEDMHA_CPU_ISA_SOURCES
  csrc/cpu/attention_forward_kernel.cpp
  csrc/cpu/attention_backward_kernel.cpp
  csrc/cpu/attention_weights_kernel.cpp
)
# Compiled when FUSEDMHA_WITH_CUDA (cmake/FusedMHACuda.cmake): the host
# wrappers (C++, with torch) and the kernels (CUDA, without torch headers;
# one tensor-core instance per file so they compile in parallel).
set(FUSEDMHA_CUDA_HOST_SOURCES
  csrc/cuda/attention_cuda.cpp
)
set(FUSEDMHA_CUDA_KERNEL_SOURCES
  csrc/cuda/flash_dispatch.cu
  csrc/cuda/simple_kernels.cu
)
foreach(direction forward backward)
  foreach(dim 64 128 256)
    foreach(dtype fp16 bf16)
      list(APPEND FUSEDMHA_CUDA_KERNEL_SOURCES
           csrc/cuda/instances/flash_${direction}_hdim${dim}_${dtype}.cu)
    endforeach()
  endforeach()
endforeach()
