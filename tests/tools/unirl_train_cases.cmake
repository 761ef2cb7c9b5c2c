# unirl-train as a user meets it, on the checkpoint the hf_grpo example wrote (its recipe.json):
#   cmake -DTOOL=unirl-train -DRECIPE=<dir>/recipe.json -DWORK=<dir> -DCASE=<case> -P unirl_train_cases.cmake
# algorithms: every `algorithm` value runs a few steps (dapo also from a recipe, after an SFT stage);
# preflight:  over-long records of the train / eval / SFT data named by file:line before any work,
#             overlong=drop|truncate counted; every unknown key named at once;
# export:     an unwritable export_dir found before training; summary.json kept when the export fails;
# device:     a device that does not exist is one clean line naming the option;
# signal:     SIGINT / SIGTERM write a checkpoint and exit 130 / 143; resumes (also after kill -9)
#             keep one metrics row per step and a cumulative summary.json; a second signal exits now;
# help:       --help describes every settable key (type, allowed values) and hides fixed ones;
#             --print-recipe needs no model;
# format:     the export records its prompt format and a run on it uses that by default;
# greedy:     sampling.temperature = 0 is greedy: the same completions as top_k = 1;
# agents:     environment / tools names checked before any work (the known ones listed), a
#             multi-turn run trains with grpo, ppo and ppo with the KL in the reward (environment.name, tools),
#             checkpoints and resumes to the bytes of a straight run, and stops on SIGINT with a checkpoint;
# engine:     training rollouts go through the rollout engine by default (its figures in every
#             metrics row); sampling.engine=false is the static batch; greedy runs agree on both.
foreach(v TOOL RECIPE WORK CASE)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "${v} is not set")
  endif()
endforeach()
set(WORK "${WORK}/${CASE}")
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
find_program(SH sh REQUIRED)

