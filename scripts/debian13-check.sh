#!/usr/bin/env bash
# Runs the README's two commands on a fresh Debian root, as a new user would: makes the root with
# debootstrap, installs only git in it, puts the repository in it and runs, inside it with chroot,
#   bash scripts/quickstart.sh   then   bash scripts/test.sh
# printing each command's result and time and a summary line. Needs root, debootstrap and chroot.
#
#   sudo bash scripts/debian13-check.sh [options] [DIR]
#     DIR              where to make the root (default: a new directory under /var/tmp); it must
#                      not exist or be empty, unless --reuse
#     --suite NAME     trixie (Debian 13, the default) or bookworm (Debian 12)
#     --worktree       copy the working tree (tracked and untracked, not ignored, files: what
#                      you have not committed yet) instead of a `git clone` of HEAD (the default,
#                      which leaves uncommitted changes out)
#     --reuse          DIR holds a root this script made before: skip debootstrap and keep what
#                      is installed there and the build directory (not a fresh machine any more;
#                      for iterating on a fix)
#     --mirror URL     Debian mirror (default: the first one the host's apt sources name, else
#                      http://deb.debian.org/debian)
#     --only quickstart|test|setup   run one of the two commands (setup: neither; make the root
#                      and put the repository in it)
#
# Logs: DIR/unirl-check/{setup,quickstart,test}.log. The repository is at DIR/root/unirl.
set -euo pipefail

suite=trixie
worktree=0
reuse=0
mirror=""
only=""
dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --suite) suite="$2"; shift 2 ;;
    --suite=*) suite="${1#*=}"; shift ;;
    --worktree) worktree=1; shift ;;
    --reuse) reuse=1; shift ;;
    --mirror) mirror="$2"; shift 2 ;;
    --mirror=*) mirror="${1#*=}"; shift ;;
    --only) only="$2"; shift 2 ;;
    --only=*) only="${1#*=}"; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "debian-check: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) if [ -n "$dir" ]; then echo "debian-check: one DIR only, got '$dir' and '$1'" >&2; exit 2; fi
       dir="$1"; shift ;;
  esac
done
case "$suite" in
  trixie|bookworm) ;;
  *) echo "debian-check: --suite '$suite': expected trixie (Debian 13) or bookworm (Debian 12)" >&2; exit 2 ;;
esac
case "$only" in
  ""|quickstart|test|setup) ;;
  *) echo "debian-check: --only '$only': expected quickstart, test or setup" >&2; exit 2 ;;
esac
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tag=debian-check
# shellcheck source=scripts/debian-root.sh
. "$repo/scripts/debian-root.sh"
require_root_tools
git -C "$repo" rev-parse --git-dir >/dev/null 2>&1 ||
  { echo "debian-check: $repo is not a git repository" >&2; exit 2; }

mirror="${mirror:-$(host_mirror)}"
mirror="${mirror%/}"

if [ -z "$dir" ]; then
  dir="$(mktemp -d "/var/tmp/unirl-$suite-check.XXXXXX")"
fi
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
logs="$dir/unirl-check"

trap unmount_all EXIT

t0=$(date +%s)
if [ "$reuse" -eq 1 ] && [ -x "$dir/usr/bin/apt-get" ]; then
  echo "debian-check: reusing the root in $dir (not fresh)"
  mkdir -p "$logs"
else
  if [ -n "$(ls -A "$dir")" ]; then
    echo "debian-check: $dir is not empty; give a new directory (or --reuse one this script made)" >&2
    exit 2
  fi
  echo "debian-check: debootstrap $suite from $mirror into $dir"
  mkdir -p "$logs"
  debootstrap --variant=minbase "$suite" "$dir" "$mirror" > "$logs/setup.log" 2>&1 ||
    { tail -n 20 "$logs/setup.log"; echo "debian-check: debootstrap failed" >&2; exit 1; }
fi

prepare_root

echo "debian-check: installing git"
{ in_root apt-get update -q && in_root apt-get install -y -q git; } \
  >> "$logs/setup.log" 2>&1 || { tail -n 20 "$logs/setup.log"; echo "debian-check: apt-get failed" >&2; exit 1; }

dest="$dir/root/unirl"
if [ "$worktree" -eq 1 ]; then echo "debian-check: copying the working tree of $repo"
else echo "debian-check: cloning HEAD of $repo"; fi
what="$(copy_repo "$repo" "$dest" "$worktree" "$reuse")"
echo "debian-check: $what in /root/unirl; setup $(( $(date +%s) - t0 )) s"

run_command() {  # run_command NAME SCRIPT: runs `bash SCRIPT` in /root/unirl, logs, records
  local name="$1" script="$2" start rc
  start=$(date +%s)
  echo "debian-check: [$name] bash $script (log: $logs/$name.log)"
  set +e
  in_root /bin/bash -c "cd /root/unirl && bash $script" > "$logs/$name.log" 2>&1
  rc=$?
  set -e
  eval "${name}_rc=$rc; ${name}_s=$(( $(date +%s) - start ))"
}

quickstart_rc=skipped; test_rc=skipped; quickstart_s=0; test_s=0
if [ -z "$only" ] || [ "$only" = quickstart ]; then
  run_command quickstart scripts/quickstart.sh
  echo "---- quickstart ($quickstart_s s, exit $quickstart_rc); last lines:"
  tail -n 8 "$logs/quickstart.log"
fi
if [ -z "$only" ] || [ "$only" = test ]; then
  run_command test scripts/test.sh
  echo "---- test ($test_s s, exit $test_rc); summary:"
  grep -E 'tests passed|tests failed|The following tests FAILED|^[[:space:]]+[0-9]+ - |unirl: build' \
    "$logs/test.log" || tail -n 20 "$logs/test.log"
fi

verdict() { case "$1" in 0) echo "ok" ;; skipped) echo "skipped" ;; *) echo "FAILED (exit $1)" ;; esac; }
tests_line=""
if [ "$test_rc" != skipped ]; then
  tests_line="$(grep -E '[0-9]+% tests passed' "$logs/test.log" | tail -n 1 || true)"
fi
quickstart_line=""
if [ "$quickstart_rc" != skipped ]; then
  quickstart_line="$(grep -oE 'held-out accuracy: [0-9.]+% -> [0-9.]+%' "$logs/quickstart.log" | tail -n 1 || true)"
fi
echo "debian-check: $suite ($what): quickstart $(verdict "$quickstart_rc") in ${quickstart_s} s${quickstart_line:+ ($quickstart_line)};" \
     "test $(verdict "$test_rc") in ${test_s} s${tests_line:+ ($tests_line)}; total $(( $(date +%s) - t0 )) s"
[ "$quickstart_rc" != 0 ] && [ "$quickstart_rc" != skipped ] && exit 1
[ "$test_rc" != 0 ] && [ "$test_rc" != skipped ] && exit 1
exit 0
