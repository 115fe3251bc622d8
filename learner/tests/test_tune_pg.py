"""tools/tune_pg.py, issue 15's real-service measurement: PostgreSQL under
pgbench, tuned by a real hakmem-learnd from a cold start, then the default
policy against the learned one in alternating runs. Here it runs short (a few
seconds of tuning, one round) to check that it runs end to end, reports both
sides and learnd's evidence, and leaves nothing running or on disk unless
asked to keep learnd's database. The speed it measures is README's, not a
test's."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from conftest import ROOT, need_root, processes_with, scaled

SCRIPT = ROOT / "tools" / "tune_pg.py"


def run(*args, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=scaled(timeout), cwd=ROOT)


def leftovers():
    """Its directories, and any process started from them, still there."""
    dirs = [*pathlib.Path(tempfile.gettempdir()).glob("hakmem-tune-pg-*"), *pathlib.Path("/dev/shm").glob("hakmem-tune-pg-*"),
            *pathlib.Path(tempfile.gettempdir()).glob("hakmem-pg-*")]
    return sorted(map(str, dirs)), processes_with(b"hakmem-tune-pg-", b"hakmem-pg-")


def test_help_and_bad_arguments():
    r = run("--help")
    assert r.returncode == 0 and "--keep" in r.stdout and "--json" in r.stdout
    r = run("--rounds", "0")
    assert r.returncode == 2 and "positive" in r.stderr.strip().splitlines()[-1]


def test_postgres_tuned_then_measured_default_against_learned():
    need_root("runs PostgreSQL as the postgres account (and installs postgresql when missing)")
    before_dirs, _ = leftovers()
    # 60 s of tuning: learnd screens postgres after its first windows (a 2-s
    # capture, then 17 replays); on a quiet machine that ended 15 s after
    # learnd started (12 s of it the screening), but in the fresh-clone CI
    # runs of e4aea3a (20 s of tuning) and 3ff4067 (30 s), and once beside
    # valgrind, it had not ended when the load stopped: no verdict to check.
    r = run("--seconds", 60, "--rounds", 1, "--run-seconds", 3, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    for which in ("default", "learned"):
        assert len(res["runs"][which]) == 1
        assert res["runs"][which][0]["tps"] > 0 and res[which]["tps_median"] > 0
        # The server's memory: shared buffers and backends, more than a bare process.
        assert 8 < res[which]["pss_mib_median"] < 16 << 10, res[which]
    # learnd explained the policy it holds for postgres, from its real database.
    assert res["explain"][0].startswith("/usr/lib/postgresql/15/bin/postgres@"), res["explain"]
    assert any(ln.startswith("in force: ") for ln in res["explain"]), res["explain"]
    # ... and reached verdicts on it while tuning (screened, tried, kept or rolled back).
    assert res["events"] and all(" postgres: " in e for e in res["events"]), (res["events"], r.stderr[-3000:])
    assert "learnd tuning postgres" in r.stderr
    dirs, procs = leftovers()
    new = sorted(set(dirs) - set(before_dirs))
    for d in new:   # what a faulty run left (a mutant's, say) is removed, then reported
        shutil.rmtree(d, ignore_errors=True)
    assert new == [] and procs == [], (new, procs)


def test_keep_leaves_learnds_database_and_says_where():
    need_root("runs PostgreSQL as the postgres account")
    r = run("--seconds", 3, "--rounds", 1, "--run-seconds", 2, "--keep")
    assert r.returncode == 0, r.stderr[-3000:]
    kept = [ln for ln in r.stderr.splitlines() if ln.startswith("kept ")]
    assert len(kept) == 1, r.stderr[-2000:]
    work = pathlib.Path(kept[0].split()[1])
    try:
        assert (work / "learn.db").stat().st_size > 0
        assert sorted(p.name for p in work.iterdir() if p.is_dir()) == ["run"]     # the no-learnd directory is gone
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert "TPS" in r.stdout


def test_a_library_postgres_cannot_load_is_an_error_not_a_glibc_measurement(tmp_path):
    """ld.so skips a preload it cannot read and says so on a stderr nobody
    reads: the server would run on glibc under hakmem's name."""
    need_root("runs PostgreSQL as the postgres account")
    from conftest import LIB
    build = tmp_path / "private" / "build"
    build.mkdir(parents=True)
    shutil.copy(LIB, build / "libhakmem.so")
    os.chmod(tmp_path / "private", 0o700)            # root's alone: the postgres account cannot reach it
    r = run("--seconds", 3, "--rounds", 1, "--run-seconds", 2, "--build", build)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "did not load" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    dirs, procs = leftovers()
    assert procs == [], procs


def test_the_servers_log_is_never_opened_through_a_link_or_a_fifo(tmp_path):
    """The cluster directory belongs to the postgres account: a link it
    plants where the server's log goes must not make root truncate the
    link's target, nor a FIFO there hang the error message that reads it."""
    sys.path.insert(0, str(SCRIPT.parent))
    import tune_pg
    cl = tune_pg.Cluster("", (os.geteuid(), os.getegid()))
    try:
        target = tmp_path / "precious"
        target.write_text("keep me")
        (cl.dir / "server.log").symlink_to(target)
        try:
            cl._open_log()
            raise AssertionError("opened through a link")
        except tune_pg.TuneError as e:
            assert "server.log" in str(e)
        assert target.read_text() == "keep me"
        assert cl.log_tail().startswith("(no log: ")
        (cl.dir / "server.log").unlink()
        os.mkfifo(cl.dir / "server.log")
        assert cl.log_tail() == "(no log: not a regular file)"
        try:
            cl._open_log()
            raise AssertionError("opened a FIFO")
        except tune_pg.TuneError:
            pass
        (cl.dir / "server.log").unlink()
        with cl._open_log() as f:
            f.write(b"x" * 1000 + b"FATAL:  the end")
        tail = cl.log_tail()
        assert tail.endswith("FATAL:  the end") and len(tail) == 600
    finally:
        cl.cleanup()

