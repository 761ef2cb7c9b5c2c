#!/usr/bin/env bash
# Starts NPROC ranks of a program on this machine with the variables torchrun sets (RANK,
# WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT: a free port), for the examples' split mode
# (docs/parallel.md) and their CTest smoke entries. Each line of output is prefixed "[rank R]";
# when a rank fails, the others are stopped. The exit status is 0 when every rank succeeded.
#
#   examples/common/run_split.sh 3 build/examples/01_quickstart/quickstart mode=split --out runs/qs_split
#
# With UNIRL_LAUNCH set to the unirl-launch program (tools/unirl_launch; the CTest entries set it
# when that target is built), this script hands over to it: unirl-launch --nproc N --tag-output --
# PROGRAM ARGS... (a free port, the same variables, the others stopped when a rank fails).
set -u
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[0-9]+$ ]] || [ "$1" -lt 2 ]; then
  echo "usage: run_split.sh NPROC PROGRAM [ARGS...]   (NPROC >= 2: rank 0 learns, ranks 1.. sample)" >&2
  exit 2
fi
nproc=$1
shift
if [ -n "${UNIRL_LAUNCH:-}" ] && [ -x "$UNIRL_LAUNCH" ]; then
  exec "$UNIRL_LAUNCH" --nproc "$nproc" --tag-output -- "$@"
fi

# A port nobody listens on (a connection attempt fails).
port=""
for _ in $(seq 1 50); do
  p=$((20000 + RANDOM % 40000))
  if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
    port=$p
    break
  fi
done
[ -n "$port" ] || { echo "run_split.sh: no free port found" >&2; exit 1; }

pids=()
for ((r = 0; r < nproc; r++)); do
  (set -o pipefail
   RANK=$r WORLD_SIZE=$nproc LOCAL_RANK=$r LOCAL_WORLD_SIZE=$nproc MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
     "$@" 2>&1 | sed -u "s/^/[rank $r] /") &
  pids+=($!)
done

status=0
remaining=$nproc
declare -A done_pid=()
while [ "$remaining" -gt 0 ]; do
  wait -n -p finished "${pids[@]}" 2>/dev/null
  rc=$?
  [ -n "${finished:-}" ] || break
  [ -z "${done_pid[$finished]:-}" ] || continue
  done_pid[$finished]=1
  remaining=$((remaining - 1))
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$rc
    echo "run_split.sh: a rank exited with status $rc; stopping the others" >&2
    for p in "${pids[@]}"; do
      [ -n "${done_pid[$p]:-}" ] || pkill -TERM -P "$p" 2>/dev/null
    done
  fi
done
exit "$status"
