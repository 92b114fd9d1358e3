# cmake -DLIB=<static library> -P CheckNoSharedSymbols.cmake
# Fails if LIB defines weak (W/V) or unique (u) symbols: in code compiled for
# a wide ISA those are copies of inline functions that the linker could pick
# for baseline callers, making them run AVX2/AVX-512 instructions anywhere.
# Exception: ATen's own vector helpers in at::vec::<LEVEL>:: (its inline
# namespace is named after CPU_CAPABILITY, which each level's build sets), so
# only code of the same level can refer to them; and DW.ref.__gxx_personality_v0,
# a pointer to the C++ exception personality routine that sanitizer builds
# emit in every object (data, the same in all of them: no ISA-specific code).
find_program(NM_PROGRAM NAMES nm REQUIRED)
execute_process(COMMAND "${NM_PROGRAM}" --defined-only -C "${LIB}"
                OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nm failed on ${LIB}")
endif()
string(REGEX MATCHALL "[^\n]* [WVu] [^\n]*" shared "${symbols}")
list(FILTER shared EXCLUDE REGEX " [WVu] (at::vec::(AVX2|AVX512)::|DW\\.ref\\.__gxx_personality_v0$)")
if(shared)
  list(JOIN shared "\n  " shared)
  message(FATAL_ERROR "${LIB} defines symbols the linker may share with baseline code:\n  ${shared}")
endif()
