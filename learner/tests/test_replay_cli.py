"""`hakmem replay`: a trace replayed through the real replayer (build/hakmem-replay)
under one policy and under a sweep, results in a real SQLite store, the
Pareto chart, resuming after Ctrl-C, --promote applied by a real
hakmem-learnd to the next run of the program, and bad input as one line.

The workload built for the sweep: one thread allocating bursts of 2000
64-byte blocks and freeing them all, for which the default tcache_cap of that
class (1024) is plainly wrong: every burst drains and refills.
"""
import json
import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import BUILD, LIB, ROOT, WORKLOAD, clean_env, ring_path, scaled, start, wait_for

sys.path.insert(0, str(ROOT / "learner"))
from hakmem import trace as T  # noqa: E402
from hakmem.procfs import elf_build_id  # noqa: E402
from hakmem.ring import Ring  # noqa: E402

REAL = BUILD / "hakmem-replay"
CLS64 = 4


def replayer():
    """The real replayer, which `make tests` builds."""
    if not REAL.exists():
        pytest.fail(f"{REAL} is not built: make BUILD={BUILD} {REAL} (make tests builds it)")
    return REAL


def env_for(**extra):
    return clean_env(**{"HAKMEM_REPLAY": str(replayer()), **extra})


def hk(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "hakmem", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT / "learner", timeout=scaled(timeout), env=env or env_for())


def bursts_trace(path, bursts=150, n=2000, size=64, gap_ns=100):
    """One thread: `bursts` times, allocate n blocks of size, free them all.
    The trace names the test workload as its program (for --promote)."""
    exe = os.path.realpath(WORKLOAD)
    t = 1000
    with T.TraceWriter(path, pid=4242, exe=exe, build_id=elf_build_id(str(WORKLOAD)) or "", argv0="workload") as w:
        for b in range(bursts):          # a chunk per burst, as a thread's buffer fills
            a = 0x10000000 + (b % 2) * 0x1000000 + np.arange(n, dtype=np.uint64) * 64
            w.columns(1, np.concatenate([np.full(n, T.MALLOC), np.full(n, T.FREE)]).astype(np.uint8),
                      np.concatenate([np.full(n, size), np.zeros(n)]).astype(np.uint64), np.zeros(2 * n, np.uint32),
                      np.concatenate([a, a[::-1]]), np.zeros(2 * n, np.uint64),
                      t + np.arange(2 * n, dtype=np.uint64) * gap_ns)
            t += 2 * n * gap_ns + 10000
    return path


@pytest.fixture
def trace(tmp_path):
    return bursts_trace(tmp_path / "bursts.hktrace")


def db_rows(db, sql, *args):
    con = sqlite3.connect(db, timeout=5)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


