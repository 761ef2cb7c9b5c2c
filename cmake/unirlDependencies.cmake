# Finds what unirl's headers need. Shared by the source tree and by the installed
# unirlConfig.cmake, so a consumer gets the same resolution as the project's own build.
# UNIRL_DEP_FIND is find_package (source tree) or find_dependency (installed package).
# CMake >= 3.30 (Debian 13) removed its FindBoost module (policy CMP0167); Boost's own
# BoostConfig.cmake (Boost >= 1.70) defines the same Boost::headers. Older CMake keeps FindBoost.
# Set before the macro below, which keeps the policies in force where it is defined.
if(POLICY CMP0167)
  cmake_policy(SET CMP0167 NEW)
endif()
if(NOT DEFINED UNIRL_DEP_FIND)
  set(UNIRL_DEP_FIND find_package)
endif()
macro(unirl_find_dep)
  if(UNIRL_DEP_FIND STREQUAL "find_dependency")
    find_dependency(${ARGN})
  else()
    find_package(${ARGN})
  endif()
endmacro()

# LibTorch: config mode first (official LibTorch, PyTorch's copy, or a distribution's package),
# then cmake/FindTorch.cmake for installs that ship none. UNIRL_USE_FIND_TORCH=ON skips config
# mode (the package tests use it to keep the fallback working).
option(UNIRL_USE_FIND_TORCH "Find LibTorch with unirl's FindTorch.cmake instead of its CMake package" OFF)
if(NOT TARGET torch)
  if(NOT UNIRL_USE_FIND_TORCH)
    find_package(Torch CONFIG QUIET)
  endif()
  if(NOT Torch_FOUND)
    list(PREPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")
    unirl_find_dep(Torch MODULE REQUIRED)
  endif()
endif()
if(DEFINED Torch_VERSION AND Torch_VERSION VERSION_LESS 1.13)
  message(FATAL_ERROR "unirl needs LibTorch >= 1.13, found ${Torch_VERSION}")
endif()

unirl_find_dep(Eigen3 3.3 REQUIRED NO_MODULE)
unirl_find_dep(Boost 1.74 REQUIRED)
unirl_find_dep(nlohmann_json 3.9 REQUIRED)
unirl_find_dep(Threads REQUIRED)

# yaml-cpp (optional; YAML recipes). 0.7 (Debian 12) exports the target `yaml-cpp`, 0.8 (Debian 13)
# only `yaml-cpp::yaml-cpp`: UNIRL_YAML_TARGET names whichever this one has. The installed
# package looks for yaml-cpp only if unirl was built with it (unirl_WITH_YAML, recorded by
# unirlConfig.cmake), and then requires it: its headers are compiled in with UNIRL_WITH_YAML.
if(UNIRL_DEP_FIND STREQUAL "find_dependency")
  if(unirl_WITH_YAML)
    find_dependency(yaml-cpp)
  endif()
else()
  find_package(yaml-cpp QUIET)
endif()
set(UNIRL_YAML_TARGET "")
if(TARGET yaml-cpp::yaml-cpp)
  set(UNIRL_YAML_TARGET yaml-cpp::yaml-cpp)
elseif(TARGET yaml-cpp)
  set(UNIRL_YAML_TARGET yaml-cpp)
endif()
find_path(UNIRL_STB_INCLUDE_DIR stb_image_write.h PATH_SUFFIXES stb)

# RE2 (required): linear-time, bounded-stack regular expressions for the rule rewards, which run
# on model-written text. Its CMake package where the install has one (re2::re2), else pkg-config
# (Debian 12's libre2-dev ships only re2.pc). Either way unirl::unirl links unirl::re2.
if(NOT TARGET unirl::re2)
  find_package(re2 CONFIG QUIET)
  if(NOT TARGET re2::re2)
    find_package(PkgConfig QUIET)
    if(PKG_CONFIG_FOUND)
      pkg_check_modules(UNIRL_RE2 QUIET IMPORTED_TARGET re2)
    endif()
  endif()
  if(TARGET re2::re2 OR TARGET PkgConfig::UNIRL_RE2)
    add_library(unirl::re2 INTERFACE IMPORTED)
    if(TARGET re2::re2)
      target_link_libraries(unirl::re2 INTERFACE re2::re2)
    else()
      target_link_libraries(unirl::re2 INTERFACE PkgConfig::UNIRL_RE2)
    endif()
  elseif(UNIRL_DEP_FIND STREQUAL "find_dependency")
    set(unirl_FOUND FALSE)
    set(unirl_NOT_FOUND_MESSAGE "unirl needs RE2 (a re2 CMake package or re2.pc for pkg-config; Debian: libre2-dev)")
    return()
  else()
    message(FATAL_ERROR "unirl needs RE2: found neither a re2 CMake package nor re2.pc for pkg-config "
                        "(Debian: apt-get install libre2-dev pkg-config)")
  endif()
endif()

# Catch2, for unirl's own tests only (tests/CMakeLists.txt calls this; a consumer never does).
# Debian 12 ships Catch2 2.13 (single header <catch2/catch.hpp>, target Catch2::Catch2, main
# from CATCH_CONFIG_MAIN), Debian 13 only Catch2 3 (compiled, <catch2/catch_all.hpp>, main in
# Catch2::Catch2WithMain). Sets UNIRL_CATCH2_MAJOR (2 or 3) and UNIRL_CATCH2_TARGET (the target
# that brings Catch2 and its main).
macro(unirl_find_catch2)
  find_package(Catch2 REQUIRED)
  if(Catch2_VERSION VERSION_LESS 2.13 OR NOT Catch2_VERSION VERSION_LESS 4)
    message(FATAL_ERROR "unirl's tests need Catch2 2.13+ or 3.x, found ${Catch2_VERSION}")
  endif()
  string(REGEX MATCH "^[0-9]+" UNIRL_CATCH2_MAJOR "${Catch2_VERSION}")
  if(UNIRL_CATCH2_MAJOR EQUAL 2)
    set(UNIRL_CATCH2_TARGET Catch2::Catch2)
  else()
    set(UNIRL_CATCH2_TARGET Catch2::Catch2WithMain)
  endif()
endmacro()
