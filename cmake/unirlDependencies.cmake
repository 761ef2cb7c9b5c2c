# Finds what unirl's headers need. Shared by the source tree and by the installed
# unirlConfig.cmake, so a consumer gets the same resolution as the project's own build.
# UNIRL_DEP_FIND is find_package (source tree) or find_dependency (installed package).
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
find_package(yaml-cpp QUIET)
find_path(UNIRL_STB_INCLUDE_DIR stb_image_write.h PATH_SUFFIXES stb)
