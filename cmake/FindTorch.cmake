# FindTorch — fallback for LibTorch installs that ship no CMake package (Debian's libtorch-dev).
#
# Config mode is tried first by the caller (official LibTorch, or the copy inside PyTorch:
# `-DTorch_DIR=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')/Torch`).
# This module looks for the headers and libraries in the system prefix and defines the same
# imported target `torch` that config mode defines, plus TORCH_LIBRARIES and Torch_VERSION.
include(FindPackageHandleStandardArgs)

find_path(Torch_API_INCLUDE_DIR torch/torch.h PATH_SUFFIXES torch/csrc/api/include)
find_path(Torch_INCLUDE_DIR ATen/ATen.h)
find_library(Torch_LIBRARY torch)
find_library(Torch_CPU_LIBRARY torch_cpu)
find_library(Torch_C10_LIBRARY c10)

if(Torch_API_INCLUDE_DIR AND EXISTS "${Torch_API_INCLUDE_DIR}/torch/version.h")
  file(STRINGS "${Torch_API_INCLUDE_DIR}/torch/version.h" _unirl_torch_ver
       REGEX "#define TORCH_VERSION_(MAJOR|MINOR|PATCH) [0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "TORCH_VERSION_${_part} ([0-9]+)" _m "${_unirl_torch_ver}")
    set(_unirl_torch_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(Torch_VERSION "${_unirl_torch_MAJOR}.${_unirl_torch_MINOR}.${_unirl_torch_PATCH}")
endif()

find_package_handle_standard_args(Torch
  REQUIRED_VARS Torch_LIBRARY Torch_CPU_LIBRARY Torch_C10_LIBRARY Torch_INCLUDE_DIR Torch_API_INCLUDE_DIR
  VERSION_VAR Torch_VERSION)

if(Torch_FOUND AND NOT TARGET torch)
  find_package(Threads REQUIRED)
  add_library(torch UNKNOWN IMPORTED)
  set_target_properties(torch PROPERTIES
    IMPORTED_LOCATION "${Torch_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${Torch_INCLUDE_DIR};${Torch_API_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES "${Torch_CPU_LIBRARY};${Torch_C10_LIBRARY};Threads::Threads")
  set(TORCH_LIBRARIES torch)
  set(TORCH_INCLUDE_DIRS "${Torch_INCLUDE_DIR};${Torch_API_INCLUDE_DIR}")
endif()
mark_as_advanced(Torch_API_INCLUDE_DIR Torch_INCLUDE_DIR Torch_LIBRARY Torch_CPU_LIBRARY Torch_C10_LIBRARY)
