# unirl-train end to end on a checkpoint the hf_grpo example wrote (its recipe.json):
#   cmake -DTOOL=unirl-train -DRECIPE=<dir>/recipe.json -DWORK=<dir> -P unirl_train_test.cmake
# 1. 6 steps straight; 2. 4 steps, then the same command with steps=6 resumes at step 4 by itself;
# the two exports are byte-identical (resume bit for bit, data position included) and load back;
# 3. LoRA (lora.rank): merged export + PEFT adapter; 4. the SFT stage (sft.steps), then resumed;
# 5. errors: a bad recipe key, a bad JSONL record. The first run also writes samples.jsonl and report.html.
foreach(v TOOL RECIPE WORK)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "${v} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

function(run_tool out_var)
  execute_process(COMMAND "${TOOL}" --recipe "${RECIPE}" progress=false ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 600)
  set(${out_var} "${rc}\n${out}\n${err}" PARENT_SCOPE)
endfunction()

run_tool(a steps=6 out=${WORK}/straight checkpoint.every=2 checkpoint.keep=2)
if(NOT a MATCHES "^0\n" OR NOT a MATCHES "6 steps \\(from step 0\\)")
  message(FATAL_ERROR "straight run failed:\n${a}")
endif()
# The run report (docs/unirl-train.md) and its samples: steps 0 of 6 (samples_every 10), 4 samples.
file(STRINGS "${WORK}/straight/samples.jsonl" sample_lines)
list(LENGTH sample_lines n_samples)
file(READ "${WORK}/straight/report.html" report_html)
if(NOT n_samples EQUAL 4 OR NOT report_html MATCHES "id=\"unirl-data\"" OR NOT report_html MATCHES "\"completion\"")
  message(FATAL_ERROR "the run wrote ${n_samples} sample lines (expected 4) or a report without its samples")
endif()
file(GLOB kept "${WORK}/straight/checkpoints/step-*.pt")
list(LENGTH kept n_kept)
if(NOT n_kept EQUAL 2)
  message(FATAL_ERROR "checkpoint.keep=2 kept ${n_kept} checkpoints: ${kept}")
endif()

run_tool(b steps=4 out=${WORK}/resumed checkpoint.every=2)
run_tool(c steps=6 out=${WORK}/resumed checkpoint.every=2)
if(NOT b MATCHES "^0\n" OR NOT c MATCHES "^0\n" OR NOT c MATCHES "resumed from step-00000004.pt at step 4"
   OR NOT c MATCHES "2 steps \\(from step 4\\)")
  message(FATAL_ERROR "resumed run failed:\n${b}\n---\n${c}")
endif()
foreach(f config.json model.safetensors tokenizer.json)
  if(NOT EXISTS "${WORK}/straight/export/${f}")
    message(FATAL_ERROR "the export lacks ${f}")
  endif()
endforeach()
file(SHA256 "${WORK}/straight/export/model.safetensors" h1)
file(SHA256 "${WORK}/resumed/export/model.safetensors" h2)
if(NOT h1 STREQUAL h2)
  message(FATAL_ERROR "6 straight steps and 4 + 2 resumed steps exported different weights")
endif()
# The export is a model directory the tool itself loads (0 steps: evaluation and export only).
run_tool(d steps=0 model=${WORK}/straight/export out=${WORK}/reload checkpoint.resume=false)
if(NOT d MATCHES "^0\n")
  message(FATAL_ERROR "the export did not load back:\n${d}")
endif()

# LoRA (docs/lora.md): the export holds the merged model and the PEFT adapter, and loads back.
run_tool(l steps=2 out=${WORK}/lora lora.rank=4 lora.alpha=8 optim.lr=1e-3 checkpoint.every=1)
foreach(f model.safetensors adapter/adapter_config.json adapter/adapter_model.safetensors)
  if(NOT l MATCHES "^0\n" OR NOT EXISTS "${WORK}/lora/export/${f}")
    message(FATAL_ERROR "a LoRA run did not export ${f}:\n${l}")
  endif()
endforeach()
run_tool(m steps=0 model=${WORK}/lora/export out=${WORK}/lora_reload checkpoint.resume=false)
if(NOT m MATCHES "^0\n")
  message(FATAL_ERROR "the merged LoRA export did not load back:\n${m}")
endif()

# The supervised stage (docs/sft.md): sft.steps before RL, its metrics one line per step, its
# steps and accuracy in the summary; the same command again loads the finished stage (0 new steps).
run_tool(s steps=1 out=${WORK}/sft sft.steps=3 sft.batch_size=4)
file(STRINGS "${WORK}/sft/sft_metrics.jsonl" sft_lines)
list(LENGTH sft_lines n_sft)
file(READ "${WORK}/sft/summary.json" sft_summary)
if(NOT s MATCHES "^0\n" OR NOT n_sft EQUAL 3 OR NOT sft_summary MATCHES "\"sft_steps\": 3"
   OR sft_summary MATCHES "\"accuracy_after_sft\": -1")
  message(FATAL_ERROR "the SFT stage did not run 3 steps (${n_sft} metric lines):\n${s}\n${sft_summary}")
endif()
run_tool(t steps=1 out=${WORK}/sft sft.steps=3 sft.batch_size=4)
file(READ "${WORK}/sft/summary.json" sft_again)
# summary.json counts both invocations: 3 supervised steps in all, none run by the second.
if(NOT t MATCHES "^0\n" OR NOT sft_again MATCHES "\"sft_steps_run\": 0" OR NOT sft_again MATCHES "\"sft_steps\": 3")
  message(FATAL_ERROR "a finished SFT stage was trained again:\n${t}\n${sft_again}")
endif()

run_tool(e steps=1 out=${WORK}/bad optim.lrr=0.1)
if(e MATCHES "^0\n" OR NOT e MATCHES "optim.lrr")
  message(FATAL_ERROR "an unknown recipe key was not named:\n${e}")
endif()
run_tool(g steps=1 out=${WORK}/bad grpo.sampling.max_new_tokens=3)
if(g MATCHES "^0\n" OR NOT g MATCHES "grpo.sampling")
  message(FATAL_ERROR "a sampling option under grpo (ignored by the run) was not rejected:\n${g}")
endif()
file(WRITE "${WORK}/bad.jsonl" "{\"question\": \"1+1\", \"answer\": \"2\"}\n{\"question\": \"2+2\"}\n")
run_tool(f steps=1 out=${WORK}/bad data.path=${WORK}/bad.jsonl)
if(f MATCHES "^0\n" OR NOT f MATCHES "bad.jsonl:2" OR NOT f MATCHES "'answer'")
  message(FATAL_ERROR "a bad JSONL record was not named by line and field:\n${f}")
endif()
message(STATUS "unirl-train: straight, resumed (identical export), reload, LoRA, SFT stage, errors: ok")
