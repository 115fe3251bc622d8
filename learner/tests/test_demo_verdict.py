"""make demo's verdict (tools/demo_redis.py): a difference is claimed only
where the rounds separate, and noise is never printed as a gain."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("demo_redis", ROOT / "tools" / "demo_redis.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)


def test_overlapping_rounds_are_no_difference_and_show_no_change():
    # The shape of the run issue 39 quotes: medians 30% apart, rounds spread 88%.
    word, change = demo.verdict([100_000, 190_000, 140_000], [131_000, 150_000, 145_000])
    assert word == "no difference beyond noise"
    assert change is None


def test_separated_rounds_are_a_difference_with_its_size():
    word, change = demo.verdict([100, 101, 102], [110, 111, 112])
    assert word == "higher"
    assert abs(change - (111 / 101 - 1)) < 1e-9
    word, change = demo.verdict([100, 101, 102], [90, 91, 92])
    assert word == "lower"
    assert change < 0


def test_one_shared_value_is_not_a_separation():
    assert demo.verdict([100, 105, 110], [110, 120, 130])[0] == "no difference beyond noise"


def test_fewer_than_three_rounds_a_side_claim_nothing():
    # Separated, but 1 round a side always separates and 2 do 1 time in 3.
    assert demo.verdict([100], [200]) == ("too few rounds to tell (3 a side at least)", None)
    assert demo.verdict([100, 101], [200, 201])[1] is None


def test_empty_rounds_say_so():
    assert demo.verdict([], [1.0]) == ("not measured", None)


@pytest.mark.parametrize("tool", ["demo_redis.py", "demo_sqlite.py"])
def test_the_default_kept_means_nothing_is_compared(tool):
    # The comparison's code must stop before it starts a run when learnd's
    # best is the default: a "learned" run would be the default again.
    src = (ROOT / "tools" / tool).read_text()
    i = src.index("if best_is_default:")
    j = src.index('runs = {"default": [], "learned": []}')
    assert i < j and "return" in src[i:j]


def test_the_closing_table_shows_a_change_only_beside_a_difference():
    def rnd(set_rps, get_rps, rss_kib):
        return ({"SET": (set_rps, 0), "GET": (get_rps, 0)}, rss_kib)
    runs = {"default": [rnd(100_000, 150_000, 90 << 10), rnd(190_000, 151_000, 91 << 10),
                        rnd(140_000, 152_000, 92 << 10)],
            "learned": [rnd(131_000, 160_000, 80 << 10), rnd(150_000, 161_000, 81 << 10),
                        rnd(145_000, 162_000, 82 << 10)]}
    lines = demo.comparison(runs)
    by = {ln.split()[0]: ln for ln in lines[1:]}
    assert lines[0].startswith("median of 3")
    assert by["SET"].endswith("no difference beyond noise") and "%" not in by["SET"]
    assert "higher +6.6%" in by["GET"]          # 161k against 151k, every round beyond
    assert "lower -11.0%" in by["resident"]     # 81 against 91 MiB
    assert "100,000-190,000; 131,000-150,000" in by["SET"]
    assert "by chance 10% of the time" in lines[-1]


def test_every_target_that_starts_learnd_builds_the_replayer_and_hakmem_bpf(tmp_path):
    """A fresh clone has neither: learnd then screened nothing and read the
    kernel's side from /proc, so `make bench-learn` on a fresh clone measured
    a learnd no installed one is (found in a fresh-clone run at 167b91e)."""
    import subprocess
    btf = pathlib.Path("/sys/kernel/btf/vmlinux").exists()
    for target in ("demo", "demo-redis", "demo-synthetic", "bench-learn", "bench-learn-quick", "bench-learn-real",
                   "bench-learn-real-quick"):
        r = subprocess.run(["make", "-n", f"BUILD={tmp_path}", target], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert f"{tmp_path}/hakmem-replay" in r.stdout, target
        if btf:
            assert f"{tmp_path}/hakmem-bpf" in r.stdout, target