# run(<var> args...): rc, stdout and stderr of one run, as "<rc>\n<stdout>\n<stderr>".
function(run out_var)
  execute_process(COMMAND "${TOOL}" --recipe "${RECIPE}" progress=false threads=1 ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
  set(${out_var} "${rc}\n${out}\n${err}" PARENT_SCOPE)
  set(${out_var}_err "${err}" PARENT_SCOPE)
endfunction()
# interrupt(OUT LOG CMD LOGFILE ROWS_FILE ROWS SIGNAL...), for the signal cases: runs the shell
# command CMD in the background (its output to LOGFILE), waits until ROWS_FILE has ROWS lines (60 s
# at most), sends each SIGNAL (0.3 s apart) and waits for it; OUT is "rc=<its exit status>", LOG
# its output.
function(interrupt out log cmd logfile rows_file rows)
  set(wait_rows "wait_rows() { i=0; while [ \"$(cat \"$1\" 2>/dev/null | wc -l)\" -lt \"$2\" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; }")
  set(kills "")
  foreach(sig ${ARGN})
    if(kills)
      string(APPEND kills " sleep 0.3;")
    endif()
    string(APPEND kills " kill -${sig} $pid;")
  endforeach()
  execute_process(COMMAND ${SH} -c "${wait_rows}; ${cmd} > ${logfile} 2>&1 & pid=$!; wait_rows ${rows_file} ${rows};${kills} wait $pid; echo rc=$?"
                  OUTPUT_VARIABLE o TIMEOUT 200)
  set(text "")
  if(EXISTS "${logfile}")
    file(READ "${logfile}" text)
  endif()
  set(${out} "${o}" PARENT_SCOPE)
  set(${log} "${text}" PARENT_SCOPE)
endfunction()
function(expect what)
  if(NOT (${ARGN}))
    message(FATAL_ERROR "${what}")
  endif()
endfunction()
# sft_term_resume(SUMMARY WHAT CMD DIR LOG): SIGTERM in a 400-step supervised stage exits 143 at
# supervised step k with its checkpoint and k metrics rows; the same command resumes at k and
# finishes the stage: 400 rows, summary.json's sft_steps 400 over both invocations (SUMMARY: its text).
function(sft_term_resume summary what cmd dir log)
  interrupt(o text "${cmd}" ${log} ${dir}/sft_metrics.jsonl 3 TERM)
  string(REGEX MATCH "at supervised step ([0-9]+)" _ "${text}")
  set(k "${CMAKE_MATCH_1}")
  file(GLOB ck "${dir}/sft/checkpoints/step-*.pt")
  expect("SIGTERM in the ${what} SFT stage: ${o}\n${text}\ncheckpoints: ${ck}" o MATCHES "rc=143" AND k MATCHES "^[0-9]+$"
         AND k LESS 400 AND ck MATCHES "step-0*${k}.pt")
  expect_steps("${dir}/sft_metrics.jsonl" ${k})
  execute_process(COMMAND ${SH} -c "${cmd}" RESULT_VARIABLE rc OUTPUT_VARIABLE o ERROR_VARIABLE e TIMEOUT 300)
  expect("the ${what} SFT resume failed:\n${o}\n${e}" rc EQUAL 0 AND o MATCHES "sft: resumed at step ${k}")
  expect_steps("${dir}/sft_metrics.jsonl" 400)
  file(READ "${dir}/summary.json" sj)
  string(JSON ss GET "${sj}" sft_steps)
  expect("${what} summary.json: sft_steps ${ss}, expected 400 over both invocations" ss EQUAL 400)
  set(${summary} "${sj}" PARENT_SCOPE)
endfunction()
function(count_lines out_var file)
  set(n 0)
  if(EXISTS "${file}")
    file(STRINGS "${file}" lines)
    list(LENGTH lines n)
  endif()
  set(${out_var} ${n} PARENT_SCOPE)
endfunction()
# The "step" values of a metrics file, in order, as a list.
function(metric_steps out_var file)
  file(STRINGS "${file}" lines)
  set(steps "")
  foreach(l IN LISTS lines)
    string(JSON s GET "${l}" step)
    list(APPEND steps ${s})
  endforeach()
  set(${out_var} "${steps}" PARENT_SCOPE)
endfunction()
function(expect_steps file n)
  metric_steps(got "${file}")
  set(want "")
  if(n GREATER 0)
    math(EXPR last "${n} - 1")
    foreach(i RANGE 0 ${last})
      list(APPEND want ${i})
    endforeach()
  endif()
  list(JOIN got "," got)
  list(JOIN want "," want)
  expect("${file}: steps [${got}], expected 0 .. ${n} - 1, each once" got STREQUAL want)
endfunction()
set(quick eval_data= export_dir=none)  # no held-out evaluation, no export: training only

if(CASE STREQUAL "algorithms")
  # The fixture's recipe states every grpo.* value (which would win over a preset): a user's recipe
  # without them, so that each algorithm name is its preset.
  file(READ "${RECIPE}" j)
  string(JSON j REMOVE "${j}" grpo)
  string(JSON j REMOVE "${j}" ppo)
  file(WRITE "${WORK}/user.json" "${j}")
  set(RECIPE "${WORK}/user.json")
  foreach(alg grpo dapo dr_grpo rloo reinforce_pp ppo)
    run(a algorithm=${alg} steps=2 out=${WORK}/${alg} ${quick})
    expect("algorithm=${alg} did not run 2 steps:\n${a}" a MATCHES "^0\n" AND a MATCHES "2 steps \\(from step 0\\)")
  endforeach()
  # dtype=bfloat16 loads and trains bf16 weights (the summary's recipe says so).
  run(bf steps=1 out=${WORK}/bf16 dtype=bfloat16 ${quick})
  expect("dtype=bfloat16 did not run:\n${bf}" bf MATCHES "^0\n" AND bf MATCHES "1 steps")
  file(READ "${WORK}/bf16/summary.json" sj)
  string(JSON wd GET "${sj}" weights_dtype)
  expect("dtype=bfloat16 loaded ${wd} weights" wd STREQUAL "BFloat16")
  file(READ "${WORK}/dapo/metrics.jsonl" m)
  expect("algorithm=dapo: no dynamic sampling (no dynamic_sampling metric)" m MATCHES "dynamic_sampling/kept_groups")
  # The README's command line (no recipe file), on the fixture's model and data.
  string(JSON model GET "${j}" model)
  string(JSON data GET "${j}" data path)
  execute_process(COMMAND "${TOOL}" model=${model} data.path=${data} data.prompt_key=question algorithm=dapo steps=3
                          sampling.max_new_tokens=6 out=${WORK}/readme progress=false
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
  expect("the README's unirl-train command failed:\n${rc}\n${out}\n${err}" rc EQUAL 0 AND out MATCHES "3 steps"
         AND EXISTS "${WORK}/readme/export/model.safetensors")
  # DAPO from a recipe of its own, after a supervised stage (the filter reward is the recipe's reward).
  string(JSON j SET "${j}" algorithm "\"dapo\"")
  string(JSON j SET "${j}" sft steps 2)
  string(JSON j SET "${j}" steps 2)
  file(WRITE "${WORK}/dapo.json" "${j}")
  execute_process(COMMAND "${TOOL}" --recipe "${WORK}/dapo.json" progress=false out=${WORK}/dapo_recipe ${quick}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
  expect("a DAPO recipe with an SFT stage failed:\n${rc}\n${out}\n${err}" rc EQUAL 0 AND out MATCHES "2 steps")
  file(READ "${WORK}/dapo_recipe/metrics.jsonl" m)
  expect("DAPO's dynamic sampling did not run (no dynamic_sampling metric)" m MATCHES "dynamic_sampling/kept_groups")

elseif(CASE STREQUAL "preflight")
  # Line 3 is ~200 tokens of ChatML: past the fixture's context (64) minus sampling.max_new_tokens (6).
  string(REPEAT "1+" 100 long)
  file(WRITE "${WORK}/long.jsonl"
       "{\"question\": \"1+1\", \"answer\": \"2\"}\n{\"question\": \"2+2\", \"answer\": \"4\"}\n{\"question\": \"${long}1\", \"answer\": \"101\"}\n{\"question\": \"3+3\", \"answer\": \"6\"}\n")
  run(a steps=2 out=${WORK}/a data.path=${WORK}/long.jsonl ${quick})
  expect("an over-long training record was not named by file:line, length, limit and recipe key:\n${a}"
         NOT a MATCHES "^0\n" AND a MATCHES "long.jsonl:3: the prompt is [0-9]+ tokens. the limit is 58"
         AND a MATCHES "sampling.max_new_tokens" AND NOT a MATCHES "algorithm.sampling")
  expect("pre-flight ran after training had started" NOT EXISTS "${WORK}/a/metrics.jsonl")
  run(b steps=2 out=${WORK}/b data.path=${WORK}/long.jsonl overlong=drop ${quick})
  expect("overlong=drop did not drop and count the record:\n${b}" b MATCHES "^0\n" AND b MATCHES "4 records, 1 over-long dropped")
  run(c steps=2 out=${WORK}/c data.path=${WORK}/long.jsonl overlong=truncate ${quick})
  expect("overlong=truncate did not truncate and count the record:\n${c}"
         c MATCHES "^0\n" AND c MATCHES "1 over-long truncated")
  # In the held-out data (and its name in the message), before the base model's evaluation.
  run(e steps=2 out=${WORK}/e eval_data=${WORK}/long.jsonl export_dir=none)
  expect("an over-long held-out record was not named:\n${e}" NOT e MATCHES "^0\n" AND e MATCHES "held-out data"
         AND e MATCHES "long.jsonl:3: the prompt is")
  # In the SFT data: prompt + answer against the context, before the supervised stage.
  string(REPEAT "7" 80 long_answer)
  file(WRITE "${WORK}/sft.jsonl" "{\"question\": \"1+1\", \"answer\": \"2\"}\n{\"question\": \"2+2\", \"answer\": \"${long_answer}\"}\n")
  run(s steps=1 out=${WORK}/s sft.steps=2 sft.data=${WORK}/sft.jsonl ${quick})
  expect("an over-long SFT record was not named:\n${s}" NOT s MATCHES "^0\n" AND s MATCHES "supervised data"
         AND s MATCHES "sft.jsonl:2: the prompt and its answer are [0-9]+ tokens .[0-9]+ . [0-9]+ with eos.. the model.s context is 64")
  expect("the SFT stage started before pre-flight" NOT EXISTS "${WORK}/s/sft_metrics.jsonl")
  # A damaged tokenizer file: the error names the model directory, not only the file's name.
  file(READ "${RECIPE}" j)
  string(JSON model GET "${j}" model)
  file(COPY "${model}/" DESTINATION "${WORK}/damaged_model")
  file(WRITE "${WORK}/damaged_model/tokenizer.json" "{\"model\": {\"type\": \"BPE\"")
  run(t steps=1 out=${WORK}/t model=${WORK}/damaged_model ${quick})
  expect("a damaged tokenizer.json: the error does not name its directory:\n${t}"
         NOT t MATCHES "^0\n" AND t MATCHES "damaged_model" AND t MATCHES "tokenizer.json")
  # Every unknown key at once, from the recipe file and the command line.
  file(READ "${RECIPE}" j)
  string(JSON j SET "${j}" optim lrr 0.1)
  string(JSON j SET "${j}" colour "\"red\"")
  file(WRITE "${WORK}/typos.json" "${j}")
  execute_process(COMMAND "${TOOL}" --recipe "${WORK}/typos.json" stepz=3 sampling.max_new_tokenz=4
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  expect("not every unknown key was named at once:\n${rc}\n${err}"
         NOT rc EQUAL 0 AND err MATCHES "4 unknown keys" AND err MATCHES "optim.lrr. did you mean optim.lr" AND err MATCHES "colour"
         AND err MATCHES "stepz. did you mean steps" AND err MATCHES "sampling.max_new_tokenz")

elseif(CASE STREQUAL "export")
  file(WRITE "${WORK}/a_file" "not a directory\n")
  run(a steps=2 out=${WORK}/a export_dir=${WORK}/a_file/export eval_data=)
  expect("an unwritable export_dir was not named before training:\n${a}"
         NOT a MATCHES "^0\n" AND a MATCHES "option 'export_dir'" AND a MATCHES "a_file/export")
  expect("the unwritable export_dir was found after training" NOT EXISTS "${WORK}/a/metrics.jsonl")
  # An export that fails after pre-flight (its weights file is taken by a directory): the run's
  # summary is still written, with the export's error.
  file(MAKE_DIRECTORY "${WORK}/taken/model.safetensors")
  run(b steps=2 out=${WORK}/b export_dir=${WORK}/taken eval_data=)
  expect("the export did not fail as arranged:\n${b}" NOT b MATCHES "^0\n")
  expect("no summary.json after a failed export:\n${b}" EXISTS "${WORK}/b/summary.json")
  file(READ "${WORK}/b/summary.json" sj)
  string(JSON steps GET "${sj}" steps)
  string(JSON why GET "${sj}" export_error)
  expect("summary.json after a failed export: steps ${steps}, export_error '${why}'" steps EQUAL 2 AND why MATCHES ".")

elseif(CASE STREQUAL "device")
  foreach(dev cuda:99 gpu cuda)
    run(a steps=1 out=${WORK}/d device=${dev} ${quick})
    if(dev STREQUAL "cuda" AND a MATCHES "^0\n")
      continue()  # a LibTorch with a GPU: cuda is a device here
    endif()
    string(STRIP "${a_err}" e)
    string(FIND "${e}" "\n" nl)
    expect("device=${dev}: not one clean line naming the option:\n${a}" NOT a MATCHES "^0\n" AND nl EQUAL -1
           AND e MATCHES "option 'device'" AND e MATCHES "available: cpu" AND NOT e MATCHES "frame #")
  endforeach()

elseif(CASE STREQUAL "signal")
  set(m "${WORK}/metrics.jsonl")
  set(cmd "\"${TOOL}\" --recipe \"${RECIPE}\" progress=false threads=1 out=${WORK} eval_data= export_dir=none")
  # 1. SIGINT mid-run: the step in flight finishes, a checkpoint of it, exit 130.
  interrupt(o io "${cmd} steps=100000" ${WORK}/int.out ${m} 3 INT)
  string(REGEX MATCH "at step ([0-9]+)" _ "${io}")
  set(n "${CMAKE_MATCH_1}")
  expect("SIGINT did not stop with exit 130 and a clear line:\n${o}\n${io}" o MATCHES "rc=130" AND n MATCHES "^[0-9]+$"
         AND io MATCHES "stopped by SIGINT at step [0-9]+. checkpoint .*step-0*${n}.pt")
  file(GLOB ck "${WORK}/checkpoints/step-*.pt")
  list(LENGTH ck nck)
  expect("SIGINT at step ${n}: checkpoints ${ck}" nck EQUAL 1 AND ck MATCHES "step-0*${n}.pt$")
  expect_steps("${m}" ${n})
  file(STRINGS "${m}" first_rows LIMIT_COUNT 1)
  string(JSON reward0 GET "${first_rows}" reward_mean)
  # 2. resume: exactly one row per step, and a summary of both invocations.
  math(EXPR n2 "${n} + 2")
  execute_process(COMMAND ${SH} -c "${cmd} steps=${n2}" RESULT_VARIABLE rc OUTPUT_VARIABLE o ERROR_VARIABLE e TIMEOUT 200)
  expect("the resume after SIGINT failed:\n${o}\n${e}" rc EQUAL 0 AND o MATCHES "resumed from step-0*${n}.pt at step ${n}")
  expect_steps("${m}" ${n2})
  file(READ "${WORK}/summary.json" sj)
  string(JSON st GET "${sj}" steps)
  string(JSON rf GET "${sj}" reward_first)
  string(JSON inv GET "${sj}" invocations)
  expect("summary.json not cumulative: steps ${st} (want ${n2}), reward_first ${rf} (want ${reward0}), invocations ${inv}"
         st EQUAL n2 AND rf EQUAL reward0 AND inv EQUAL 2)
  # 3. kill -9 with a checkpoint every step: the resume drops the rows after the checkpoint.
  math(EXPR n3 "${n2} + 100000")
  interrupt(o _ "${cmd} steps=${n3} checkpoint.every=1" ${WORK}/kill.out ${m} "$((${n2} + 3))" KILL)
  expect("kill -9: ${o}" o MATCHES "rc=137")
  # The killed run may have gone on for any number of steps after the rows were seen (a loaded
  # machine): the resume goes 3 steps past its newest checkpoint.
  file(GLOB cks "${WORK}/checkpoints/step-*.pt")
  set(c ${n2})
  foreach(f IN LISTS cks)
    if(f MATCHES "step-0*([0-9]+)\\.pt$" AND CMAKE_MATCH_1 GREATER c)
      set(c ${CMAKE_MATCH_1})
    endif()
  endforeach()
  math(EXPR n4 "${c} + 3")
  execute_process(COMMAND ${SH} -c "${cmd} steps=${n4} checkpoint.every=1" RESULT_VARIABLE rc OUTPUT_VARIABLE o ERROR_VARIABLE e TIMEOUT 200)
  expect("the resume after kill -9 failed:\n${o}\n${e}" rc EQUAL 0)
  expect_steps("${m}" ${n4})
  # 4. SIGTERM in the supervised stage: its checkpoint, exit 143; the resume finishes it with one row per step.
  set(w2 "${WORK}/sft_run")
  set(sft "\"${TOOL}\" --recipe \"${RECIPE}\" progress=false threads=1 out=${w2} eval_data= export_dir=none steps=1 sft.steps=400 sft.batch_size=2")
  sft_term_resume(_ "JSONL" "${sft}" ${w2} ${WORK}/term.out)
  # 5. two signals: the second exits at once (long steps: it arrives mid-step).
  interrupt(o tw "${cmd} out=${WORK}/twice steps=100000 prompts_per_step=64 group_size=64 sampling.max_new_tokens=50"
            ${WORK}/twice.out ${WORK}/twice/metrics.jsonl 1 INT INT)
  expect("a second SIGINT did not exit at once: ${o}\n${tw}" o MATCHES "rc=130" AND tw MATCHES "second signal: exiting now" AND NOT tw MATCHES "stopped by")

elseif(CASE STREQUAL "help")
  execute_process(COMMAND "${TOOL}" --help RESULT_VARIABLE rc OUTPUT_VARIABLE h ERROR_VARIABLE e TIMEOUT 60)
  expect("--help failed: ${e}" rc EQUAL 0)
  # Every key line is followed by its description line.
  string(REGEX MATCHALL "\n[a-z_.0-9]+ = " keys "${h}")
  string(REGEX MATCHALL "\n[a-z_.0-9]+ = [^\n]*\n    [^ \n]" described "${h}")
  list(LENGTH keys nk)
  list(LENGTH described nd)
  expect("--help: ${nd} of ${nk} keys have a description:\n${h}" nk GREATER 100 AND nd EQUAL nk)
  expect("--help lists keys that cannot be set" NOT h MATCHES "\ngrpo\\.sampling\\." AND NOT h MATCHES "\nppo\\.track\\.sampling\\.")
  expect("--help does not give the type and allowed values:\n${h}"
         h MATCHES "\nalgorithm = grpo  \\[grpo\\|dapo\\|dr_grpo\\|rloo\\|reinforce_pp\\|ppo\\]\n    [a-zA-Z]"
         AND h MATCHES "\nsampling.max_new_tokens = 32  \\[integer\\]\n    [a-zA-Z]"
         AND h MATCHES "\noverlong = error  \\[error\\|drop\\|truncate\\]")
  execute_process(COMMAND "${TOOL}" --print-recipe steps=3 RESULT_VARIABLE rc OUTPUT_VARIABLE p ERROR_VARIABLE e TIMEOUT 60)
  expect("--print-recipe without a model failed: ${e}" rc EQUAL 0 AND p MATCHES "\"steps\": 3")

elseif(CASE STREQUAL "format")
  # Trained with a format of its own (no chat template, a suffix); the export records it.
  run(a steps=1 out=${WORK}/a format=none "prompt_suffix==")
  expect("the training run failed:\n${a}" a MATCHES "^0\n")
  file(READ "${WORK}/a/export/unirl_prompt.json" pf)
  string(JSON f GET "${pf}" format)
  string(JSON suffix GET "${pf}" prompt_suffix)
  expect("the export recorded format '${f}', suffix '${suffix}'" f STREQUAL "none" AND suffix STREQUAL "=")
  file(READ "${WORK}/a/summary.json" sa)
  string(JSON acc_a GET "${sa}" accuracy_after)
  # A later run on the export with the default format (auto) uses the recorded one.
  run(b steps=0 model=${WORK}/a/export out=${WORK}/b format=auto checkpoint.resume=false export_dir=none)
  expect("the run on the export did not use the recorded format:\n${b}"
         b MATCHES "^0\n" AND b MATCHES "prompt format: none \\(recorded in")
  file(READ "${WORK}/b/summary.json" sb)
  string(JSON fb GET "${sb}" recipe format)
  string(JSON acc_b GET "${sb}" accuracy_before)
  expect("the export scored ${acc_b} under format ${fb}; the run recorded ${acc_a}" fb STREQUAL "none" AND acc_a EQUAL acc_b)

elseif(CASE STREQUAL "greedy")
  # The held-out evaluation is greedy (top_k = 1); training rollouts at temperature 0 are too: the
  # first step's rewards (same seed) equal those of top_k = 1, and every group has one completion.
  run(a steps=1 out=${WORK}/t0 ${quick} sampling.temperature=0)
  run(b steps=1 out=${WORK}/k1 ${quick} sampling.top_k=1)
  expect("sampling.temperature=0 was refused:\n${a}" a MATCHES "^0\n" AND b MATCHES "^0\n")
  file(STRINGS "${WORK}/t0/metrics.jsonl" ra)
  file(STRINGS "${WORK}/k1/metrics.jsonl" rb)
  foreach(k reward_mean reward_std reward_min reward_max)
    string(JSON va GET "${ra}" ${k})
    string(JSON vb GET "${rb}" ${k})
    expect("${k}: ${va} at temperature 0, ${vb} at top_k 1" va EQUAL vb)
  endforeach()
elseif(CASE STREQUAL "agents")
  # Names checked before any work: an unknown environment or tool lists the known ones; tools
  # without an environment, keys a multi-turn run does not read, and the tools' definitions that
  # leave the fixture's 64-token context no room for a turn are errors naming the key.
  set(agent environment.name=arithmetic environment.max_turns=2 environment.max_turn_tokens=8 ${quick})
  run(a steps=1 out=${WORK}/a environment.name=sokoban ${quick})
  expect("an unknown environment was not named with the known ones:\n${a}" NOT a MATCHES "^0\n"
         AND a MATCHES "environment.name.: unknown environment 'sokoban'. the built-in environments are arithmetic, guess_number")
  run(b steps=1 out=${WORK}/b ${agent} tools=calculator,browser)
  expect("an unknown tool was not named with the known ones:\n${b}" NOT b MATCHES "^0\n"
         AND b MATCHES "tools.: unknown tool 'browser'. the built-in tools are calculator")
  run(c steps=1 out=${WORK}/c tools=calculator ${quick})
  expect("tools without an environment were accepted:\n${c}" NOT c MATCHES "^0\n" AND c MATCHES "no environment.name is set")
  run(d steps=1 out=${WORK}/d ${agent} micro_batch_size=2)
  expect("a key a multi-turn run does not read was accepted:\n${d}" NOT d MATCHES "^0\n"
         AND d MATCHES "micro_batch_size.: is set, but a multi-turn run")
  run(e steps=1 out=${WORK}/e ${agent} tools=calculator)
  expect("a prompt past the context was not found in pre-flight:\n${e}" NOT e MATCHES "^0\n"
         AND e MATCHES "environment.max_episode_tokens.: the first prompt of the environment 'arithmetic' .task seed 0. is [0-9]+ tokens with the tools' definitions"
         AND e MATCHES "the model's context = 64")
  # The supervised stage reads demonstration conversations: a missing sft.data, a file that cannot
  # be read and a bad line (named by file:line) are found before any work.
  set(q "\"")
  file(WRITE "${WORK}/demos.jsonl"
       "{${q}messages${q}: [{${q}role${q}: ${q}user${q}, ${q}content${q}: ${q}What is 123*45?${q}}, {${q}role${q}: ${q}assistant${q}, ${q}content${q}: ${q}5535${q}}]}\n\n"
       "{${q}messages${q}: [{${q}role${q}: ${q}user${q}, ${q}content${q}: ${q}What is 200*11?${q}}, {${q}role${q}: ${q}assistant${q}, ${q}content${q}: ${q}2200${q}}]}\n")
  file(READ "${WORK}/demos.jsonl" good)
  file(WRITE "${WORK}/bad_demos.jsonl" "${good}{${q}messages${q}: [{${q}role${q}: ${q}robot${q}, ${q}content${q}: ${q}x${q}}]}\n")
  run(f steps=1 out=${WORK}/f ${agent} sft.steps=2)
  expect("sft.steps without sft.data was accepted:\n${f}" NOT f MATCHES "^0\n" AND f MATCHES "sft.data.: is empty, but sft.steps = 2")
  run(g steps=1 out=${WORK}/g ${agent} sft.steps=2 sft.data=${WORK}/none.jsonl)
  expect("a missing sft.data was accepted:\n${g}" NOT g MATCHES "^0\n" AND g MATCHES "sft.data.: cannot open")
  run(h steps=1 out=${WORK}/h ${agent} sft.steps=2 sft.data=${WORK}/bad_demos.jsonl)
  expect("a bad demonstration was not named by file:line:\n${h}" NOT h MATCHES "^0\n"
         AND h MATCHES "bad_demos.jsonl:4: demonstration: message 0 has role 'robot'")
  foreach(v a b c d e f g h)
    expect("pre-flight ran after work had started (${v})" NOT EXISTS "${WORK}/${v}/metrics.jsonl"
           AND NOT EXISTS "${WORK}/${v}/sft_metrics.jsonl")
  endforeach()
  # Demonstrations, then RL: one sft_metrics row per step with a falling loss, the stage's
  # checkpoint, the held-out return after it in summary.json.
  run(i steps=1 out=${WORK}/i ${agent} sft.steps=6 sft.batch_size=2 sft.optim.lr=1e-3 sft.data=${WORK}/demos.jsonl
      environment.heldout=2 group_size=2 prompts_per_step=1)
  expect("SFT then RL failed:\n${i}" i MATCHES "^0\n")
  expect_steps("${WORK}/i/sft_metrics.jsonl" 6)
  file(STRINGS "${WORK}/i/sft_metrics.jsonl" srows)
  list(GET srows 0 s0)
  list(GET srows 5 s5)
  string(JSON l0 GET "${s0}" loss)
  string(JSON l5 GET "${s5}" loss)
  expect("the supervised stage did not lower its loss: ${l0} -> ${l5}" l5 LESS l0)
  expect("no checkpoint of the supervised stage" EXISTS "${WORK}/i/sft/checkpoints/step-00000006.pt")
  file(READ "${WORK}/i/summary.json" sj)
  string(JSON ss GET "${sj}" sft_steps)
  string(JSON as GET "${sj}" accuracy_after_sft)
  expect("summary.json after SFT: sft_steps ${ss} (want 6), accuracy_after_sft ${as}" ss EQUAL 6 AND as GREATER_EQUAL 0)
  # SIGTERM in the supervised stage: its checkpoint, exit 143; the resume finishes the stage.
  set(sft "\"${TOOL}\" --recipe \"${RECIPE}\" progress=false threads=1 out=${WORK}/j export_dir=none eval_data= environment.name=arithmetic environment.max_turns=2 environment.max_turn_tokens=8 steps=1 group_size=2 prompts_per_step=1 sft.steps=400 sft.batch_size=2 sft.data=${WORK}/demos.jsonl")
  sft_term_resume(sj "multi-turn" "${sft}" ${WORK}/j ${WORK}/j.out)
  string(JSON ss GET "${sj}" sft_steps)
  string(JSON inv GET "${sj}" invocations)
  expect("summary.json: sft_steps ${ss}, invocations ${inv}; expected 400 and 2" ss EQUAL 400 AND inv EQUAL 2)
  # Both learners train from the command line: one metrics row per step, the rollout's and the
  # update's figures in it, the held-out mean return before and after in summary.json.
  # ppo_kl: PPO with a reference model and the KL in the token rewards before GAE.
  foreach(alg grpo ppo ppo_kl)
    set(learner algorithm=${alg})
    if(alg STREQUAL "ppo_kl")
      set(learner algorithm=ppo ppo.kl_coef=0.05 ppo.kl_in_reward=true)
    endif()
    run(r steps=2 out=${WORK}/${alg} ${learner} group_size=4 prompts_per_step=2 environment.heldout=4 ${agent})
    expect("algorithm=${alg} did not train a multi-turn agent:\n${r}" r MATCHES "^0\n"
           AND r MATCHES "2 steps .from step 0." AND r MATCHES "held-out mean return")
    expect_steps("${WORK}/${alg}/metrics.jsonl" 2)
    file(STRINGS "${WORK}/${alg}/metrics.jsonl" rows)
    list(GET rows 0 row)
    string(JSON episodes GET "${row}" "rollout/episodes")
    string(JSON turns GET "${row}" "rollout/turns_mean")
    string(JSON loss GET "${row}" loss)
    expect("${alg}: the row has ${episodes} episodes (expected 8)" episodes EQUAL 8)
    if(alg MATCHES "^ppo")
      string(JSON vl GET "${row}" value_loss)
      expect("ppo: the value loss in the metrics is ${vl}" vl MATCHES "^-?[0-9]")
      # The reference enters only with kl_coef > 0: after the first update the policy differs from it.
      list(GET rows 1 row2)
      string(JSON kl2 GET "${row2}" kl)
      if(alg STREQUAL "ppo_kl")
        expect("ppo_kl: the KL to the reference after an update is ${kl2}" NOT kl2 EQUAL 0)
      else()
        expect("ppo: the KL without a reference is ${kl2}" kl2 EQUAL 0)
      endif()
    endif()
    file(READ "${WORK}/${alg}/summary.json" sj)
    string(JSON before GET "${sj}" accuracy_before)
    string(JSON after GET "${sj}" accuracy_after)
    expect("${alg}: held-out return ${before} -> ${after}" before GREATER_EQUAL 0 AND after GREATER_EQUAL 0)
  endforeach()
  # Checkpoints of a multi-turn run: 2 steps, then the same command to 4 resumes from step 2 and
  # exports the bytes of a straight 4-step run (GRPO; PPO with its critic in the checkpoint); the
  # metrics keep one row per step and summary.json counts both invocations. The fixture's policy
  # wins no episode (every reward 0, so GRPO's advantages are 0): GRPO moves the weights by its
  # entropy bonus here, and the straight run's weights must differ from the base model's.
  get_filename_component(rdir "${RECIPE}" DIRECTORY)
  file(SHA256 "${rdir}/base/model.safetensors" h0)
  foreach(alg grpo ppo)
    set(common algorithm=${alg} grpo.ent_coef=0.01 group_size=4 prompts_per_step=2 environment.heldout=0 schedule.total_steps=20
               eval_data= environment.name=arithmetic environment.max_turns=2 environment.max_turn_tokens=8)
    run(s steps=4 out=${WORK}/${alg}_straight export_dir=${WORK}/${alg}_straight/export ${common})
    expect("${alg}: the straight 4-step run failed:\n${s}" s MATCHES "^0\n")
    run(p1 steps=2 out=${WORK}/${alg}_resumed export_dir=none ${common})
    expect("${alg}: the first 2 steps failed or left no checkpoint:\n${p1}"
           p1 MATCHES "^0\n" AND EXISTS "${WORK}/${alg}_resumed/checkpoints/step-00000002.pt")
    run(p2 steps=4 out=${WORK}/${alg}_resumed export_dir=${WORK}/${alg}_resumed/export ${common})
    expect("${alg}: the resume did not start at step 2:\n${p2}" p2 MATCHES "^0\n"
           AND p2 MATCHES "resumed from step-00000002.pt at step 2" AND p2 MATCHES "2 steps .from step 2.")
    expect_steps("${WORK}/${alg}_resumed/metrics.jsonl" 4)
    file(READ "${WORK}/${alg}_resumed/summary.json" sj)
    string(JSON st GET "${sj}" steps)
    string(JSON inv GET "${sj}" invocations)
    expect("${alg}: summary.json after the resume: steps ${st} (want 4), invocations ${inv} (want 2)" st EQUAL 4 AND inv EQUAL 2)
    file(GLOB wa "${WORK}/${alg}_straight/export/*.safetensors")
    file(GLOB wb "${WORK}/${alg}_resumed/export/*.safetensors")
    expect("${alg}: no exported weights (${wa} / ${wb})" wa AND wb)
    file(SHA256 "${wa}" ha)
    file(SHA256 "${wb}" hb)
    expect("${alg}: 4 steps left the base model's weights as they were" NOT ha STREQUAL h0)
    expect("${alg}: 2 + 2 resumed steps exported other weights than 4 straight ones" ha STREQUAL hb)
  endforeach()
  # SIGINT: the step in flight finishes, its checkpoint is written, exit 130 with the clear line.
  set(cmd "\"${TOOL}\" --recipe \"${RECIPE}\" progress=false threads=1 out=${WORK}/agent_int export_dir=none eval_data= environment.heldout=0 environment.name=arithmetic environment.max_turns=2 environment.max_turn_tokens=8 group_size=4 prompts_per_step=2")
  interrupt(o io "${cmd} steps=100000" ${WORK}/agent_int.out ${WORK}/agent_int/metrics.jsonl 2 INT)
  string(REGEX MATCH "at step ([0-9]+)" _ "${io}")
  set(n "${CMAKE_MATCH_1}")
  expect("SIGINT did not stop the multi-turn run with exit 130 and its checkpoint:\n${o}\n${io}" o MATCHES "rc=130"
         AND n MATCHES "^[0-9]+$" AND io MATCHES "stopped by SIGINT at step [0-9]+. checkpoint .*step-0*${n}.pt")
  expect_steps("${WORK}/agent_int/metrics.jsonl" ${n})
elseif(CASE STREQUAL "engine")
  # The recipe's Qwen2 decoder is a PagedCausalLM: the default samples through the rollout engine,
  # and every metrics row carries the engine's step count and peak KV bytes; engine=false draws
  # the static batch (no engine figures). Greedy (temperature 0) draws no random number, so both
  # train on the same completions: equal rewards at every step.
  execute_process(COMMAND "${TOOL}" --print-recipe RESULT_VARIABLE rc OUTPUT_VARIABLE p ERROR_VARIABLE e TIMEOUT 60)
  expect("--print-recipe: sampling.engine is not true by default:\n${p}${e}" rc EQUAL 0 AND p MATCHES "\"engine\": true")
  run(a steps=2 out=${WORK}/engine ${quick} sampling.temperature=0)
  run(b steps=2 out=${WORK}/static ${quick} sampling.temperature=0 sampling.engine=false)
  expect("a greedy run failed:\n${a}\n${b}" a MATCHES "^0\n" AND b MATCHES "^0\n")
  file(STRINGS "${WORK}/engine/metrics.jsonl" ra)
  file(STRINGS "${WORK}/static/metrics.jsonl" rb)
  list(LENGTH ra na)
  list(LENGTH rb nb)
  expect("metrics rows: ${na} on the engine, ${nb} static; expected 2 each" na EQUAL 2 AND nb EQUAL 2)
  foreach(i 0 1)
    list(GET ra ${i} la)
    list(GET rb ${i} lb)
    string(JSON steps ERROR_VARIABLE missing GET "${la}" "engine/steps")
    expect("step ${i} did not sample on the engine (no engine/steps): ${la}" NOT missing AND steps GREATER 0)
    string(JSON kv GET "${la}" "engine/peak_kv_bytes")
    expect("step ${i}: engine/peak_kv_bytes = ${kv}" kv GREATER 0)
    string(JSON none ERROR_VARIABLE absent GET "${lb}" "engine/steps")
    expect("step ${i} with sampling.engine=false reports engine figures: ${lb}" absent)
    foreach(k reward_mean reward_std reward_min reward_max)
      string(JSON va GET "${la}" ${k})
      string(JSON vb GET "${lb}" ${k})
      expect("step ${i} ${k}: ${va} on the engine, ${vb} static (greedy)" va EQUAL vb)
    endforeach()
  endforeach()
else()
  message(FATAL_ERROR "CASE = ${CASE}: expected algorithms, preflight, export, device, signal, help, format, greedy, agents or engine")
endif()
message(STATUS "unirl-train ${CASE}: ok")
