#!/usr/bin/env bash
# 03_git.sh — proves git works unchanged with hakmem preloaded, over a whole
# shell session (LD_PRELOAD is exported for the loop, so bash, every git and
# its helpers run on hakmem): init a repository, make 300 commits touching a
# handful of files (plus branches, a merge and a tag), then log --stat, log -p,
# blame, gc, repack, fsck and rev-parse. Dates, identity and config are pinned
# (HOME in the scratch dir, GIT_CONFIG_NOSYSTEM=1, fixed author/committer
# dates) so object hashes and all stdout must be byte-identical between the
# plain and the preloaded run, with the same exit status.
#
# Env: LIB = absolute path of libhakmem.so (required); WORK = scratch dir
# (optional). Exit 0 pass, 77 skip (git missing), anything else = fail.
name=03_git
. "$(dirname "$0")/lib/common.sh" || exit 1
need_cmd git
need_cmd md5sum
setup_scratch 120

# The workload, run by a fresh bash in a clean environment. $1 = repo dir.
cat > "$T/work.sh" <<'SH'
set -e
repo=$1
mkdir -p "$repo/home" && cd "$repo"
export HOME="$repo/home" XDG_CONFIG_HOME="$repo/home/.config" GIT_CONFIG_NOSYSTEM=1
export GIT_AUTHOR_NAME="Hak Mem" GIT_AUTHOR_EMAIL="hakmem@example.invalid"
export GIT_COMMITTER_NAME="Hak Mem" GIT_COMMITTER_EMAIL="hakmem@example.invalid"
export GIT_PAGER=cat PAGER=cat GIT_TERMINAL_PROMPT=0 TZ=UTC
unset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE GIT_OBJECT_DIRECTORY GIT_ALTERNATE_OBJECT_DIRECTORIES
git init -q -b main r 2>/dev/null || { git init -q r && git -C r symbolic-ref HEAD refs/heads/main; }
cd r
git config user.name "Hak Mem"; git config user.email "hakmem@example.invalid"
git config commit.gpgsign false; git config tag.gpgsign false
git config core.autocrlf false; git config gc.auto 0; git config core.fsmonitor false
git config pack.threads 2; git config maintenance.auto false
files="alpha.txt beta.c gamma/delta.md gamma/eps.json zeta.txt"
mkdir -p gamma
for f in $files; do printf 'header of %s\n' "$f" > "$f"; done
git add -A
n=0; ts=1700000000
commit() {   # commit MESSAGE
  n=$((n + 1)); ts=$((ts + 3607))
  GIT_AUTHOR_DATE="$ts +0000" GIT_COMMITTER_DATE="$ts +0000" git commit -q -a -m "$1"
}
commit "initial"
for i in $(seq 1 300); do
  if [ $((i % 50)) = 0 ]; then   # a side branch, merged back with --no-ff
    git checkout -q -b "topic$i"; echo "topic $i" > "topic$i.txt"; git add "topic$i.txt"; commit "topic $i"
    git checkout -q main
    ts=$((ts + 1)); GIT_AUTHOR_DATE="$ts +0000" GIT_COMMITTER_DATE="$ts +0000" git merge -q --no-ff -m "merge topic $i" "topic$i"
  fi
  set -- $files
  k=$(( (i * 7) % 5 + 1 )); f=${!k}
  printf 'line %d of commit %d: %s\n' "$i" "$i" "$(printf '%*s' $((i % 60)) '' | tr ' ' "$(printf "\\$(printf '%03o' $((97 + i % 26)))")")" >> "$f"
  if [ $((i % 3)) = 0 ]; then j=$(( (i * 3) % 5 + 1 )); g=${!j}; sed -i "2,\$s/^line $((i - 17)) /LINE $((i - 17)) /" "$g"; fi
  commit "commit $i touching $f"
  if [ $((i % 100)) = 0 ]; then GIT_COMMITTER_DATE="$ts +0000" git tag -a -m "tag v$i" "v$i"; fi
done
echo "== rev-parse"; git rev-parse HEAD HEAD~100 v100 v200 v300 'HEAD^{tree}'
echo "== count"; git rev-list --count HEAD; git rev-list --all | md5sum
echo "== log --stat"; git log --stat --format='%H %an %ad %s' --date=raw | md5sum
git log --stat -3 --format='%H %s'
echo "== log -p"; git log -p --format='%H %s' | md5sum
echo "== shortlog/branches"; git shortlog -s -n HEAD; git branch --list; git tag --list
echo "== blame"; git blame -s zeta.txt | md5sum; git blame -s alpha.txt | tail -n 3
echo "== diff"; git diff --stat v100 v300; git diff v100 v200 | md5sum
echo "== grep"; git grep -c 'LINE' v300 || true
echo "== gc"; git gc -q --aggressive --prune=now
git count-objects -v | grep -E '^(count|in-pack|packs|garbage):'
echo "== repack"; git repack -a -d -f -q; git count-objects -v | grep -E '^(count|in-pack|packs):'
echo "== fsck"; HAKMEM_STATS=0 git fsck --full --strict --no-progress 2>&1   # its stderr is output here: no stats table in it
echo "== after"; git rev-parse HEAD; git log --format='%H %s' | md5sum
git archive --format=tar HEAD | md5sum
echo "== done"
SH

# env -i keeps the user's environment out; HAKMEM_* options still pass through.
mapfile -t hkenv < <(env | grep -E '^HAKMEM_[A-Za-z0-9_]*=' || true)
run() {   # run plain|pre
  local tag=$1
  if [ "$tag" = pre ]; then
    ( export LD_PRELOAD="$LIB"; cd "$T" && $TO env -i PATH="$PATH" LC_ALL=C "${hkenv[@]}" LD_PRELOAD="$LIB" bash work.sh "$T/$tag" >"$tag.out" 2>"$tag.err" ); echo $? >"$T/$tag.rc"
  else
    ( cd "$T" && $TO env -i PATH="$PATH" LC_ALL=C "${hkenv[@]}" bash work.sh "$T/$tag" >"$tag.out" 2>"$tag.err" ); echo $? >"$T/$tag.rc"
  fi
}
run plain; run pre
p=plain q=pre
check_preloaded_stderr "$q"
check_served "$T/$q.err" 50000000   # measured: 125M in about 2000 processes
check_plain_rc "$p" "test bug or broken git"
grep -qx "== done" "$T/$p.out" || fail "plain run did not finish" "$T/$p.err"
check_same "$p" "$q"
echo "$name: PASS (HEAD $(sed -n '/^== rev-parse/{n;p;q}' "$T/$p.out"))"
exit 0
