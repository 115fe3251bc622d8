"""`hakmem replay --learner NAME PROGRAM`: a program's stored window history,
recorded by a real hakmem-learnd from a real preloaded workload, fed back
through a learner offline. It is deterministic (the same seed, the same
decisions), and it guards learners' behaviour on that history: on bursts of
4000 64-byte blocks (the default cache holds 1024) the miss-driven baseline
grows that class's cache at its first window
under one policy, and the GP learner, after
measuring the default, proposes a bigger cache for it."""
import json
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env, scaled, start, wait_for
from test_replay_cli import CLS64, db_rows


def record(tmp, learner, seconds=4):
    """A learn.db with a few seconds of a bursty program's windows, as
    learnd running `learner` stored them."""
    db, shm, run = tmp / "learn.db", tmp / "shm", tmp / "run"
    log = open(tmp / "learnd.log", "w")
    d = subprocess.Popen([sys.executable, "-m", "hakmem.daemon", "--foreground", "--db", str(db), "--shm-dir",
                          str(shm), "--run-dir", str(run), "--sample-period", "0.5", "--learner", learner],
                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=clean_env())
    text = lambda: (tmp / "learnd.log").read_text()  # noqa: E731
    try:
        wait_for(lambda: "ready:" in text() or d.poll() is not None, 30, "learnd ready")
        assert d.poll() is None, text()
        w = start(["burst", 64, 4000, seconds], shm)
        w.communicate(timeout=scaled(30))
        wait_for(lambda: f"process_exited workload[{w.pid}]" in text(), 10, text)
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(scaled(20))
        log.close()
    assert db_rows(db, "SELECT count(*) FROM windows")[0][0] >= 5
    return db


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Measured under the default policy by learnd's static learner."""
    return record(tmp_path_factory.mktemp("static"), "static")


def hk(*args):
    """`hakmem` (learner replay needs no replayer)."""
    return subprocess.run([sys.executable, "-m", "hakmem", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT / "learner", timeout=scaled(60), env=clean_env())


def replay(recorded, *args):
    r = hk("replay", "--learner", *args, "workload", "--db", recorded, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_same_seed_gives_the_same_decisions(recorded):
    a, b = replay(recorded, "gp", "--seed", "3"), replay(recorded, "gp", "--seed", "3")
    assert a["steps"] == b["steps"] and a["windows"] >= 5
    assert a["live_changes"] == 0            # learnd's static learner kept the default


def test_missdriven_grows_the_bursty_class_at_its_first_window(recorded):
    out = replay(recorded, "missdriven")
    first = next(s for s in out["steps"] if s["decision"])
    measured = next(s for s in out["steps"] if s["live_version"])      # the first window under one policy
    assert first["step"] == measured["step"], out["steps"][:4]
    assert first["decision"]["knobs"]["tcache_cap"][CLS64] == 2048, first["decision"]
    assert "grow cap@64B 1024->2048" in first["decision"]["reason"]


def test_gp_measures_the_default_then_proposes_a_bigger_cache_for_the_bursty_class(recorded):
    out = replay(recorded, "gp")
    decided = [s for s in out["steps"] if s["decision"]]
    assert decided, out["steps"]
    first = decided[0]
    assert first["step"] >= 3, "the default is measured for its warm-up windows first"
    assert first["decision"]["kind"] == "explore"
    assert first["decision"]["knobs"]["tcache_cap"][CLS64] > 1024, first["decision"]


def test_text_output_and_bad_names(recorded):
    db = recorded
    r = hk("replay", "--learner", "missdriven", "workload", "--db", db)
    assert r.returncode == 0 and "would" in r.stdout and "grow cap@64B" in r.stdout, r.stdout
    r = hk("replay", "--learner", "nosuch", "workload", "--db", db)
    assert r.returncode == 1 and r.stderr.startswith("hakmem: error: unknown learner 'nosuch'"), r.stderr
    r = hk("replay", "--learner", "gp", "nosuchprogram", "--db", db)
    assert r.returncode == 1 and "no program matches" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_missdriven_replayed_on_its_own_live_history_decides_what_it_decided_live(tmp_path):
    """learnd ran the miss-driven learner live; replayed offline on the
    windows it stored, the same learner proposes the same policies, in the
    same order, as the ones that went live."""
    db = record(tmp_path, "missdriven", seconds=3)
    out = replay(db, "missdriven")
    live = []
    for s in out["steps"]:
        if s["live_version"] and (not live or live[-1] != s["live_version"]):
            live.append(s["live_version"])
    proposed = [s["decision"]["stored_version"] for s in out["steps"] if s["decision"]]
    assert len(live) >= 2, out["steps"]           # the default, then at least one change live
    assert proposed[:len(live) - 1] == live[1:], (proposed, live)
    caps = [s["decision"]["knobs"]["tcache_cap"][CLS64] for s in out["steps"] if s["decision"]]
    assert caps[:2] == [2048, 4096][:len(caps[:2])], caps
