#!/usr/bin/env bash
# Installs the Debian packages that building and testing hakmem need.
# Idempotent: installs only what is missing. Needs root (or sudo) only then.
#
#   tools/install-deps.sh              what building and testing need (make deps)
#   tools/install-deps.sh GROUP...     only the named groups:
#     base         the same as no argument
#     postgresql   PostgreSQL 15 with pgbench (/usr/lib/postgresql/15/bin), for
#                  learner/tests/test_postgres.py
#     redis        redis-server and redis-benchmark (redis-tools), for
#                  learner/tests/test_redis.py and `make demo`
#     learn-real   jq, for bench/learn_real.py (its other programs are in base,
#                  postgresql, redis and mariadb)
#     mariadb      MariaDB and sysbench, for bench/learn_real.py; the package's
#                  own server is not started (policy-rc.d): the study starts
#                  its own in a temporary directory
#     ops          systemd (systemd-analyze, systemd-tmpfiles), for
#                  learner/tests/test_make_install.py (deploy/'s unit)
set -euo pipefail
# Everything this says is progress, on stderr: callers run it on the way to
# printing JSON on their stdout (bench/learn_real.py --json on a machine
# without redis printed "install-deps: installing redis-server ..." before
# its document, and its test failed to parse it).
exec 1>&2

base=(build-essential g++ valgrind sqlite3 git perl python3 python3-venv procps protobuf-compiler
      protobuf-c-compiler libprotobuf-c-dev pkg-config)
# hakmem-bpf (bpf/): clang for the BPF object, bpftool for vmlinux.h and the
# skeleton, libbpf/libelf/zlib to load it, libzmq to send its samples to learnd.
base+=(clang llvm libbpf-dev bpftool libelf-dev zlib1g-dev libzmq3-dev)

pkgs=()
no_start=
[ $# -eq 0 ] && pkgs=("${base[@]}")
for group in "$@"; do
  case "$group" in
    base) pkgs+=("${base[@]}") ;;
    postgresql) pkgs+=(postgresql) ;;
    redis) pkgs+=(redis-server redis-tools) ;;
    ops) pkgs+=(systemd strace) ;;     # strace: test_make_install traces a replay to check the unit allows it
    learn-real) pkgs+=(jq) ;;
    mariadb) pkgs+=(mariadb-server mariadb-client sysbench); no_start=1 ;;
    *) echo "install-deps: unknown group '$group' (groups: base, postgresql, redis, ops, learn-real, mariadb)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}"
SUDO=
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# A package's server started by its postinst would run beside every
# benchmark after it: where the caller starts its own, policy-rc.d (exit
# 101: "not allowed") keeps invoke-rc.d from starting any, for this install
# only, and only when no policy-rc.d was there already.
policy=/usr/sbin/policy-rc.d
if [ -n "$no_start" ] && [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
  $SUDO chmod 755 "$policy"
  trap '$SUDO rm -f "$policy"' EXIT
fi
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
