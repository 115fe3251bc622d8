#!/usr/bin/env python3
"""make mutate: apply plausible bugs one at a time and check the tests catch each.

Every mutant in tools/mutants.toml is a file, the exact text it replaces (found
exactly once, or this tool fails loudly: mutants must stay in step with the
code they break), the replacement, and the tests that cover that code. The
mutants are applied to a copy of the working tree (tracked and untracked
files that git does not ignore, plus the generated protobuf module), never to
the tree itself: the copy is built once, its tests are run once unmutated (a
baseline: a test that already fails kills nothing), then for each mutant the
file is changed, what it needs is rebuilt, only its tests run, and the file is
put back. The table at the end says, per mutant, whether a test failed
(killed) or none did (survived). Exit status 1 when any survived, 2 when the
list or the baseline is broken.

  tools/mutate.py [--only NAME[,NAME]] [--keep] [--no-baseline] [--list] [--check]

Test kinds in a mutant's `tests`:
  c:NAME          the C test allocator/tests/NAME.c, linked with the release library
  py:PATH[::TEST] pytest on a file of learner/tests (or one test of it)
Environment: MUTATE_BUILD_JOBS (make -j, default 2), PYTHON (the venv's python).
"""
import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIST = ROOT / "tools" / "mutants.toml"
TIMEOUT = 600


def load(path):
    with open(path, "rb") as f:
        data = tomllib.load(f)
    mutants = data.get("mutant", [])
    names = set()
    for m in mutants:
        for key in ("name", "file", "original", "replacement", "tests", "why"):
            if key not in m:
                sys.exit(f"mutate: {path}: mutant {m.get('name', '?')} lacks `{key}`")
        if m["name"] in names:
            sys.exit(f"mutate: {path}: two mutants named {m['name']}")
        names.add(m["name"])
        if not m["tests"]:
            sys.exit(f"mutate: {path}: mutant {m['name']} names no tests")
        for t in m["tests"]:
            if not (t.startswith("c:") or t.startswith("py:")):
                sys.exit(f"mutate: {path}: mutant {m['name']}: test `{t}` is neither c:NAME nor py:PATH")
    return mutants


