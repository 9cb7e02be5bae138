# cmake -DBUILD_DIR=<build>/capi -DSOURCE_DIR=<this dir>/package -DWORK_DIR=<scratch>
#       -DGENERATOR=Ninja -P package_test.cmake
# Installs libstrata (the capi/ install rules) into WORK_DIR/prefix, configures and
# builds the consumer project against it with find_package(Strata), and runs it.
foreach(v BUILD_DIR SOURCE_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "package_test.cmake: -D${v}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
# The consumer finds libstrata.so.0 through the RUNPATH CMake gives build trees.
run(${WORK_DIR}/build/consumer)
