"""make demo (tools/demo_sqlite.py): sqlite3 under a memory budget, tuned by
learnd, then the default against the learned policy measured from outside.
The closing table claims a difference only where the rounds separate; a run
called learned must have applied a policy; the short run is the whole demo
on small data."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
spec = importlib.util.spec_from_file_location("demo_sqlite", ROOT / "tools" / "demo_sqlite.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)
from hakmem.objective import Objective  # noqa: E402

MIB = 1 << 20


def run(rows_per_s, pss_mib, answers=("a", "b")):
    return {"throughput": rows_per_s, "units_per_cpu_s": rows_per_s, "pss_mean_mib": pss_mib,
            "pss_peak_mib": pss_mib * 1.2, "answers": list(answers)}


def table(runs, budget_mib=160):
    lines = demo.comparison(runs, Objective(budget_bytes=budget_mib * MIB))
    return lines, {ln.split("  ")[0].strip(): ln for ln in lines[1:6]}


def test_memory_under_the_budget_at_the_same_speed_is_lower_memory_and_no_speed_difference():
    # The shape of the run at 10:40 UTC on 2026-12-02: throughput rounds overlapping, PSS far apart.
    runs = {"default": [run(88_285, 254), run(83_077, 259), run(89_383, 253)],
            "learned": [run(95_321, 144), run(73_569, 143), run(79_467, 144)]}
    lines, by = table(runs)
    assert by["rows/s"].endswith("no difference beyond noise") and "%" not in by["rows/s"]
    assert "lower -43.3%" in by["mean PSS MiB"]
    # Over the budget the objective grows steeply: the default pays for its 95 MiB over it.
    assert " lower -" in by["objective (cores)"]
    assert "default 3 of 3 runs, learned 0 of 3" in lines[6]
    assert lines[7].endswith("yes")


def test_a_run_that_answered_differently_is_called_out():
    runs = {"default": [run(100, 200)] * 3, "learned": [run(100, 120), run(100, 120, ("a", "x")), run(100, 120)]}
    lines, _ = table(runs)
    assert lines[7].endswith("NO")


def test_the_objective_is_the_defaults_demand_under_the_budget_and_steep_past_it():
    runs = {"default": [run(100.0, 100)], "learned": [run(50.0, 100), run(100.0, 320)]}
    j = demo.costs(runs, Objective(budget_bytes=160 * MIB))
    assert j["default"] == [pytest.approx(1.0)]
    assert j["learned"][0] == pytest.approx(2.0)          # half the speed: twice the cores
    assert j["learned"][1] == pytest.approx(1.0 + 10.0)   # twice the budget: 10 cores per 100% over


def test_the_short_demo_runs_end_to_end_and_leaves_nothing_behind():
    """The whole demo on small data (a budget small data exceed): learnd
    ready, sqlite3 tuned, the policy shown, then either nothing compared
    (learnd kept the default) or every learned run under a policy learnd
    gave it, with the same answers as the default's."""
    build = ROOT / os.environ.get("BUILD", "build")
    # make test builds both first: a missing one is a broken build, not a reason to pass.
    assert (build / "libhakmem.so").exists(), f"{build}/libhakmem.so missing: make lib"
    assert (ROOT / ".venv" / "bin" / "hakmem-learnd").exists(), ".venv/bin/hakmem-learnd missing: make venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAKMEM_") and k != "LD_PRELOAD"}
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "demo_sqlite.py"), "--build", str(build), "--small", "--seconds", "40",
                        "--run-seconds", "3", "--rounds", "3", "--budget", "16MiB"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-2000:]
    assert "learnd ready" in out and "hakmem policy show sqlite3" in out
    assert "telemetry files left: 0" in out and "still running" not in out
    if "what learnd changed" in out:
        assert "Nothing: learnd's best stored policy for sqlite3 is the default" in out
        assert "median of" not in out
    else:
        learned = [ln for ln in out.splitlines() if ln.startswith("round ") and " learned " in ln]
        assert len(learned) == 3 and all("applied by cycle" in ln for ln in learned), out[-3000:]
        assert "same answers in every run (each cycle's query results hashed): yes" in out
