#!/usr/bin/env bash
# Installs the Debian packages that building and testing hakmem need.
# Idempotent: installs only what is missing. Needs root (or sudo) only then.
#
#   tools/install-deps.sh              what building and testing need (make deps)
#   tools/install-deps.sh GROUP...     only the named groups:
#     base         the same as no argument
#     postgresql   PostgreSQL 15 with pgbench (/usr/lib/postgresql/15/bin), for
#                  learner/tests/test_postgres.py
set -euo pipefail

base=(build-essential g++ valgrind sqlite3 git perl python3 python3-venv procps protobuf-compiler
      protobuf-c-compiler libprotobuf-c-dev pkg-config)

pkgs=()
[ $# -eq 0 ] && pkgs=("${base[@]}")
for group in "$@"; do
  case "$group" in
    base) pkgs+=("${base[@]}") ;;
    postgresql) pkgs+=(postgresql) ;;
    *) echo "install-deps: unknown group '$group' (groups: base, postgresql)" >&2; exit 2 ;;
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
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