def copy_tree(dst):
    """The working tree as git sees it (ignored files left out), plus the
    generated protobuf module, into dst."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    for f in files:
        # Build directories other than build/ (build-m, ...) are not ignored
        # by git but are no part of the tree.
        if not f or f.split(b"/", 1)[0].startswith(b"build"):
            continue
        src = ROOT / os.fsdecode(f)
        if not src.exists():   # deleted in the working tree
            continue
        out = dst / os.fsdecode(f)
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), out)
        else:
            shutil.copy2(src, out)
    pb = ROOT / "learner" / "hakmem" / "_pb"
    if pb.is_dir():
        shutil.copytree(pb, dst / "learner" / "hakmem" / "_pb", dirs_exist_ok=True)
    if (ROOT / ".venv").exists():
        os.symlink(ROOT / ".venv", dst / ".venv")


def check_original(tree, m):
    path = tree / m["file"]
    if not path.is_file():
        sys.exit(f"mutate: mutant {m['name']}: no file {m['file']}")
    n = path.read_text().count(m["original"])
    if n != 1:
        sys.exit(f"mutate: mutant {m['name']}: its original text occurs {n} times in {m['file']} (must be "
                 f"exactly once): update tools/mutants.toml to the code as it is now\n--- original:\n"
                 f"{m['original']}")


def build_targets(tests):
    targets = {"lib"}
    for t in tests:
        if t.startswith("c:"):
            targets.add(f"{{B}}/tests/{t[2:]}")
        else:
            # The replayer too: hakmem replay's tests run it (issue 14), and
            # so does every learnd that screens a program (the GP learner's).
            targets.update({"{B}/learner/workload", "{B}/learner/counted", "{B}/hakmem-replay"})
            if "test_bpf" in t:     # hakmem-bpf and its counted program (issue 16)
                targets.update({"bpf", "{B}/learner/kernel_ops"})
            if "replay_predict" in t or "bench_learn" in t:   # they run bench-learn's workload
                targets.add("{B}/bench/learn_workload")
    return sorted(targets)


def make(tree, build, targets):
    jobs = os.environ.get("MUTATE_BUILD_JOBS", "2")
    cmd = ["make", "-s", f"-j{jobs}", f"BUILD={build}", *[t.format(B=build) for t in targets]]
    r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=TIMEOUT)
    return r.returncode == 0, r.stdout + r.stderr


def run_test(tree, build, python, t):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAKMEM_")}
    env.update(BUILD=build, HAKMEM_TELEMETRY="0", PYTHONPATH=str(tree / "learner"), PYTHONDONTWRITEBYTECODE="1")
    if t.startswith("c:"):
        cmd = [str(tree / build / "tests" / t[2:])]
    else:
        cmd = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", t[3:]]
    try:
        r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        return r.returncode == 0, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return False, out + f"\n(timed out after {TIMEOUT} s)"


def tail(text, n=12):
    return "\n".join("      | " + line for line in text.strip().splitlines()[-n:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated mutant names")
    ap.add_argument("--keep", action="store_true", help="keep the copy (its path is printed)")
    ap.add_argument("--no-baseline", action="store_true", help="do not run the tests unmutated first")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--check", action="store_true",
                    help="only check that each mutant's original text occurs exactly once in the tree as it is")
    ap.add_argument("--file", default=str(LIST), help="the mutant list (default tools/mutants.toml)")
    args = ap.parse_args()
    mutants = load(args.file)
    if args.only:
        want = set(args.only.split(","))
        unknown = want - {m["name"] for m in mutants}
        if unknown:
            sys.exit(f"mutate: no mutant named {', '.join(sorted(unknown))}")
        mutants = [m for m in mutants if m["name"] in want]
    if args.list:
        for m in mutants:
            print(f"{m['name']:34} {m['file']:32} {' '.join(m['tests'])}\n    {m['why']}")
        return 0
    if args.check:   # seconds: make test runs it first, so a stale list fails there, not 16 minutes later
        for m in mutants:
            check_original(ROOT, m)
        print(f"mutate: the {len(mutants)} mutants match the tree")
        return 0
    python = os.environ.get("PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    if any(t.startswith("py:") for m in mutants for t in m["tests"]) and not os.access(python, os.X_OK):
        sys.exit(f"mutate: {python} missing: `make venv` first")

    t_all = time.monotonic()
    tree = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-mutate-"))
    # Tests that run a service as its own account (PostgreSQL as postgres)
    # preload the copy's library: the account must be able to reach it.
    os.chmod(tree, 0o755)
    build = "build-mutate"
    print(f"mutate: {len(mutants)} mutants, in a copy of the working tree at {tree}", flush=True)
    try:
        copy_tree(tree)
        for m in mutants:   # all checked before anything runs
            check_original(tree, m)
        every_test = sorted({t for m in mutants for t in m["tests"]})
        t0 = time.monotonic()
        ok, out = make(tree, build, build_targets(every_test))
        if not ok:
            print(f"mutate: the unmutated copy does not build:\n{tail(out, 30)}")
            return 2
        print(f"mutate: built in {time.monotonic() - t0:.0f} s", flush=True)
        if not args.no_baseline:
            t0 = time.monotonic()
            broken = []
            for t in every_test:
                ok, out = run_test(tree, build, python, t)
                if not ok:
                    broken.append(t)
                    print(f"  baseline FAIL {t}\n{tail(out)}")
            if broken:
                print(f"mutate: {len(broken)} tests fail without any mutant; fix them first")
                return 2
            print(f"mutate: baseline: {len(every_test)} tests pass unmutated ({time.monotonic() - t0:.0f} s)",
                  flush=True)
        rows = []
        for m in mutants:
            t0 = time.monotonic()
            path = tree / m["file"]
            original = path.read_text()
            path.write_text(original.replace(m["original"], m["replacement"], 1))
            killed_by, detail = None, ""
            try:
                if m["file"].startswith(("allocator/", "bpf/", "replay/")):   # C: rebuilt (bpf/: hakmem-bpf, replay/: the replayer)
                    ok, out = make(tree, build, build_targets(m["tests"]))
                    if not ok:
                        rows.append((m, "does not build", None, time.monotonic() - t0))
                        print(f"  {m['name']}: the mutant does not build (fix the mutant):\n{tail(out)}")
                        continue
                for t in m["tests"]:
                    ok, out = run_test(tree, build, python, t)
                    if not ok:
                        killed_by, detail = t, out
                        break
            finally:
                path.write_text(original)
                os.utime(path)   # newer than the mutant's objects: make rebuilds them
            dt = time.monotonic() - t0
            verdict = "killed" if killed_by else "SURVIVED"
            rows.append((m, verdict, killed_by, dt))
            print(f"  {verdict:8} {m['name']} ({dt:.0f} s){' by ' + killed_by if killed_by else ''}", flush=True)
            if not killed_by:
                print(f"      {m['why']}")
        # Leave the copy's build matching its sources.
        if any(m["file"].startswith("allocator/") for m in mutants):
            make(tree, build, ["lib"])
        if any(m["file"].startswith("bpf/") for m in mutants):
            make(tree, build, ["bpf"])
        if any(m["file"].startswith("replay/") for m in mutants):
            make(tree, build, ["replay"])
    finally:
        if args.keep:
            print(f"mutate: kept {tree}")
        else:
            shutil.rmtree(tree, ignore_errors=True)

    print()
    print(f"| mutant | file | tests run | result | time |")
    print(f"|---|---|---|---|---:|")
    for m, verdict, killed_by, dt in rows:
        tests = ", ".join(f"**{t}**" if t == killed_by else t for t in m["tests"])
        print(f"| {m['name']} | {m['file']} | {tests} | {verdict} | {dt:.0f} s |")
    survived = [m["name"] for m, v, _, _ in rows if v != "killed"]
    print()
    print(f"{len(rows) - len(survived)} killed, {len(survived)} survived or broken, "
          f"{time.monotonic() - t_all:.0f} s in all")
    if survived:
        print(f"survived: {', '.join(survived)}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
