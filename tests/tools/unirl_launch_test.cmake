# unirl-launch (tools/unirl_launch/main.cpp) with tiny shell programs:
#   cmake -DTOOL=unirl-launch -DCASE=env|failure|signal|args|servers [-DSERVER=reward_server] -P unirl_launch_test.cmake
# env:     every process gets torchrun's variables (one node: a free port shared by all; node 1 of
#          2: ranks 2..3 of 4, the given address and port) and --tag-output prefixes its lines;
# failure: a rank exiting with 3 makes the launcher exit 3 naming the rank, and stop the others
#          (one ignores SIGTERM: SIGKILL after --grace) in bounded time;
# signal:  SIGTERM to the launcher reaches every process; one that ignores it is SIGKILLed after
#          --grace; a second signal SIGKILLs them at once;
# servers: two example reward servers (examples/30_reward_server, SERVER) under the launcher:
#          SIGTERM stops both cleanly (each exits 0 and says so) in bounded time;
# args:    bad arguments are errors (exit 2) that name the bad value.
foreach(v TOOL CASE)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "${v} is not set")
  endif()
endforeach()
find_program(SH sh REQUIRED)

# (in a function, after execute_process(... rc out err) started at t0: <var>_rc, _out, _err and
# _secs, the wall time, in the caller)
macro(return_run out_var)
  string(TIMESTAMP t1 "%s")
  math(EXPR secs "${t1} - ${t0}")
  set(${out_var}_rc "${rc}" PARENT_SCOPE)
  set(${out_var}_out "${out}" PARENT_SCOPE)
  set(${out_var}_err "${err}" PARENT_SCOPE)
  set(${out_var}_secs "${secs}" PARENT_SCOPE)
endmacro()

function(launch out_var)
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND "${TOOL}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  return_run(${out_var})
endfunction()

# run_sh(<var> <script>): runs the shell script (semicolons and all), as launch() sets <var>_*.
function(run_sh out_var script)
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND ${SH} -c "${script}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  return_run(${out_var})
endfunction()

# expect(<message> <condition...>): fails with the message unless the if() condition holds.
macro(expect what)
  if(NOT (${ARGN}))
    message(FATAL_ERROR "${what}")
  endif()
endmacro()

# (no semicolons in these shell programs: CMake would split the argument there)
set(print_env [=[echo "R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE LW=$LOCAL_WORLD_SIZE G=$GROUP_RANK A=$MASTER_ADDR P=$MASTER_PORT"
echo "to stderr $RANK" >&2]=])

if(CASE STREQUAL "env")
  launch(a --nproc 3 --tag-output -- ${SH} -c "${print_env}")
  set(all "rc ${a_rc}\nstdout:\n${a_out}\nstderr:\n${a_err}")
  expect("one node, 3 processes: ${all}" a_rc EQUAL 0)
  string(REGEX MATCH "\\[rank 0\\] R=0 L=0 W=3 LW=3 G=0 A=127\\.0\\.0\\.1 P=([0-9]+)\n" m0 "${a_out}")
  expect("rank 0's variables: ${all}" m0)
  set(port "${CMAKE_MATCH_1}")
  expect("a free port was picked (not 0): ${all}" port GREATER 0)
  foreach(r 1 2)
    string(FIND "${a_out}" "[rank ${r}] R=${r} L=${r} W=3 LW=3 G=0 A=127.0.0.1 P=${port}\n" at)
    expect("rank ${r}'s variables (the same port ${port}): ${all}" NOT at EQUAL -1)
  endforeach()
  foreach(r 0 1 2)
    string(FIND "${a_err}" "[rank ${r}] to stderr ${r}\n" at)
    expect("rank ${r}'s stderr line, tagged: ${all}" NOT at EQUAL -1)
  endforeach()

  launch(b --nproc 2 --node-rank 1 --nnodes 2 --master-addr 10.1.2.3 --master-port 29555 -- ${SH} -c "${print_env}")
  set(all "rc ${b_rc}\nstdout:\n${b_out}\nstderr:\n${b_err}")
  expect("node 1 of 2: ${all}" b_rc EQUAL 0)
  foreach(l 0 1)
    math(EXPR r "2 + ${l}")
    string(FIND "${b_out}" "R=${r} L=${l} W=4 LW=2 G=1 A=10.1.2.3 P=29555\n" at)
    expect("node 1 of 2, local rank ${l}: ${all}" NOT at EQUAL -1)
  endforeach()
  string(FIND "${b_out}" "[rank" at)
  expect("untagged without --tag-output: ${all}" at EQUAL -1)

