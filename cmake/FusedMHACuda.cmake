# Decides FUSEDMHA_WITH_CUDA from FUSEDMHA_CUDA=auto|0|1, from the toolkit
# and the torch build, never from a GPU being present: a machine with nvcc
# and a CUDA torch compiles and links the CUDA kernels even without a GPU.
#
# Sets FUSEDMHA_WITH_CUDA (0/1) and, when 1, FUSEDMHA_CUDA_ARCH_FLAGS: the
# -gencode flags for TORCH_CUDA_ARCH_LIST (environment or cache; default
# "8.0;9.0+PTX": A100, H100/H200 machine code, PTX for newer GPUs).
set(FUSEDMHA_WITH_CUDA 0)
if(NOT FUSEDMHA_CUDA STREQUAL "0")
  include(CheckLanguage)
  check_language(CUDA)
  set(_torch_has_cuda OFF)
  if(TARGET c10_cuda OR C10_CUDA_LIBRARY)
    set(_torch_has_cuda ON)
  endif()
  if(CMAKE_CUDA_COMPILER AND _torch_has_cuda)
    set(FUSEDMHA_WITH_CUDA 1)
  elseif(FUSEDMHA_CUDA STREQUAL "1")
    message(FATAL_ERROR "fusedmha: FUSEDMHA_CUDA=1 but no CUDA toolkit (nvcc) or no CUDA-enabled "
                        "torch was found. Install the CUDA toolkit matching torch.version.cuda, or "
                        "build with FUSEDMHA_CUDA=0 for CPU only.")
  endif()
endif()

if(FUSEDMHA_WITH_CUDA)
  enable_language(CUDA)
  # nvcc must share torch's CUDA major version: the kernels link against
  # torch's CUDA runtime, and a different major is not ABI compatible.
  set(_torch_cuda_version "")
  if(EXISTS "${TORCH_INSTALL_PREFIX}/version.py")
    file(STRINGS "${TORCH_INSTALL_PREFIX}/version.py" _line REGEX "^cuda")
    string(REGEX MATCH "'([0-9]+\\.[0-9]+)'" _m "${_line}")
    set(_torch_cuda_version "${CMAKE_MATCH_1}")
  elseif(DEFINED CUDAToolkit_VERSION)
    set(_torch_cuda_version "${CUDAToolkit_VERSION}")
  endif()
  string(REGEX MATCH "^[0-9]+" _nvcc_major "${CMAKE_CUDA_COMPILER_VERSION}")
  string(REGEX MATCH "^[0-9]+" _torch_major "${_torch_cuda_version}")
  if(_torch_major AND NOT _nvcc_major STREQUAL _torch_major)
    set(_msg "fusedmha: nvcc ${CMAKE_CUDA_COMPILER_VERSION} (${CMAKE_CUDA_COMPILER}) does not match "
             "the CUDA ${_torch_cuda_version} torch was built with. Put a CUDA ${_torch_major}.x "
             "toolkit first on PATH (or set CUDACXX), install a torch built for CUDA "
             "${_nvcc_major}, or build with FUSEDMHA_CUDA=0 for CPU only.")
    if(FUSEDMHA_CUDA STREQUAL "1")
      message(FATAL_ERROR ${_msg})
    endif()
    message(WARNING "${_msg} Building CPU only.")
    set(FUSEDMHA_WITH_CUDA 0)
  endif()
endif()

if(FUSEDMHA_WITH_CUDA)
  # torch's CMake adds -gencode flags for every architecture it knows when
  # no GPU is visible; the kernels need sm_80+ and are built for the list
  # below only, so those are dropped.
  string(REGEX REPLACE "-gencode[ =]+arch=[^ ]+" "" CMAKE_CUDA_FLAGS "${CMAKE_CUDA_FLAGS}")
  set(_arch_list "8.0;9.0+PTX")
  if(DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
    set(_arch_list "$ENV{TORCH_CUDA_ARCH_LIST}")
  endif()
  string(REPLACE " " ";" _arch_list "${_arch_list}")
  set(FUSEDMHA_CUDA_ARCH_FLAGS "")
  foreach(_arch IN LISTS _arch_list)
    string(REGEX MATCH "^([0-9]+)\\.([0-9]+)([a-z]?)(\\+PTX)?$" _ok "${_arch}")
    if(NOT _ok)
      message(FATAL_ERROR "fusedmha: TORCH_CUDA_ARCH_LIST entry '${_arch}' is not like 8.0, 9.0a or 9.0+PTX")
    endif()
    set(_sm "${CMAKE_MATCH_1}${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
    if(CMAKE_MATCH_1 LESS 8)
      message(FATAL_ERROR "fusedmha: the CUDA kernels need compute capability 8.0 or newer; "
                          "TORCH_CUDA_ARCH_LIST has ${_arch}")
    endif()
    list(APPEND FUSEDMHA_CUDA_ARCH_FLAGS "-gencode=arch=compute_${_sm},code=sm_${_sm}")
    if(CMAKE_MATCH_4)
      list(APPEND FUSEDMHA_CUDA_ARCH_FLAGS "-gencode=arch=compute_${_sm},code=compute_${_sm}")
    endif()
  endforeach()
  if(CCACHE_PROGRAM)
    set(CMAKE_CUDA_COMPILER_LAUNCHER ${FUSEDMHA_CCACHE})
  endif()
  message(STATUS "fusedmha: CUDA kernels for ${_arch_list} (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, "
                 "torch CUDA ${_torch_cuda_version})")
endif()
message(STATUS "fusedmha: CUDA kernels: ${FUSEDMHA_WITH_CUDA}")
