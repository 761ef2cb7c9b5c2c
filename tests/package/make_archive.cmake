# Packs the library's sources (what a release archive holds) into ARCHIVE for the FetchContent
# consumer, and clears that consumer's previous build so it fetches this archive afresh.
file(REMOVE_RECURSE ${CLEAN_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} -E tar cf ${ARCHIVE} --format=gnutar CMakeLists.txt cmake include
                WORKING_DIRECTORY ${SOURCE_DIR} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "could not archive ${SOURCE_DIR}")
endif()
