# unirl-train-flow end to end on the tiny SD3 pipeline of tests/fixtures/diffusers:
#   cmake -DTOOL=unirl-train-flow -DMODEL=<tiny_sd3> -DWORK=<dir> -P unirl_train_flow_test.cmake
# 1. 4 Flow-GRPO steps (LoRA) straight: metrics, summary, report, the exported pipeline and LoRA;
# 2. 2 steps, then the same command with steps=4 resumes at step 2: the same exported weights;
# 3. the export is a pipeline the tool loads: its ODE samples score what the trained policy's did;
# 4. pre-flight: an unknown key, a missing folder, a config key unirl does not know, a bad image
#    size, too few prompts: each a clear error naming the key and the value, before any work;
# 5. --help lists the keys; --print-recipe needs no model.
foreach(v TOOL MODEL WORK)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "${v} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
file(WRITE "${WORK}/prompts.txt" "a photo of a cat\n\nA thick   SEVEN, 7!\nthe digit zero\n")
set(common prompts_file=${WORK}/prompts.txt prompts_per_step=2 group_size=2 flow_grpo.sampler.steps=3 lora.rank=2
           eval_samples=2 threads=1 progress=false)

function(run out_var)
  execute_process(COMMAND "${TOOL}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
  set(${out_var} "${rc}\n${out}\n${err}" PARENT_SCOPE)
endfunction()
function(expect what)
  if(NOT (${ARGN}))
    message(FATAL_ERROR "${what}")
  endif()
endfunction()
# The "step" values of a metrics file, joined with ",".
function(metric_steps out_var file)
  file(STRINGS "${file}" lines)
  set(steps "")
  foreach(l IN LISTS lines)
    string(JSON s GET "${l}" step)
    list(APPEND steps ${s})
  endforeach()
  list(JOIN steps "," steps)
  set(${out_var} "${steps}" PARENT_SCOPE)
endfunction()
# A reward printed with 6 decimals ("eval reward A -> B"), in millionths.
function(micro out_var text)
  string(REGEX MATCH "^(-?)([0-9]+)\\.([0-9][0-9][0-9][0-9][0-9][0-9])$" m "${text}")
  expect("not a reward with 6 decimals: '${text}'" m)
  math(EXPR v "${CMAKE_MATCH_2} * 1000000 + ${CMAKE_MATCH_3}")
  if(CMAKE_MATCH_1 STREQUAL "-")
    math(EXPR v "0 - ${v}")
  endif()
  set(${out_var} ${v} PARENT_SCOPE)
endfunction()

# 1. Straight.
run(a model=${MODEL} ${common} steps=4 checkpoint.every=2 out=${WORK}/straight)
expect("the straight run failed:\n${a}" a MATCHES "^0\n" AND a MATCHES "4 steps \\(from step 0\\)"
       AND a MATCHES "1 text-encoder batches")
metric_steps(s "${WORK}/straight/metrics.jsonl")
expect("straight metrics steps [${s}], expected 0,1,2,3" s STREQUAL "0,1,2,3")
foreach(f summary.json report.html export/model_index.json export/transformer/diffusion_pytorch_model.safetensors
          export/vae/config.json export/tokenizer/vocab.json export/scheduler/scheduler_config.json
          export/lora/pytorch_lora_weights.safetensors export/lora/adapter_config.json)
  expect("the straight run wrote no ${f}" EXISTS "${WORK}/straight/${f}")
endforeach()
file(READ "${WORK}/straight/summary.json" sj)
string(JSON steps GET "${sj}" steps)
string(JSON lr GET "${sj}" recipe lora rank)
expect("summary.json: steps ${steps}, lora.rank ${lr}" steps EQUAL 4 AND lr EQUAL 2)
file(READ "${WORK}/straight/export/lora/pytorch_lora_weights.safetensors" head OFFSET 8 LIMIT 400)
expect("the exported LoRA lacks diffusers' names" head MATCHES "transformer\\.transformer_blocks\\.[0-9]+\\.attn\\.[a-z_]+\\.lora_[AB]\\.weight")
string(REGEX MATCH "eval reward (-?[0-9.]+) -> (-?[0-9.]+)" m "${a}")
expect("no eval rewards printed:\n${a}" m)
set(trained "${CMAKE_MATCH_2}")

# 2. Resumed: 2 steps, then the same command to 4.
run(b model=${MODEL} ${common} steps=2 checkpoint.every=2 out=${WORK}/resumed)
run(c model=${MODEL} ${common} steps=4 checkpoint.every=2 out=${WORK}/resumed)
expect("the resumed run failed:\n${b}\n---\n${c}" b MATCHES "^0\n" AND c MATCHES "^0\n"
       AND c MATCHES "resumed from step-00000002.pt at step 2" AND c MATCHES "2 steps \\(from step 2\\)")
metric_steps(s "${WORK}/resumed/metrics.jsonl")
expect("resumed metrics steps [${s}], expected 0,1,2,3" s STREQUAL "0,1,2,3")
foreach(f transformer/diffusion_pytorch_model.safetensors lora/pytorch_lora_weights.safetensors)
  file(SHA256 "${WORK}/straight/export/${f}" h1)
  file(SHA256 "${WORK}/resumed/export/${f}" h2)
  expect("4 straight steps and 2 + 2 resumed steps exported different ${f}" h1 STREQUAL h2)
endforeach()
file(READ "${WORK}/resumed/summary.json" sj)
string(JSON inv GET "${sj}" invocations)
expect("the resumed summary counts ${inv} invocations, expected 2" inv EQUAL 2)

# 3. The exported pipeline (LoRA merged) loads; its ODE samples from the same fixed noise score
# what the trained policy's scored (within 1e-4: W + BA merged against applied separately).
run(d model=${WORK}/straight/export ${common} lora.rank=0 steps=0 export_dir=none out=${WORK}/reload)
string(REGEX MATCH "eval reward (-?[0-9.]+) -> " m "${d}")
expect("the export did not load back:\n${d}" d MATCHES "^0\n" AND m)
micro(x "${CMAKE_MATCH_1}")
micro(y "${trained}")
math(EXPR diff "${x} - ${y}")
expect("the exported pipeline scores ${CMAKE_MATCH_1}, the trained policy ${trained}" diff LESS_EQUAL 100
       AND diff GREATER_EQUAL -100)

# 4. Pre-flight.
run(e model=${MODEL} ${common} stepz=3 out=${WORK}/e)
expect("an unknown key was not named:\n${e}" NOT e MATCHES "^0\n" AND e MATCHES "stepz")
run(f model=${WORK}/no_such_pipeline ${common} out=${WORK}/f)
expect("a missing folder was not named with its key:\n${f}"
       NOT f MATCHES "^0\n" AND f MATCHES "option 'model'" AND f MATCHES "no_such_pipeline")
file(COPY "${MODEL}/" DESTINATION "${WORK}/bad_pipeline")
file(READ "${WORK}/bad_pipeline/transformer/config.json" cj)
string(JSON cj SET "${cj}" use_magic true)
file(WRITE "${WORK}/bad_pipeline/transformer/config.json" "${cj}")
run(g model=${WORK}/bad_pipeline ${common} out=${WORK}/g)
expect("an unknown config key of the pipeline was not named:\n${g}"
       NOT g MATCHES "^0\n" AND g MATCHES "option 'model'" AND g MATCHES "'use_magic'" AND g MATCHES "config.json")
run(h model=${MODEL} ${common} height=15 out=${WORK}/h)
expect("a bad height was not named:\n${h}" NOT h MATCHES "^0\n" AND h MATCHES "option 'height': value 15")
run(i model=${MODEL} ${common} prompts_per_step=4 out=${WORK}/i)
expect("too few prompts were not named:\n${i}" NOT i MATCHES "^0\n" AND i MATCHES "option 'prompts_per_step'")
file(WRITE "${WORK}/empty.txt" "\n\n")
run(j model=${MODEL} ${common} prompts_file=${WORK}/empty.txt out=${WORK}/j)
expect("an empty prompts file was not named:\n${j}" NOT j MATCHES "^0\n" AND j MATCHES "option 'prompts'"
       AND j MATCHES "empty.txt")
foreach(x f g h i j)
  expect("pre-flight case ${x} ran work (it wrote ${WORK}/${x}/metrics.jsonl)" NOT EXISTS "${WORK}/${x}/metrics.jsonl")
endforeach()
expect("a bad pipeline folder created the run directory" NOT EXISTS "${WORK}/g")

# 5. --help and --print-recipe.
run(k --help)
expect("--help does not list the keys:\n${k}" k MATCHES "^0\n" AND k MATCHES "flow_grpo.sampler.steps"
       AND k MATCHES "reward.brightness" AND k MATCHES "prompts_file")
run(l --print-recipe steps=7)
expect("--print-recipe failed:\n${l}" l MATCHES "^0\n" AND l MATCHES "\"steps\": 7")