elseif(CASE STREQUAL "failure")
  # rank 1 fails at once; rank 0 sleeps; rank 2 ignores SIGTERM (SIGKILL after the 1 s grace)
  launch(c --nproc 3 --grace 1 -- ${SH} -c
         [=[test "$RANK" = 1 && exit 3
test "$RANK" = 2 && trap "" TERM
sleep 30
echo "rank $RANK slept"]=])
  set(all "rc ${c_rc} after ${c_secs} s\nstdout:\n${c_out}\nstderr:\n${c_err}")
  expect("the failing rank's status: ${all}" c_rc EQUAL 3)
  expect("the others stopped in bounded time (grace 1 s): ${all}" c_secs LESS 10)
  expect("the message names the rank and its status: ${all}" c_err MATCHES "rank 1 .pid [0-9]+. exited with status 3. stopping the other 2 processes")
  expect("the rank that ignores SIGTERM is killed after the grace: ${all}" c_err MATCHES "rank 2 .pid [0-9]+. still runs after 1 s: SIGKILL")
  string(FIND "${c_out}" "slept" at)
  expect("no process ran to its end: ${all}" at EQUAL -1)
  # a process killed by a signal: 128 + the signal
  launch(d --nproc 2 -- ${SH} -c [=[test "$RANK" = 0 && kill -KILL $$
sleep 30]=])
  set(all "rc ${d_rc} after ${d_secs} s\nstderr:\n${d_err}")
  expect("a rank killed by SIGKILL: 128 + 9: ${all}" d_rc EQUAL 137)
  expect("the message names the signal: ${all}" d_err MATCHES "rank 0 .pid [0-9]+. was killed by signal 9")
  expect("bounded: ${all}" d_secs LESS 10)

elseif(CASE STREQUAL "signal")
  run_sh(s "\"${TOOL}\" --nproc 2 --tag-output -- ${SH} -c 'trap \"echo got TERM \$RANK; exit 7\" TERM; sleep 30 & wait' & pid=$!; sleep 1; kill -TERM $pid; wait $pid")
  set(all "rc ${s_rc}\nstdout:\n${s_out}\nstderr:\n${s_err}")
  expect("the launcher exits with 128 + SIGTERM: ${all}" s_rc EQUAL 143)
  foreach(r 0 1)
    string(FIND "${s_out}" "[rank ${r}] got TERM ${r}" at)
    expect("rank ${r} got the forwarded SIGTERM: ${all}" NOT at EQUAL -1)
    expect("how rank ${r} ended is printed: ${all}" s_err MATCHES "rank ${r} .pid [0-9]+. exited with status 7")
  endforeach()

  # rank 1 ignores SIGTERM: SIGKILL after the 1 s grace, not before, and not the 30 s sleep
  run_sh(g "\"${TOOL}\" --nproc 2 --grace 1 -- ${SH} -c 'test \"\$RANK\" = 1 && trap \"\" TERM; sleep 30 & wait' & pid=$!; sleep 1; kill -TERM $pid; wait $pid")
  set(all "rc ${g_rc} after ${g_secs} s\nstderr:\n${g_err}")
  expect("the launcher exits with 128 + SIGTERM: ${all}" g_rc EQUAL 143)
  expect("the rank that ignores SIGTERM is killed after the grace: ${all}" g_err MATCHES "rank 1 .pid [0-9]+. still runs after 1 s: SIGKILL")
  expect("and its end is printed: ${all}" g_err MATCHES "rank 1 .pid [0-9]+. was killed by signal 9")
  expect("bounded: ${all}" g_secs LESS 10)

  # a second signal: SIGKILL at once, long before the 30 s grace
  run_sh(k "\"${TOOL}\" --nproc 2 --grace 30 -- ${SH} -c 'trap \"\" TERM; sleep 30 & wait' & pid=$!; sleep 1; kill -TERM $pid; sleep 0.5; kill -INT $pid; wait $pid")
  set(all "rc ${k_rc} after ${k_secs} s\nstderr:\n${k_err}")
  expect("the first signal's status: ${all}" k_rc EQUAL 143)
  expect("the second signal is said: ${all}" k_err MATCHES "second signal 2 .Interrupt.: SIGKILL to the processes")
  foreach(r 0 1)
    expect("rank ${r} killed: ${all}" k_err MATCHES "rank ${r} .pid [0-9]+. was killed by signal 9")
  endforeach()
  expect("at once (not after the 30 s grace): ${all}" k_secs LESS 8)