# ---- the pieces --------------------------------------------------------------------------
def test_pareto_front_and_grid():
    from hakmem import replay as R
    pts = [(1.0, 5.0), (2.0, 2.0), (1.5, 6.0), (3.0, 1.0), (2.5, 2.5), (1.0, 7.0)]
    assert R.pareto(pts) == [0, 1, 3]
    cs = T.default_class_sizes()
    allocs = np.zeros(len(cs))
    allocs[CLS64], allocs[1], allocs[9] = 1000, 100, 1       # class 9 is under 5%: not hot
    facts = R.TraceFacts(path="x", hash="h", exe="e", build_id="b", uid=0, class_size=cs, duration_s=1.0,
                         allocs=allocs, events=1101, mode="full")
    assert facts.hot_classes() == [CLS64, 1]
    default = {"drain_ms": 1000, "tcache_cap": [0] + [1024] * (len(cs) - 1),
               "tcache_batch": [0] + [256] * (len(cs) - 1), "warm_slabs": [0] + [1] * (len(cs) - 1)}
    g = R.grid(default, facts)
    assert g[0] == ("default", {})
    changed = set()
    for label, k in g[1:]:
        if "tcache_cap" in k:
            diff = {c for c in range(len(cs)) if k["tcache_cap"][c] != default["tcache_cap"][c]}
            assert diff <= {CLS64, 1} and diff, label
            changed |= diff
            for c in diff:
                assert k["tcache_batch"][c] == min(256, k["tcache_cap"][c] // 2)
        else:
            assert set(k) in ({"drain_ms"}, {"retain_mib"}), label
    assert changed == {CLS64, 1}
    assert len({R.knobs_hash(k) for _, k in g}) == len(g)
    # 1/4, 2 and 4 times (16x is over 4096 for both), each with the other class at 1x or any: 4*4-1 = 15,
    # then three drain intervals and two retain_mib (0 and 64; a default without one is 256's)
    assert len(g) == 1 + 15 + 3 + 2, [x[0] for x in g]
    assert [lb for lb, _ in g[-2:]] == ["retain_mib=0", "retain_mib=64"]


# ---- command line and bad input --------------------------------------------------------
def test_help_and_usage():
    r = hk("replay", "--help")
    assert r.returncode == 0 and "--sweep" in r.stdout and "--promote" in r.stdout and "--learner" in r.stdout
    for argv in (["replay"], ["replay", "x", "--repeat", "0"], ["replay", "x", "--sweep", "--policy", "default"],
                 ["replay", "x", "--png", "o.png"], ["replay", "--learner", "gp"]):
        r = hk(*argv)
        assert r.returncode == 2, (argv, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("hakmem: error: "), r.stderr


def one_line_error(r, *needles):
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("hakmem: error: "), r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


def test_bad_input_is_one_line(trace, tmp_path):
    db = tmp_path / "learn.db"
    # The replayer missing: where it was looked for and how to build it.
    r = hk("replay", trace, env=env_for(HAKMEM_REPLAY=str(tmp_path / "nope")))
    one_line_error(r, "hakmem-replay was not found", "make")
    # An unknown stored policy, a database that does not exist, a bad policy file.
    hk("replay", trace, "--db", db, "--repeat", "1")      # makes the database
    r = hk("replay", trace, "--policy", "nosuchprog@3", "--db", db)
    one_line_error(r, "no program")
    r = hk("replay", trace, "--policy", "nosuchprog@x3", "--db", db)
    one_line_error(r, "not a policy version")
    bad = tmp_path / "bad.json"
    bad.write_text('{"tcache_kap": 4}')
    one_line_error(hk("replay", trace, "--policy", bad), "unknown knob 'tcache_kap'")
    bad.write_text('{"tcache_cap": [1, 2]}')
    one_line_error(hk("replay", trace, "--policy", bad), "tcache_cap must be")
    bad.write_bytes(b"\x08\x99\xff\xff garbage")
    one_line_error(hk("replay", trace, "--policy", bad), "not a hakmem policy file")
    # A corrupt trace: one line with the byte offset of the bad chunk.
    data = pathlib.Path(trace).read_bytes()
    cut = tmp_path / "cut.hktrace"
    cut.write_bytes(data[: len(data) // 2])
    one_line_error(hk("replay", cut), "cut short", "at byte ")
    junk = tmp_path / "junk.hktrace"
    junk.write_bytes(b"HKTRACE1" + b"\xff" * 64)
    one_line_error(hk("replay", junk), "at byte 8")
    # --partial replays what is valid.
    r = hk("replay", cut, "--partial", "--repeat", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 0 < out["replayer"]["trace"]["events"] < 600000


# ---- one replay ---------------------------------------------------------------------
def test_replayer_failures_pass_through_as_one_line(trace, tmp_path):
    """What the replayer says when it refuses (its one line), a replayer that
    dies without a word, and one whose output is not its JSON: one line each."""
    cases = {"refuses": 'echo "hakmem-replay: error: $TRACE: chunk 3 is damaged at byte 1234" >&2; exit 1',
             "dies": "kill -9 $$",
             "garbage": "echo '{\"runs\": '; exit 0"}
    want = {"refuses": ": chunk 3 is damaged at byte 1234", "dies": "hakmem-replay: exit status -9",
            "garbage": "is not the JSON it promises"}
    for name, body in cases.items():
        exe = tmp_path / f"replay-{name}"
        exe.write_text(f'#!/bin/sh\nfor a; do TRACE=$a; done\n{body}\n')
        exe.chmod(0o755)
        r = hk("replay", trace, "--repeat", "1", env=env_for(HAKMEM_REPLAY=str(exe)))
        one_line_error(r, want[name])
        if name == "refuses":
            assert r.stderr == f"hakmem: error: {trace}: chunk 3 is damaged at byte 1234\n", r.stderr


def test_one_replay_reports_and_stores(trace, tmp_path):
    db = tmp_path / "learn.db"
    r = hk("replay", trace, "--repeat", "2", "--json", "--db", db)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["replayer"]["trace"]["events"] == 600000
    assert len(out["replayer"]["runs"]) == 2
    res = out["result"]
    assert res["cost"] > 0 and res["peak_rss_bytes"] > 0 and res["repeat"] == 2
    assert out["replayer"]["policy"]["tcache_cap"][CLS64] == 1024        # the default, as in force
    pol = tmp_path / "p.json"
    pol.write_text(json.dumps({"tcache_cap": 4096, "tcache_batch": 256}))     # every class, fitted to its bounds
    r2 = hk("replay", trace, "--repeat", "2", "--json", "--db", db, "--policy", pol)
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["replayer"]["policy"]["tcache_cap"][CLS64] == 4096
    assert db_rows(db, "SELECT count(*), count(DISTINCT knobs_hash) FROM replay_runs") == [(2, 2)]
    text = hk("replay", trace, "--repeat", "2", "--db", db)
    assert text.returncode == 0 and "stored result" in text.stdout and "peak RSS" in text.stdout, text.stdout
    # A single replay promoted, then replayed again by its stored name PROGRAM@VERSION.
    r3 = hk("replay", trace, "--repeat", "2", "--db", db, "--policy", pol, "--promote")
    assert r3.returncode == 0 and "promoted: v1 (replay)" in r3.stdout, (r3.stdout, r3.stderr)
    r4 = hk("replay", trace, "--repeat", "1", "--json", "--db", db, "--policy", "workload@1")
    assert r4.returncode == 0, r4.stderr
    out4 = json.loads(r4.stdout)
    assert out4["label"] == "workload@v1" and out4["replayer"]["policy"]["tcache_cap"][CLS64] == 4096
    one_line_error(hk("replay", trace, "--db", db, "--policy", "workload@7"), "no policy version 7")



def test_costs_are_priced_as_learnd_prices_them_stored_results_too(trace, tmp_path):
    """A fault and an OS call cost what they measure on this machine
    (objective.Prices.calibrate, as hakmem-learnd's screening prices them),
    not the fixed defaults: with those a replay here ranked policies unlike
    learnd's screening of the same trace. A result found in the store is
    priced again from its stored runs at this run's prices."""
    from hakmem import replay as R
    from hakmem.objective import Objective, Prices
    db = tmp_path / "learn.db"
    facts = R.trace_facts(str(trace))
    for n in range(2):
        r = hk("replay", trace, "--repeat", "2", "--json", "--db", db)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["result"]["stored"] is (n == 1)
        prices = Prices(**out["prices"])
        assert prices != Prices(), "the fixed defaults, not this machine's prices"
        assert out["objective"] == Objective().describe()
        want = R.result_of(out["replayer"], out["result"]["knobs"], facts, Objective(), prices)
        assert out["result"]["time_cost"] == pytest.approx(want.time_cost, rel=1e-9)
        assert out["result"]["cost"] == pytest.approx(want.cost, rel=1e-9)
    text = hk("replay", trace, "--repeat", "2", "--db", db)
    assert text.returncode == 0 and "a fault " in text.stdout and "(measured here)" in text.stdout, text.stdout

# ---- the sweep ------------------------------------------------------------------------
def test_grid_sweep_beats_the_default_stores_every_result_and_resumes(trace, tmp_path):
    db, png = tmp_path / "learn.db", tmp_path / "pareto.png"
    t0 = time.monotonic()
    r = hk("replay", trace, "--sweep", "--repeat", "3", "--jobs", "2", "--json", "--db", db,
           "--png", png, timeout=90)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    n = len(out["results"])
    # The default; the one hot class's cap x1/4, x2, x4 (x16 is over the max); 3 drains; 2 retains.
    assert n == 9, [x["label"] for x in out["results"]]
    assert out["trace"]["hot_classes"] == [CLS64]
    assert out["replayed"] == n            # each policy once, the default included
    best, default = out["best"], out["default"]
    # The bursts of 2000 overflow the default cap of 1024: a bigger cap wins, beyond the spread.
    assert best["policy"]["tcache_cap"][CLS64] >= 2048, best
    assert best["cost"] < default["cost"] * (1 - max(best["spread"], default["spread"])), (best, default)
    assert out["beats_default"] is True
    assert any(x["pareto"] for x in out["results"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    assert db_rows(db, "SELECT count(*) FROM replay_runs") == [(n,)]
    assert took < scaled(60), took
    # A rerun replays nothing; with two results lost, it replays those two.
    again = json.loads(hk("replay", trace, "--sweep", "--repeat", "3", "--json", "--db", db).stdout)
    assert again["replayed"] == 0 and len(again["results"]) == n
    con = sqlite3.connect(db)
    con.execute("DELETE FROM replay_runs WHERE id IN (SELECT id FROM replay_runs ORDER BY id DESC LIMIT 2)")
    con.commit()
    con.close()
    again = json.loads(hk("replay", trace, "--sweep", "--repeat", "3", "--json", "--db", db).stdout)
    assert again["replayed"] == 2, again["replayed"]
    # The table for a person.
    text = hk("replay", trace, "--sweep", "--repeat", "3", "--db", db)
    assert text.returncode == 0 and "beats the default beyond the spread" in text.stdout, text.stdout
    assert "cap[64B]=" in text.stdout and "vs default" in text.stdout


def test_ctrl_c_keeps_what_is_stored_and_a_rerun_finishes(tmp_path):
    big = bursts_trace(tmp_path / "big.hktrace", bursts=60)
    db = tmp_path / "learn.db"
    p = subprocess.Popen([sys.executable, "-m", "hakmem", "replay", str(big), "--sweep", "--repeat", "30", "--jobs",
                          "1", "--db", str(db)], cwd=ROOT / "learner", env=env_for(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def stored():
        try:
            return db_rows(db, "SELECT count(*) FROM replay_runs")[0][0] >= 1
        except sqlite3.Error:
            return False
    wait_for(stored, 60, "a first result stored")
    os.killpg(p.pid, signal.SIGINT)        # what a terminal's Ctrl-C does: the whole group
    out, err = p.communicate(timeout=scaled(30))
    assert p.returncode == 130, (p.returncode, err)
    assert "interrupted" in err and "run the same command again" in err, err
    kept = db_rows(db, "SELECT count(*) FROM replay_runs")[0][0]
    assert 1 <= kept < 9
    assert db_rows(db, "PRAGMA integrity_check") == [("ok",)]
    r = hk("replay", big, "--sweep", "--repeat", "30", "--jobs", "2", "--json", "--db", db,
           timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["replayed"] == 9 - kept and len(out["results"]) == 9


def test_learner_sweep_is_the_learners_own_search(trace, tmp_path):
    db = tmp_path / "learn.db"
    r = hk("replay", trace, "--sweep", "learner", "--budget", "5", "--repeat", "3", "--json", "--db",
           db, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 2 <= len(out["results"]) <= 5
    assert {x["label"] for x in out["results"]} > {"default"}
    assert db_rows(db, "SELECT count(*) FROM replay_runs") == [(len(out["results"]),)]
    # The same seed, the same search (from the store now: nothing replayed).
    again = json.loads(hk("replay", trace, "--sweep", "learner", "--budget", "5", "--repeat", "3",
                          "--json", "--db", db).stdout)
    assert again["replayed"] == 0
    assert [x["knobs_hash"] for x in again["results"]] == [x["knobs_hash"] for x in out["results"]]
    # At the prices it began with: calibrated afresh they move a few percent
    # between runs, and the search's picks with them.
    assert out["prices"]["source"] == "measured here"
    assert again["prices"] == dict(out["prices"], source="as when this search began")
    # A stored price no machine measures is not searched at: measured afresh.
    with sqlite3.connect(db) as c:
        for (rowid, res) in c.execute("SELECT rowid, result FROM replay_runs").fetchall():
            c.execute("UPDATE replay_runs SET result = ? WHERE rowid = ?",
                      (json.dumps(dict(json.loads(res), _prices={"fault_s": -1.0, "syscall_s": 2e-6})), rowid))
    third = json.loads(hk("replay", trace, "--sweep", "learner", "--budget", "5", "--repeat", "3",
                          "--json", "--db", db, timeout=120).stdout)
    assert third["prices"]["source"] == "measured here"


# ---- --promote, applied by a real hakmem-learnd ------------------------------------------------
def captured_trace(path, seconds=0.05):
    """A trace libhakmem captured (HAKMEM_TRACE) from the preloaded workload's
    bursts of 2000 64-byte blocks."""
    w = subprocess.run([str(WORKLOAD), "burst", "64", "2000", str(seconds)], capture_output=True, text=True,
                       env=clean_env(LD_PRELOAD=str(LIB), HAKMEM_TRACE=str(path)), timeout=scaled(30))
    assert w.returncode == 0, w.stderr
    return path


def test_promoted_policy_is_applied_by_learnd_at_the_next_start(tmp_path):
    """A trace captured from the workload, swept; its best promoted; a real
    learnd then applies it to the next run of the workload."""
    trace = captured_trace(tmp_path / "captured.hktrace")
    db = tmp_path / "learn.db"
    r = hk("replay", trace, "--sweep", "--repeat", "3", "--json", "--db", db, "--promote", timeout=90)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    promoted = out["promoted"]
    assert out["beats_default"] is True, (out["best"], out["default"])
    assert promoted["origin"] == "replay"
    assert promoted["knobs"]["tcache_cap"][CLS64] == out["best"]["policy"]["tcache_cap"][CLS64] >= 2048
    exe = os.path.realpath(WORKLOAD)
    assert promoted["program"] == f"{exe}@{elf_build_id(str(WORKLOAD))}#{os.getuid()}"
    assert db_rows(db, "SELECT p.origin, p.knobs FROM programs g JOIN policies p ON p.id = g.best_policy") == \
        [("replay", json.dumps(promoted["knobs"], separators=(",", ":")))]
    # A real learnd, private directories, and the program started under it.
    shm, run = tmp_path / "shm", tmp_path / "run"
    log = open(tmp_path / "learnd.log", "w")
    d = subprocess.Popen([sys.executable, "-m", "hakmem.daemon", "--foreground", "--db", str(db), "--shm-dir",
                          str(shm), "--run-dir", str(run), "--sample-period", "0.5", "--learner", "static"],
                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env_for())
    text = lambda: (tmp_path / "learnd.log").read_text()  # noqa: E731
    try:
        wait_for(lambda: "ready:" in text() or d.poll() is not None, 30, "learnd ready")
        assert d.poll() is None, text()
        w = start(["burst", 64, 2000, scaled(3)], shm)
        with Ring(ring_path(shm, w.pid, timeout=5)) as ring:
            wait_for(lambda: ring.status()["applied_version"] > 0, 5, lambda: f"a policy applied:\n{text()}")
            in_force = ring.policy_in_force()
        in_force.pop("version", None)
        assert in_force == promoted["knobs"], (in_force["tcache_cap"][CLS64], promoted["knobs"]["tcache_cap"][CLS64])
        w.communicate(timeout=scaled(30))
        wait_for(lambda: "warm_start" in text(), 5, text)
        assert "(replay)" in text(), text()[-2000:]
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(scaled(20))
        log.close()
