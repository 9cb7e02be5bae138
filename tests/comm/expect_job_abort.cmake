# Runs a command that must fail: cmake -DCOMMAND=<'|'-separated command line> -DEXPECT=<regex>
#   -DMAX_SECONDS=<n> -P expect_job_abort.cmake
# Passes when the command exits non-zero, its output (stdout and stderr) matches EXPECT, and it
# ended within MAX_SECONDS; prints the output either way.
string(REPLACE "|" ";" command "${COMMAND}")
string(TIMESTAMP start "%s" UTC)
execute_process(COMMAND ${command} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out
                TIMEOUT ${MAX_SECONDS})
string(TIMESTAMP end "%s" UTC)
math(EXPR seconds "${end} - ${start}")
message("${out}")
message("exit: ${rc}, ${seconds} s")
if(rc STREQUAL "0")
  message(FATAL_ERROR "the job exited 0; it should have been aborted")
endif()
if(NOT rc MATCHES "^[0-9]+$")
  message(FATAL_ERROR "the job did not exit by itself: ${rc}")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "the output has no line matching '${EXPECT}'")
endif()
