# headers.third_party_includes: every public header that names Boost.Hana, nlohmann::json or
# yaml-cpp includes that library's header itself. (headers.self_contained precompiles those
# three, so a header relying on another header to include them would pass that check.)
#   cmake -DINCLUDE_DIR=<include> -P third_party_includes.cmake
file(GLOB_RECURSE _headers ${INCLUDE_DIR}/unirl/*.hpp ${INCLUDE_DIR}/unirl/*.cuh)
set(_rules
  "boost::hana|BOOST_HANA_|hana::" "#include <boost/hana"
  "nlohmann::" "#include <nlohmann/json.hpp>"
  "YAML::" "#include <yaml-cpp/yaml.h>")
set(_bad 0)
set(_n 0)
foreach(_h ${_headers})
  file(READ ${_h} _text)
  # comments name the libraries too (usage examples): look at code lines only
  string(REGEX REPLACE "//[^\n]*" "" _code "${_text}")
  math(EXPR _n "${_n} + 1")
  set(_i 0)
  while(_i LESS 6)
    list(GET _rules ${_i} _use)
    math(EXPR _j "${_i} + 1")
    list(GET _rules ${_j} _inc)
    if(_code MATCHES "${_use}")
      string(FIND "${_text}" "${_inc}" _at)
      if(_at EQUAL -1)
        file(RELATIVE_PATH _rel ${INCLUDE_DIR} ${_h})
        message(SEND_ERROR "${_rel} uses what matches '${_use}' but does not itself write '${_inc}'")
        set(_bad 1)
      endif()
    endif()
    math(EXPR _i "${_i} + 2")
  endwhile()
endforeach()
if(_bad)
  message(FATAL_ERROR "headers.third_party_includes: headers above rely on another header for a third-party include")
endif()
message(STATUS "headers.third_party_includes: ${_n} headers checked")
