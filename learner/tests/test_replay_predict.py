"""bench/replay_predict.py, the measure of issue 14's target: its ranks and
tiers are right, a grid point the allocator would refuse fails the run
instead of measuring the default under its name, and a small end-to-end run
(live runs, a real capture, real replays) produces a complete report."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import BUILD, ROOT, clean_env, scaled

spec = importlib.util.spec_from_file_location("replay_predict", ROOT / "bench" / "replay_predict.py")
RP = importlib.util.module_from_spec(spec)
spec.loader.exec_module(RP)


def test_spearman_plain_and_with_ties():
    assert RP.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert RP.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Average ranks for ties: [1.5, 1.5, 3] against [1, 2, 3].
    assert RP.spearman([0, 0, 1], [1, 2, 3]) == pytest.approx(0.8660254, abs=1e-6)
    # Rounding over tied ranks gave 1.0000000000000002 here: never past 1.
    assert RP.spearman([1, 3, 1, 4], [1, 3, 1, 4]) == 1.0


def test_tiers_join_overlapping_runs_and_split_distinct_ones():
    # Policies 0 and 1 overlap (a cap the program never fills); 2 and 3 stand apart.
    medians = [1.00, 1.01, 2.0, 3.0]
    runs = [[0.95, 1.00, 1.05], [0.99, 1.01, 1.03], [1.9, 2.0, 2.1], [2.9, 3.0, 3.1]]
    assert RP.tiers(medians, runs) == [0, 0, 1, 2]
    # Order of input does not matter: tiers follow the medians.
    assert RP.tiers(medians[::-1], runs[::-1]) == [2, 1, 0, 0]
    # Not chained: the third overlaps the second but not the tier's first.
    assert RP.tiers([1.0, 1.05, 1.10], [[0.98, 1.02], [1.01, 1.09], [1.08, 1.12]]) == [0, 0, 1]
    # One noisy policy does not merge a cheap and a dear group.
    assert RP.tiers([1.0, 1.2, 1.4, 1.41], [[0.99, 1.01], [0.95, 1.45], [1.39, 1.41], [1.40, 1.42]]) == [0, 0, 1, 1]
    # Two runs: their range is what overlaps.
    assert RP.tiers([1.0, 1.2], [[0.9, 1.1], [1.15, 1.25]]) == [0, 1]


def test_verdict_applies_the_target_only_where_live_has_a_ranking():
    assert RP.verdict({"rho_tiers": 0.9, "live_tiers": 4}) == "met"
    assert RP.verdict({"rho_tiers": 0.5, "live_tiers": 4}) == "NOT met"
    assert RP.verdict({"rho_tiers": 0.9, "live_tiers": 2}) == "met"
    assert RP.verdict({"rho_tiers": float("nan"), "live_tiers": 1}).startswith("no ranking live")
    assert RP.verdict({"rho_tiers": None, "live_tiers": 4}) == "-"


def test_grid_stays_within_what_the_allocator_accepts():
    from hakmem import _layout as L
    for label, knobs in RP.GRID:
        for k, v in knobs.items():
            spec = next(s for s in L.KNOBS if s["env"] == k)
            top = spec["max"]["hi"] if isinstance(spec["max"], dict) else spec["max"]
            assert spec["min"] <= v <= top, (label, k, v)


def test_a_refused_knob_fails_the_run(tmp_path):
    """The allocator keeps the default for an out-of-range value and warns:
    a grid point measured that way would be the default under another name."""
    from hakmem import _layout as L
    with pytest.raises(RP.SetupError, match="allocator said"):
        RP.live("burst", {"HAKMEM_WARM_SLABS": L.WARM_SLABS_MAX + 1}, 0.2, tmp_path)
    m = RP.live("burst", {"HAKMEM_WARM_SLABS": L.WARM_SLABS_MAX}, 0.2, tmp_path)
    assert m["ops"] > 0 and m["busy"] > 0 and m["peak_rss_bytes"] > 0


def test_quick_run_reports_every_policy(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "replay_predict.py"), "--quick",
                        "--workloads", "burst", "--seconds", "0.3", "--capture-seconds", "0.3",
                        "--live-repeat", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=scaled(300),
                       env=clean_env(BUILD=str(BUILD), HAKMEM_PROGRESS="0"))
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "replay_predict.json").read_text())
    w = res["workloads"]["burst"]
    assert [row["policy"] for row in w["rows"]] == list(RP.QUICK_GRID)
    assert w["events"] > 1000 and w["trace_duration_s"] > 0.1
    for row in w["rows"]:
        assert len(row["live_J_runs"]) == 2 and len(row["replay_J_runs"]) == 2
        assert row["replay_J"] > 0 and row["live_J"] > 0
        # The replay ran every operation of the trace, under each policy.
        assert len(set(row["replay_ops"])) == 1 and row["replay_ops"][0] > 1000
    assert -1 <= w["rho"] <= 1 and -1 <= w["rho_tiers"] <= 1 and 1 <= w["live_tiers"] <= 5
    md = (tmp_path / "replay_predict.md").read_text()
    assert "| burst |" in md and "rho over tiers" in md
