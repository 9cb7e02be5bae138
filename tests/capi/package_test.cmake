# cmake -DBUILD_DIR=<build> -DSOURCE_DIR=<this dir>/package -DEXAMPLE_DIR=<src>/examples/offload_mlp
#       -DWORK_DIR=<scratch> -DGENERATOR=Ninja [-DEXAMPLE_STEPS=60] -P package_test.cmake
# The installed CMake package, as a user sees it. Installs libstrata (capi/) and
# libstrata_engine with its C++ headers (package/) into WORK_DIR/prefix, then:
#   1. the exported targets carry no dependency a consumer would have to find (no third-party
#      target, no CUDA toolkit), and libstrata_engine.so exports strata's symbols only (with
#      -DNM=<nm>: C++ symbols of namespace strata, their typeinfo, vtables and thunks);
#   2. every installed header includes only installed headers or C/C++/POSIX system headers,
#      and compiles on its own (twice in one translation unit) against Strata::engine;
#   3. a C consumer of Strata::strata builds and runs (tests/capi/package/);
#   4. the example examples/offload_mlp builds against Strata::engine and trains with its
#      parameters and optimizer state on a scratch "NVMe" directory, which it leaves empty.
foreach(v BUILD_DIR SOURCE_DIR EXAMPLE_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "package_test.cmake: -D${v}=... is required")
  endif()
endforeach()
if(NOT DEFINED EXAMPLE_STEPS)
  set(EXAMPLE_STEPS 60)
endif()
file(REMOVE_RECURSE ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${BUILD_DIR}/capi --prefix ${prefix})
run(${CMAKE_COMMAND} --install ${BUILD_DIR}/package --prefix ${prefix})
set(configure_args -G ${GENERATOR} -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)

# 1. Nothing but the two libraries and their include directories in the exported targets.
file(GLOB targets_files ${prefix}/lib*/cmake/Strata/StrataTargets.cmake)
if(NOT targets_files)
  message(FATAL_ERROR "no StrataTargets.cmake under ${prefix}")
endif()
file(READ ${targets_files} targets)
foreach(forbidden INTERFACE_LINK_LIBRARIES INTERFACE_COMPILE_DEFINITIONS CUDA:: fmt:: spdlog::
                  TBB:: PkgConfig:: Eigen3:: nlohmann_json::)
  string(FIND "${targets}" "${forbidden}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "${targets_files} names ${forbidden}: consumers would need it")
  endif()
endforeach()
foreach(target Strata::strata Strata::engine)
  string(FIND "${targets}" "add_library(${target} SHARED IMPORTED)" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${targets_files} has no shared imported target ${target}")
  endif()
endforeach()

if(NM)
  file(GLOB engine_library ${prefix}/lib*/libstrata_engine.so)
  execute_process(COMMAND ${NM} -DC --defined-only ${engine_library}
                  OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR NOT symbols MATCHES "strata::engine::Engine::Create")
    message(FATAL_ERROR "${NM} -DC ${engine_library} failed (${rc}) or lists no Engine::Create")
  endif()
  if(NOT symbols MATCHES "strata::engine::OffloadOptimizer::Create")
    message(FATAL_ERROR "${engine_library} does not export OffloadOptimizer::Create (offload/)")
  endif()
  string(REPLACE "\n" ";" symbols "${symbols}")
  foreach(line IN LISTS symbols)
    # "<address> <type> <name>"; the name must be strata's.
    if(line MATCHES "^[0-9a-f]+ [A-Za-z] (.*)$" AND NOT CMAKE_MATCH_1 MATCHES
       "^((typeinfo|typeinfo name|vtable|VTT|guard variable) for |(non-)?virtual thunk to )?strata::")
      message(FATAL_ERROR "${engine_library} exports a symbol not of Strata: ${CMAKE_MATCH_1}")
    endif()
  endforeach()
endif()

# 2. The include closure of the installed headers, then each header on its own.
set(include_root ${prefix}/include/strata)
file(GLOB_RECURSE headers RELATIVE ${include_root} ${include_root}/*.h)
list(LENGTH headers num_headers)
if(num_headers LESS 10)
  message(FATAL_ERROR "only ${num_headers} headers installed under ${include_root}")
endif()
# The headers a user starts from, each in its folder (#include "offload/offload_optimizer.h").
foreach(header engine/engine.h engine/plan/plan_choice.h offload/offload_optimizer.h)
  list(FIND headers ${header} at)  # (a -P script has no IN_LIST: policy CMP0057 is unset)
  if(at EQUAL -1)
    message(FATAL_ERROR "${header} is not installed under ${include_root}")
  endif()
endforeach()
set(check_sources "")
foreach(header IN LISTS headers)
  file(STRINGS ${include_root}/${header} lines REGEX "^[ \t]*#[ \t]*include")
  foreach(line IN LISTS lines)
    if(line MATCHES "#[ \t]*include[ \t]*\"([^\"]+)\"")
      if(NOT EXISTS ${include_root}/${CMAKE_MATCH_1})
        message(FATAL_ERROR "${header} includes \"${CMAKE_MATCH_1}\", which is not installed")
      endif()
    elseif(line MATCHES "#[ \t]*include[ \t]*<([^>]+)>")
      # The C++ standard library (no extension), or the C and POSIX headers listed here.
      set(system ${CMAKE_MATCH_1})
      if(NOT system MATCHES "^[a-z_]+$" AND NOT system MATCHES
         "^(stddef|stdint|stdbool|stdio|stdlib|string|unistd|fcntl|errno|sys/[a-z_]+)\\.h$")
        message(FATAL_ERROR "${header} includes <${system}>, not a system header")
      endif()
    else()
      message(FATAL_ERROR "${header}: cannot read the include line '${line}'")
    endif()
  endforeach()
  string(MAKE_C_IDENTIFIER ${header} name)
  file(WRITE ${WORK_DIR}/headers/${name}.cc
       "#include \"${header}\"\n#include \"${header}\"  // include guard\n")
  list(APPEND check_sources ${name}.cc)
endforeach()
file(WRITE ${WORK_DIR}/headers/CMakeLists.txt "
cmake_minimum_required(VERSION 3.25)
project(StrataHeaderCheck LANGUAGES CXX)
find_package(Strata REQUIRED)
add_library(header_check OBJECT ${check_sources})
target_compile_features(header_check PRIVATE cxx_std_20)
target_compile_options(header_check PRIVATE -Wall -Wextra -Werror)
target_link_libraries(header_check PRIVATE Strata::engine)
")
run(${CMAKE_COMMAND} -S ${WORK_DIR}/headers -B ${WORK_DIR}/headers/build ${configure_args})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/headers/build)

# 3. The C consumer. It finds libstrata.so.0 through the RUNPATH CMake gives build trees.
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build ${configure_args})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)

# 4. The example, trained with its state on a scratch directory standing in for an NVMe drive.
run(${CMAKE_COMMAND} -S ${EXAMPLE_DIR} -B ${WORK_DIR}/example ${configure_args})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/example)
file(MAKE_DIRECTORY ${WORK_DIR}/nvme)
run(${WORK_DIR}/example/offload_mlp ${WORK_DIR}/nvme ${EXAMPLE_STEPS})
file(GLOB left ${WORK_DIR}/nvme/*)
if(left)
  message(FATAL_ERROR "offload_mlp left its swap files behind: ${left}")
endif()
