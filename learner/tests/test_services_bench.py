"""bench/services.py, the runner that compares hakmem with glibc (and the
peers) inside PostgreSQL and redis: it runs both services end to end, reports
every measure, reports an allocator whose server dies as failed (and keeps
measuring the others), and leaves nothing running or on disk.

Speed is not judged here (README: benchmarks prove speed, tests do not):
these runs are --quick, one round of a few seconds. What is checked is that
the numbers are there, positive and of the right shape, and that a failure
is a one-line reason and a non-zero exit, not a hang or a traceback."""
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

from conftest import LIB, ROOT, need_root, processes_with, scaled

SCRIPT = ROOT / "bench" / "services.py"
REDIS_TESTS = ("set", "get", "lpush", "lpop", "hset")


def run(*args, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=scaled(timeout), cwd=ROOT)


def leftovers():
    """Work directories and servers of the runner still there."""
    tmp = pathlib.Path(tempfile.gettempdir())
    dirs = [*tmp.glob("hakmem-services-*"), *tmp.glob("hakmem-pg-*")]
    return dirs, processes_with(b"hakmem-services-")


def test_help_and_bad_arguments():
    r = run("--help")
    assert r.returncode == 0 and "pgbench" in r.stdout and "--json" in r.stdout
    r = run("--only", "mysql")
    assert r.returncode == 2 and "mysql" in r.stderr.strip().splitlines()[-1]
    r = run("--allocators", "mimalloc,jemalloc")
    assert r.returncode == 2 and "hakmem and glibc" in r.stderr
    # A README without the section is said before anything is measured.
    r = run("--update-readme", "/nonexistent/README.md")
    assert r.returncode == 2 and "<!-- services:begin -->" in r.stderr.strip().splitlines()[-1]


def test_redis_and_postgres_measured_side_by_side(tmp_path):
    """Both services, glibc and hakmem, one quick round: every measure there,
    JSON and the Markdown table written, nothing left behind."""
    need_root("runs PostgreSQL as the postgres account (and installs postgresql and redis when missing)")
    before_dirs, _ = leftovers()
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- services:begin -->\nold table\n<!-- services:end -->\nafter\n")
    r = run("--quick", "--allocators", "glibc,hakmem", "--json", "--out", tmp_path, "--update-readme", readme)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["allocators"] == ["glibc", "hakmem"] and res["rounds"] == 1
    # The hakmem measured is the build's, and the result says which file it was.
    assert res["libraries"]["hakmem"]["sha256"] == hashlib.sha256(LIB.read_bytes()).hexdigest()
    for svc, metrics in (("postgres", ("tps",)), ("redis", REDIS_TESTS)):
        s = res["services"][svc]
        assert s["failed"] == {}, s["failed"]
        for a in ("glibc", "hakmem"):
            assert len(s["runs"][a]) == 1
            run_ = s["runs"][a][0]
            for m in (*metrics, "cpu_us"):
                assert run_[m] > 0, (svc, a, m, run_)
            # A real server's memory: more than a bare process, under what this machine has.
            assert 4 * 1024 < run_["mem_kib"] <= run_["peak_kib"] + 1 < 16 << 20, (svc, a, run_)
        for m in metrics:
            row = s["rows"][m]
            assert row["vs_glibc"] == pytest.approx(row["median"]["hakmem"] / row["median"]["glibc"])
            assert row["paired_glibc"]["per_round"] == [pytest.approx(row["vs_glibc"])]
    md = (tmp_path / "services.md").read_text()
    assert md.count("| postgres |") == 4 and md.count("| redis |") == 8
    assert readme.read_text() == f"before\n<!-- services:begin -->\n{md}<!-- services:end -->\nafter\n"
    assert json.loads((tmp_path / "services.json").read_text())["services"].keys() == {"postgres", "redis"}
    dirs, procs = leftovers()
    assert set(dirs) <= set(before_dirs) and procs == [], (dirs, procs)


def test_a_server_that_dies_is_reported_and_the_others_measured(tmp_path):
    """A "libhakmem.so" that kills the process it is loaded into: hakmem's
    runs fail with a reason, glibc's still count, the exit status says so."""
    build = tmp_path / "build"
    build.mkdir()
    src = tmp_path / "die.c"
    src.write_text("#include <unistd.h>\n__attribute__((constructor)) static void die(void) { _exit(7); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(build / "libhakmem.so"), str(src)], check=True)
    os.chmod(tmp_path, 0o755)
    r = run("--quick", "--only", "redis", "--allocators", "glibc,hakmem", "--build", build, "--json")
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "services: error: hakmem failed on redis"
    res = json.loads(r.stdout)
    s = res["services"]["redis"]
    assert "exited at start (7)" in s["failed"]["hakmem"]
    assert all(s["runs"]["glibc"][0][t] > 0 for t in REDIS_TESTS)
    assert s["rows"]["set"]["vs_glibc"] is None
    assert leftovers()[1] == []

