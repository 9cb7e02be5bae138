# cmake -DFUZZER=exe -DCORPUS=dir -DSCRATCH=dir -DSECONDS=n -P RunFuzzer.cmake
# Runs a libFuzzer target for SECONDS over a scratch copy of its seed corpus. Fails when the
# fuzzer reports a crash, a leak, a sanitizer error or a timeout (its exit code is non-zero).
file(REMOVE_RECURSE ${SCRATCH})
file(MAKE_DIRECTORY ${SCRATCH})
file(GLOB seeds ${CORPUS}/*)
if(NOT seeds)
  message(FATAL_ERROR "no seed corpus in ${CORPUS}")
endif()
file(COPY ${seeds} DESTINATION ${SCRATCH})
execute_process(
  COMMAND ${FUZZER} ${SCRATCH} -max_total_time=${SECONDS} -timeout=10 -rss_limit_mb=2048
          -print_final_stats=1 -artifact_prefix=${SCRATCH}/
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${FUZZER} failed (exit ${rc}); the reproducer is in ${SCRATCH}/")
endif()
