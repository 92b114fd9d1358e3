# The source list of the library, read by CMakeLists.txt (and so by setup.py,
# which drives CMake). Nothing else lists sources.
set(FUSEDMHA_SOURCES
  csrc/ops/registration.cpp
  csrc/ops/attention.cpp
  csrc/ops/merge_attention.cpp
  csrc/ops/kvcache_attention.cpp
  csrc/ops/kv_quantization.cpp
  csrc/ops/block_mask.cpp
  csrc/ops/flex_attention.cpp
  csrc/ops/tensor_overlap.cpp
  csrc/ops/attention_checks.cpp
  csrc/ops/attention_shapes.cpp
  csrc/ops/attention_params_filler.cpp
  csrc/ops/mask_structure.cpp
  csrc/ops/mask_tiles.cpp
  csrc/ops/attention_meta.cpp
  csrc/ops/attention_autograd.cpp
  csrc/ops/attention_autocast.cpp
  csrc/ops/build_info.cpp
  csrc/modules/multihead_attention.cpp
  csrc/modules/multihead_attention_core.cpp
  csrc/cpu/attention_forward.cpp
  csrc/cpu/attention_backward.cpp
  csrc/cpu/attention_weights.cpp
  csrc/cpu/dropout_mask.cpp
  csrc/cpu/isa.cpp
  csrc/cpu/plan.cpp
  csrc/cpu/work_items.cpp
  csrc/cpu/fma_peak.cpp
  csrc/cpu/memory_read.cpp
)
# Compiled once per ISA level (see FUSEDMHA_CPU_ISA_LEVELS).
set(FUSEDMHA_CPU_ISA_SOURCES
  csrc/cpu/attention_forward_kernel.cpp
  csrc/cpu/attention_backward_kernel.cpp
  csrc/cpu/attention_weights_kernel.cpp
  csrc/cpu/fma_peak_kernel.cpp
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
# The tensor-core instances, one file each, written into the build tree
# from one template (csrc/cuda/flash_instance.cu.in).
set(_flash_params_forward AttentionParams)
set(_flash_params_backward BackwardParams)
set(_flash_type_fp16 __half)
set(_flash_type_bf16 __nv_bfloat16)
foreach(FLASH_DIRECTION forward backward)
  set(FLASH_PARAMS ${_flash_params_${FLASH_DIRECTION}})
  foreach(FLASH_DIM 64 128 256)
    foreach(_dtype fp16 bf16)
      set(FLASH_TYPE ${_flash_type_${_dtype}})
      set(_instance ${CMAKE_CURRENT_BINARY_DIR}/cuda_instances/flash_${FLASH_DIRECTION}_hdim${FLASH_DIM}_${_dtype}.cu)
      configure_file(${CMAKE_CURRENT_LIST_DIR}/../csrc/cuda/flash_instance.cu.in ${_instance} @ONLY)
      list(APPEND FUSEDMHA_CUDA_KERNEL_SOURCES ${_instance})
    endforeach()
  endforeach()
endforeach()
