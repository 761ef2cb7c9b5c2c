# The layering check must catch each kind of violation: runs it over violations/ (a small tree
# with one of each) and requires a failure that names every one of them, and nothing else.
#   cmake -DCHECK=check_layering.cmake -P expect_violations.cmake
execute_process(COMMAND ${CMAKE_COMMAND} -DROOT=${CMAKE_CURRENT_LIST_DIR}/violations -P ${CHECK}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "the layering check passed a tree with violations:\n${all}")
endif()
set(expected
  "core/context.hpp includes <unirl/concepts/model.hpp>: upward include: 'concepts' is a higher layer"
  "algorithms/ppo_env.hpp includes <unirl/envs/cartpole.hpp>: algorithms/ names no concrete"
  "algorithms/grpo.hpp includes <unirl/models/gpt.hpp>: algorithms/ names no concrete"
  "rollout/token_sampler.hpp includes <unirl/models/gpt.hpp>: rollout/ names no concrete"
  "rewards/scorer.hpp defines concept HasScores outside concepts/"
  "envs/cartpole.hpp includes <unirl/data/jsonl.hpp>: upward include: 'data' is another folder of the layer of 'envs'"
  "widgets/knob.hpp: folder 'widgets' is not in the declared order"
  # the folders added since: a subfolder is its folder, io / tokenizers / data / train / recipes in their layers
  "models/hf/causal_lm.hpp includes <unirl/algorithms/grpo.hpp>: upward include: 'algorithms' is a higher layer than 'models'"
  "io/safetensors.hpp includes <unirl/tokenizers/bpe.hpp>: upward include: 'tokenizers' is another folder of the layer of 'io'"
  "tokenizers/bpe.hpp includes <unirl/data/jsonl.hpp>: upward include: 'data' is a higher layer than 'tokenizers'"
  "train/sft.hpp includes <unirl/recipes/token_recipe.hpp>: upward include: 'recipes' is a higher layer than 'train'"
  "algorithms/token_common.hpp includes <unirl/models/hf/causal_lm.hpp>: algorithms/ names no concrete"
  "12 violation(s) in 16 headers")
foreach(e IN LISTS expected)
  string(FIND "${all}" "${e}" pos)
  if(pos EQUAL -1)
    message(FATAL_ERROR "the layering check did not report: ${e}\nits output:\n${all}")
  endif()
endforeach()
message(STATUS "layering check: all 12 planted violations reported")
