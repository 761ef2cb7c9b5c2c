# Builds TARGET in BUILD_DIR; passes only if the build FAILS and its output matches EXPECT.
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but it must not")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "${TARGET} failed to compile, but the diagnostic does not name '${EXPECT}':\n${out}${err}")
endif()
message(STATUS "${TARGET} failed to compile as required, naming '${EXPECT}'")
