# The source list of the library, read by CMakeLists.txt (and so by setup.py,
# which drives CMake). Nothing else lists sources.
set(FUSEDMHA_SOURCES
  csrc/ops/registration.cpp
  csrc/ops/attention.cpp
  csrc/ops/attention_checks.cpp
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
