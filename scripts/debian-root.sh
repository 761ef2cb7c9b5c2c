# Shared by scripts/debian13-check.sh and scripts/cuda-build.sh (sourced, not run): a Debian root
# made with debootstrap, the mounts a build inside it needs, a clean environment to run in it, and
# the repository copied into it. The caller sets `dir` (the root) and `tag` (its messages' prefix).

# Exits unless run as root with the tools that make and enter a root.
require_root_tools() {
  if [ "$(id -u)" -ne 0 ]; then echo "$tag: needs root (debootstrap, chroot, mount)" >&2; exit 2; fi
  local tool
  for tool in debootstrap chroot mount git; do
    command -v "$tool" >/dev/null || { echo "$tag: '$tool' not found (apt-get install debootstrap git)" >&2; exit 2; }
  done
}

# The host's first Debian mirror (one-line .list or deb822 .sources), security archives aside.
host_mirror() {
  local m
  m="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
    grep -oE '(https?|file)://[^ ]+/debian/?( |$)' | grep -v -- '-security' | head -n 1 | tr -d ' ' || true)"
  m="${m:-http://deb.debian.org/debian}"
  echo "${m%/}"
}

mounted=()
unmount_all() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
}
mount_in() {  # mount_in TYPE-ARGS... TARGET: mounts unless already mounted there
  local target="${*: -1}"
  mkdir -p "$target"
  mountpoint -q "$target" && return 0
  mount "$@" || return 1
  mounted+=("$target")
}

# debootstrap made the device nodes; /proc, /sys (LibTorch reads the CPU topology there) and a
# /dev/shm of its own are mounted for the run and unmounted on exit (the caller traps
# unmount_all). Nothing of the host's is bind-mounted.
prepare_root() {
  mount_in -t proc proc "$dir/proc"
  mount_in -t sysfs sysfs "$dir/sys" || echo "$tag: could not mount /sys in the root (continuing)"
  mount_in -t tmpfs -o mode=1777 tmpfs "$dir/dev/shm" || true
  cp -L /etc/resolv.conf "$dir/etc/resolv.conf"
  # No services start inside the root.
  printf '#!/bin/sh\nexit 101\n' > "$dir/usr/sbin/policy-rc.d"
  chmod +x "$dir/usr/sbin/policy-rc.d"
}

in_root() {  # a clean login-like environment inside the root
  chroot "$dir" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 TERM="${TERM:-dumb}" DEBIAN_FRONTEND=noninteractive \
    ${http_proxy:+http_proxy=$http_proxy} ${https_proxy:+https_proxy=$https_proxy} "$@"
}

# copy_repo REPO DEST WORKTREE KEEP: puts the repository at DEST (a path on the host, inside the
# root): with WORKTREE=1 the working tree as it is now (tracked and untracked, not ignored, files:
# uncommitted changes included), copied over the previous copy; else a clone of HEAD, moving a
# previous DEST/build into it when KEEP=1. Prints what was copied.
copy_repo() {
  local repo="$1" dest="$2" worktree="$3" keep="$4"
  if [ "$worktree" -eq 1 ]; then
    mkdir -p "$dest"
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard |
       while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
       tar --null -T - -cf -) | tar -xf - -C "$dest"
    echo "working tree of $(git -C "$repo" rev-parse --short HEAD) with uncommitted changes"
  else
    rm -rf "$dest.new"
    git clone -q "$repo" "$dest.new"
    if [ -d "$dest/build" ] && [ "$keep" -eq 1 ]; then mv "$dest/build" "$dest.new/build"; fi
    rm -rf "$dest"
    mv "$dest.new" "$dest"
    echo "clone of HEAD $(git -C "$repo" rev-parse --short HEAD)"
  fi
}
