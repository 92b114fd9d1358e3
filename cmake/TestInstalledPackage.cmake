# ctest's check of the installed package, run with cmake -P:
#   -DBUILD_DIR=<fusedmha build> -DSOURCE_DIR=<fusedmha source> -DWORK_DIR=<scratch>
#   -DTorch_DIR=<torch's cmake dir> [-DPYTHON=<python that imports fusedmha> -DPYTHONPATH=...]
# Installs fusedmha to a fresh prefix, builds examples/cpp against it with
# only find_package(FusedMHA), and runs the example (with a model exported
# from Python, as an AOTInductor package and as TorchScript, when PYTHON is
# given).
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
set(launcher "")
find_program(CCACHE ccache)
if(CCACHE)
  set(launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE})
endif()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/cpp -B ${WORK_DIR}/build -G Ninja
    -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" -DTorch_DIR=${Torch_DIR}
    ${launcher})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
set(model_args "")
if(PYTHON)
  run(${CMAKE_COMMAND} -E env PYTHONPATH=${PYTHONPATH} TORCHINDUCTOR_CACHE_DIR=${WORK_DIR}/inductor_cache
      ${PYTHON} ${SOURCE_DIR}/examples/cpp/export_scripted_model.py ${WORK_DIR}/scripted)
  set(model_args ${WORK_DIR}/scripted)
endif()
run(${WORK_DIR}/build/fusedmha_example ${model_args})
