"""bench/run.py's target table: a measured ratio that two decimals would
round onto its target prints with three, so a row never reads "1.00×"
beside FAIL (README's `make bench` table)."""
import importlib.util
import sys

from conftest import ROOT


def load_runner():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # its dataclasses look themselves up there
    spec.loader.exec_module(mod)
    return mod


def test_a_ratio_next_to_its_target_keeps_its_side():
    run = load_runner()
    assert run.fmt_measured(0.9962, 1.00) == "0.996×"   # FAIL, not "1.00×"
    assert run.fmt_measured(1.0041, 1.00) == "1.004×"
    assert run.fmt_measured(1.0, 1.00) == "1.00×"
    assert run.fmt_measured(0.98, 1.00) == "0.98×"
    assert run.fmt_measured(1.2549, 1.25) == "1.255×"   # RSS: over its bound
    assert run.fmt_measured(1.55, 1.25) == "1.55×"
    assert run.fmt_measured(0.99975, 1.00) == "0.999×"  # not "1.000×" beside FAIL
    assert run.fmt_measured(1.00021, 1.00) == "1.001×"