elseif(CASE STREQUAL "servers")
  if(NOT DEFINED SERVER)
    message(FATAL_ERROR "SERVER is not set (the reward_server example)")
  endif()
  # Both servers start (each prints its URL), then SIGTERM to the launcher: each stops cleanly.
  run_sh(v "d=$(mktemp -d); \"${TOOL}\" --nproc 2 --tag-output --grace 20 -- \"${SERVER}\" server.port=0 > $d/out 2> $d/err & pid=$!; n=0; while [ $n -lt 600 ] && [ $(grep -c 'reward server listening' $d/out) -lt 2 ]; do sleep 0.1; n=$((n+1)); done; kill -TERM $pid; wait $pid; rc=$?; cat $d/out; cat $d/err >&2; rm -r $d; exit $rc")
  set(all "rc ${v_rc} after ${v_secs} s\nstdout:\n${v_out}\nstderr:\n${v_err}")
  expect("the launcher exits with 128 + SIGTERM: ${all}" v_rc EQUAL 143)
  foreach(r 0 1)
    string(FIND "${v_out}" "[rank ${r}] reward server listening on http://127.0.0.1:" at)
    expect("rank ${r} served: ${all}" NOT at EQUAL -1)
    string(FIND "${v_out}" "[rank ${r}] signal 15: stopped after 0 requests" at)
    expect("rank ${r} stopped on the forwarded SIGTERM: ${all}" NOT at EQUAL -1)
    expect("rank ${r} exited 0: ${all}" v_err MATCHES "rank ${r} .pid [0-9]+. exited with status 0")
  endforeach()
  string(FIND "${v_err}" "still runs after" at)
  expect("no SIGKILL was needed: ${all}" at EQUAL -1)

elseif(CASE STREQUAL "args")
  macro(bad pattern)
    launch(e ${ARGN})
    set(all "args: ${ARGN}\nrc ${e_rc}\nstderr:\n${e_err}")
    expect("bad arguments exit with 2: ${all}" e_rc EQUAL 2)
    expect("the error names the problem (${pattern}): ${all}" e_err MATCHES "${pattern}")
  endmacro()
  bad("--nproc is missing" -- true)
  bad("--nproc = '0': expected an integer in .1," --nproc 0 -- true)
  bad("--nproc = 'two'" --nproc two -- true)
  bad("no program" --nproc 2)
  bad("unknown option '--bogus'" --nproc 2 --bogus -- true)
  bad("--master-port = '70000'" --nproc 2 --master-port 70000 -- true)
  bad("--node-rank = 2: expected in .0, --nnodes = 2." --nproc 2 --node-rank 2 --nnodes 2 --master-port 29555 -- true)
  bad("--nnodes = 2 needs --master-port" --nproc 2 --node-rank 0 --nnodes 2 -- true)
  bad("--grace = '-1'" --nproc 2 --grace -1 -- true)
  launch(f --nproc 1 -- /nonexistent/unirl-launch-test-program)
  expect("a program that cannot start: 127: ${f_rc} ${f_err}" f_rc EQUAL 127)
  expect("names it: ${f_err}" f_err MATCHES "cannot start '/nonexistent/unirl-launch-test-program' for rank 0")
else()
  message(FATAL_ERROR "CASE = ${CASE}: expected env, failure, signal, args or servers")
endif()
