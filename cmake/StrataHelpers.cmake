# Small helpers in the spirit of abseil's absl_cc_library: one target per folder,
# explicit dependencies, strata::NAME aliases.
include_guard(GLOBAL)

# strata_cc_library(NAME base SRCS a.cc b.cc DEPS strata::x fmt::fmt [PRIVATE_DEPS ...])
function(strata_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(strata_${A_NAME} STATIC ${A_SRCS})
  add_library(strata::${A_NAME} ALIAS strata_${A_NAME})
  target_include_directories(strata_${A_NAME} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}> $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>)
  target_link_libraries(strata_${A_NAME} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
  target_compile_options(strata_${A_NAME} PRIVATE ${STRATA_WARNINGS})
  set_target_properties(strata_${A_NAME} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()

# strata_cc_test(NAME swap_store_test SRCS t.cc DEPS strata::io [LABELS uring])
function(strata_cc_test)
  cmake_parse_arguments(A "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT BUILD_TESTING)
    return()
  endif()
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_options(${A_NAME} PRIVATE ${STRATA_WARNINGS})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 600)
  endif()
  # One CTest entry per test case, so a GTEST_SKIP() shows as skipped, not passed.
  set(props TIMEOUT ${A_TIMEOUT} SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
  # Without LABELS a test carries the name of its folder (tests/engine -> `engine`), so that
  # `ctest -L` can pick folders (the tsan preset runs io, uring, cpu_optim and engine).
  if(NOT A_LABELS)
    get_filename_component(A_LABELS ${CMAKE_CURRENT_SOURCE_DIR} NAME)
  endif()
  list(APPEND props LABELS "${A_LABELS}")
  if("gpu" IN_LIST A_LABELS)
    if(NOT TARGET gpu_tests)
      add_custom_target(gpu_tests)  # every gpu-labelled test program: what scripts/gpu_session.sh builds
    endif()
    add_dependencies(gpu_tests ${A_NAME})
  endif()
  gtest_discover_tests(${A_NAME} DISCOVERY_TIMEOUT 120 PROPERTIES ${props})
endfunction()

# strata_cc_benchmark(NAME bench_cpu_optim SRCS b.cc DEPS strata::cpu_optim)
function(strata_cc_benchmark)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS" ${ARGN})
  if(NOT STRATA_BUILD_BENCHMARKS)
    return()
  endif()
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} benchmark::benchmark)
  target_compile_options(${A_NAME} PRIVATE ${STRATA_WARNINGS})
endfunction()

# strata_fuzz_target(NAME parse_size_fuzz SRCS f.cc DEPS strata::base)
# A libFuzzer executable (STRATA_BUILD_FUZZERS, clang), plus a CTest entry labelled `fuzz` that
# runs it for STRATA_FUZZ_SECONDS on a scratch copy of its committed seed corpus
# tests/fuzz/corpus/<NAME>/ (new inputs it finds are not written back into the source tree).
function(strata_fuzz_target)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS})
  target_compile_options(${A_NAME} PRIVATE ${STRATA_WARNINGS})
  target_link_options(${A_NAME} PRIVATE -fsanitize=fuzzer)
  if(NOT TARGET fuzzers)
    add_custom_target(fuzzers)  # what the `fuzz` build preset builds
  endif()
  add_dependencies(fuzzers ${A_NAME})
  set(corpus ${CMAKE_CURRENT_SOURCE_DIR}/corpus/${A_NAME})
  set(scratch ${CMAKE_CURRENT_BINARY_DIR}/corpus-${A_NAME})
  add_test(NAME ${A_NAME}
    COMMAND ${CMAKE_COMMAND} -E env ASAN_OPTIONS=detect_leaks=1
            ${CMAKE_COMMAND} -DFUZZER=$<TARGET_FILE:${A_NAME}> -DCORPUS=${corpus}
            -DSCRATCH=${scratch} -DSECONDS=${STRATA_FUZZ_SECONDS}
            -P ${PROJECT_SOURCE_DIR}/cmake/RunFuzzer.cmake)
  set_tests_properties(${A_NAME} PROPERTIES LABELS fuzz TIMEOUT 600)
endfunction()
