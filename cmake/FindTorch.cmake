# FindTorch — fallback for LibTorch installs that ship no CMake package (Debian's libtorch-dev).
#
# Config mode is tried first by the caller (official LibTorch, or the copy inside PyTorch:
# `-DTorch_DIR=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')/Torch`).
# This module looks for the headers and libraries in the system prefix and defines the same
# imported target `torch` that config mode defines, plus TORCH_LIBRARIES and Torch_VERSION.
#
# Compile definitions. LibTorch's own package puts the definitions of its build options on its
# targets' interface (USE_DISTRIBUTED, USE_C10D_GLOO, ... on torch_cpu); without them headers such
# as torch/csrc/distributed/c10d/ProcessGroupGloo.hpp compile to nothing, and
# unirl/parallel/data_parallel.hpp then fails to compile. A library without a CMake package does
# not record its options, so this module infers the two that unirl needs and puts them on `torch`:
#   USE_DISTRIBUTED  the c10d headers are installed (torch/csrc/distributed/c10d/ProcessGroup.hpp)
#                    and libtorch_cpu exports c10d's process group (symbol text "c10d12ProcessGroup");
#   USE_C10D_GLOO    additionally ProcessGroupGloo.hpp and Gloo's headers (gloo/config.h) are
#                    installed and libtorch_cpu exports c10d::ProcessGroupGloo;
#   USE_C10D_NCCL    a CUDA LibTorch (libtorch_cuda, Debian's libtorch-cuda-dev) whose
#                    libtorch_cuda exports c10d::ProcessGroupNCCL, with NCCL's nccl.h installed.
# They are cache variables (Torch_USE_DISTRIBUTED, Torch_USE_C10D_GLOO, Torch_USE_C10D_NCCL): set
# them to override. A CUDA LibTorch's libtorch_cuda and libc10_cuda are linked without
# --as-needed: they register the CUDA backend when loaded, and no symbol of theirs is named.
include(FindPackageHandleStandardArgs)

find_path(Torch_API_INCLUDE_DIR torch/torch.h PATH_SUFFIXES torch/csrc/api/include)
find_path(Torch_INCLUDE_DIR ATen/ATen.h)
find_library(Torch_LIBRARY torch)
find_library(Torch_CPU_LIBRARY torch_cpu)
find_library(Torch_C10_LIBRARY c10)
find_library(Torch_CUDA_LIBRARY torch_cuda)
find_library(Torch_C10_CUDA_LIBRARY c10_cuda)

if(Torch_API_INCLUDE_DIR AND EXISTS "${Torch_API_INCLUDE_DIR}/torch/version.h")
  file(STRINGS "${Torch_API_INCLUDE_DIR}/torch/version.h" _unirl_torch_ver
       REGEX "#define TORCH_VERSION_(MAJOR|MINOR|PATCH) [0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "TORCH_VERSION_${_part} ([0-9]+)" _m "${_unirl_torch_ver}")
    set(_unirl_torch_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(Torch_VERSION "${_unirl_torch_MAJOR}.${_unirl_torch_MINOR}.${_unirl_torch_PATCH}")
endif()

# Whether libtorch_cpu's (or the library `lib`'s) symbol table holds `text` (mangled names, read
# as strings).
function(_unirl_torch_exports text out)
  set(_found OFF)
  set(_lib "${Torch_CPU_LIBRARY}")
  if(ARGC GREATER 2)
    set(_lib "${ARGV2}")
  endif()
  if(_lib AND EXISTS "${_lib}")
    file(STRINGS "${_lib}" _hit REGEX "${text}" LIMIT_COUNT 1)
    if(_hit)
      set(_found ON)
    endif()
  endif()
  set(${out} ${_found} PARENT_SCOPE)
endfunction()
if(NOT DEFINED Torch_USE_DISTRIBUTED AND Torch_API_INCLUDE_DIR)
  set(_unirl_dist OFF)
  find_path(Torch_C10D_INCLUDE_DIR torch/csrc/distributed/c10d/ProcessGroup.hpp
            HINTS "${Torch_API_INCLUDE_DIR}/../../../.." "${Torch_INCLUDE_DIR}")
  if(Torch_C10D_INCLUDE_DIR)
    _unirl_torch_exports("c10d12ProcessGroup" _unirl_dist)
  endif()
  set(Torch_USE_DISTRIBUTED ${_unirl_dist} CACHE BOOL "LibTorch was built with USE_DISTRIBUTED (c10d)")
endif()
if(NOT DEFINED Torch_USE_C10D_GLOO AND Torch_API_INCLUDE_DIR)
  set(_unirl_gloo OFF)
  if(Torch_USE_DISTRIBUTED AND EXISTS "${Torch_C10D_INCLUDE_DIR}/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp")
    find_path(Torch_GLOO_INCLUDE_DIR gloo/config.h HINTS "${Torch_INCLUDE_DIR}")
    if(Torch_GLOO_INCLUDE_DIR)
      _unirl_torch_exports("c10d16ProcessGroupGloo" _unirl_gloo)
    endif()
  endif()
  set(Torch_USE_C10D_GLOO ${_unirl_gloo} CACHE BOOL "LibTorch was built with USE_C10D_GLOO (c10d's Gloo backend)")
endif()

if(NOT DEFINED Torch_USE_C10D_NCCL AND Torch_API_INCLUDE_DIR)
  set(_unirl_nccl OFF)
  if(Torch_USE_DISTRIBUTED AND Torch_CUDA_LIBRARY AND
     EXISTS "${Torch_C10D_INCLUDE_DIR}/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
    find_path(Torch_NCCL_INCLUDE_DIR nccl.h)
    if(Torch_NCCL_INCLUDE_DIR)
      _unirl_torch_exports("c10d16ProcessGroupNCCL" _unirl_nccl "${Torch_CUDA_LIBRARY}")
    endif()
  endif()
  set(Torch_USE_C10D_NCCL ${_unirl_nccl} CACHE BOOL "LibTorch was built with USE_C10D_NCCL (c10d's NCCL backend)")
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
  if(Torch_CUDA_LIBRARY AND Torch_C10_CUDA_LIBRARY)
    set_property(TARGET torch APPEND PROPERTY INTERFACE_LINK_LIBRARIES
                 "-Wl,--no-as-needed" "${Torch_CUDA_LIBRARY}" "${Torch_C10_CUDA_LIBRARY}")
  endif()
  set(_unirl_torch_defs)
  if(Torch_USE_DISTRIBUTED)
    list(APPEND _unirl_torch_defs USE_DISTRIBUTED)
  endif()
  if(Torch_USE_C10D_GLOO)
    list(APPEND _unirl_torch_defs USE_C10D_GLOO)
  endif()
  if(Torch_USE_C10D_NCCL)
    list(APPEND _unirl_torch_defs USE_C10D_NCCL)
  endif()
  if(_unirl_torch_defs)
    set_property(TARGET torch PROPERTY INTERFACE_COMPILE_DEFINITIONS "${_unirl_torch_defs}")
  endif()
  set(TORCH_LIBRARIES torch)
  set(TORCH_INCLUDE_DIRS "${Torch_INCLUDE_DIR};${Torch_API_INCLUDE_DIR}")
endif()
mark_as_advanced(Torch_API_INCLUDE_DIR Torch_INCLUDE_DIR Torch_LIBRARY Torch_CPU_LIBRARY Torch_C10_LIBRARY
                 Torch_C10D_INCLUDE_DIR Torch_GLOO_INCLUDE_DIR Torch_USE_DISTRIBUTED Torch_USE_C10D_GLOO)
