# Checks the include graph of include/unirl against the library's layers:
#   cmake [-DROOT=<dir holding unirl/>] -P check_layering.cmake
# Fails (exit code 1, one line per violation) when
#  1. a header includes a header of a higher layer, or of another folder of its own layer
#     (includes point only downward; folders of one layer never include each other);
#  2. a header under algorithms/ or rollout/ includes a concrete model, environment or reward
#     (models/, envs/, rewards/): they depend on the concepts (concepts/) only;
#  3. a concept is defined outside concepts/ (one bottom layer of concepts);
#  4. a folder is not in the declared order below (a new folder is placed deliberately).
# A folder is the first path component under unirl/ (models/hf/ is models); `top` stands for the
# headers directly in unirl/ (trainer.hpp and the umbrella headers), config.hpp for itself.
cmake_minimum_required(VERSION 3.20)

# The declared order, lowest layer first. Folders in one entry form one layer.
set(UNIRL_LAYERS
  "config.hpp detail"           # version and macros; not-API helpers
  "core"                        # errors, options reflection, statistics, step context, batch reflection
  "concepts"                    # every concept, with the small vocabulary types they name
  "exec"                        # execution policies
  "ops"                         # hot numerics
  "eval io tokenizers"          # metrics, file formats, tokenizers
  "rollout"                     # rollout batches, samplers, log-probs over a model concept
  "models"                      # model adapters and built-in networks
  "train"                       # optimizers, checkpoints, guards, metrics, supervised training
  "envs rewards data"           # environments, rewards, data sets
  "algorithms parallel joint"   # RL algorithms, parallelism strategies, compositions of trainers
  "agents"                      # multi-turn language agents: tools, trajectories, rollouts and GRPO over episodes
  "top"                         # trainer.hpp and the umbrella headers
  "recipes")                    # runnable recipes over everything
# algorithms/ and rollout/ never include these (concrete types): only their concepts.
set(UNIRL_CONCRETE models envs rewards)
set(UNIRL_CONCRETE_FREE algorithms rollout)
# Concepts still defined outside concepts/ ("file:Concept"), each to be moved.
set(UNIRL_CONCEPT_EXCEPTIONS)

if(NOT ROOT)
  set(ROOT "${CMAKE_CURRENT_LIST_DIR}/../../include")
endif()
get_filename_component(ROOT "${ROOT}" ABSOLUTE)
if(NOT IS_DIRECTORY "${ROOT}/unirl")
  message(FATAL_ERROR "layering: no unirl/ folder under '${ROOT}'")
endif()

set(_level 0)
foreach(_layer IN LISTS UNIRL_LAYERS)
  string(REPLACE " " ";" _units "${_layer}")
  foreach(_u IN LISTS _units)
    set(_level_of_${_u} ${_level})
  endforeach()
  math(EXPR _level "${_level} + 1")
endforeach()

function(_unit_of rel out)
  if(rel MATCHES "^([^/]+)/")
    set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
  elseif(rel STREQUAL "config.hpp")
    set(${out} "config.hpp" PARENT_SCOPE)
  else()
    set(${out} "top" PARENT_SCOPE)
  endif()
endfunction()

file(GLOB_RECURSE _files RELATIVE "${ROOT}/unirl" "${ROOT}/unirl/*.hpp" "${ROOT}/unirl/*.cuh" "${ROOT}/unirl/*.h")
list(SORT _files)
set(_violations 0)
set(_edges 0)
foreach(_f IN LISTS _files)
  _unit_of("${_f}" _from)
  if(NOT DEFINED _level_of_${_from})
    message(STATUS "layering: ${_f}: folder '${_from}' is not in the declared order (UNIRL_LAYERS in tests/layering/check_layering.cmake)")
    math(EXPR _violations "${_violations} + 1")
    continue()
  endif()
  file(STRINGS "${ROOT}/unirl/${_f}" _includes REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]unirl/[^>\"]+[>\"]")
  foreach(_line IN LISTS _includes)
    string(REGEX MATCH "[<\"]unirl/([^>\"]+)[>\"]" _m "${_line}")
    set(_target "${CMAKE_MATCH_1}")
    _unit_of("${_target}" _to)
    math(EXPR _edges "${_edges} + 1")
    if(_to STREQUAL _from)
      continue()
    endif()
    if(NOT DEFINED _level_of_${_to})
      message(STATUS "layering: ${_f} includes <unirl/${_target}>: folder '${_to}' is not in the declared order")
      math(EXPR _violations "${_violations} + 1")
      continue()
    endif()
    if(_from IN_LIST UNIRL_CONCRETE_FREE AND _to IN_LIST UNIRL_CONCRETE)
      message(STATUS "layering: ${_f} includes <unirl/${_target}>: ${_from}/ names no concrete model, environment or reward (${_to}/); include its concept from concepts/")
      math(EXPR _violations "${_violations} + 1")
    elseif(NOT _level_of_${_to} LESS _level_of_${_from})
      if(_level_of_${_to} EQUAL _level_of_${_from})
        set(_why "'${_to}' is another folder of the layer of '${_from}'")
      else()
        set(_why "'${_to}' is a higher layer than '${_from}'")
      endif()
      message(STATUS "layering: ${_f} includes <unirl/${_target}>: upward include: ${_why} (includes point only downward)")
      math(EXPR _violations "${_violations} + 1")
    endif()
  endforeach()
  if(NOT _from STREQUAL "concepts")
    file(STRINGS "${ROOT}/unirl/${_f}" _concepts
         REGEX "^[ \t]*(template[ \t]*<.*>[ \t]*)?concept[ \t]+[A-Za-z_][A-Za-z0-9_]*[ \t]*=")
    foreach(_line IN LISTS _concepts)
      if(_line MATCHES "concept[ \t]+([A-Za-z_][A-Za-z0-9_]*)[ \t]*=")
        set(_name "${CMAKE_MATCH_1}")
        if(NOT "${_f}:${_name}" IN_LIST UNIRL_CONCEPT_EXCEPTIONS)
          message(STATUS "layering: ${_f} defines concept ${_name} outside concepts/ (move it to a concepts/ header)")
          math(EXPR _violations "${_violations} + 1")
        endif()
      endif()
    endforeach()
  endif()
endforeach()

list(LENGTH _files _n)
if(_violations GREATER 0)
  message(FATAL_ERROR "layering: ${_violations} violation(s) in ${_n} headers (${_edges} includes)")
endif()
message(STATUS "layering: ${_n} headers, ${_edges} includes, all downward")
