"""learning.py's Context.clamp: whatever a learner proposes, the policy it
sends is one the allocator accepts (hk_policy_set and the snapshot check
reject a policy whole when any value is out of bounds: batch above the
capacity included)."""
import pytest

from hakmem import layout as L
from hakmem.learning import Context, canonical
from hakmem.objective import Objective

C = L.NUM_CLASSES


def ctx():
    sizes = (0,) + tuple(16 * c for c in range(1, C))
    return Context(program="t", class_size=sizes, cap_max=(0,) + (4096,) * (C - 2) + (8,),
                   warm_max=(0,) + (64,) * (C - 1), batch_max=1024, drain_ms_max=3600000,
                   default={"drain_ms": 1000, "tcache_cap": [0] + [64] * (C - 1),
                            "tcache_batch": [0] + [32] * (C - 1), "warm_slabs": [0] + [1] * (C - 1)},
                   objective=Objective())


def valid(k, cx):
    if not 0 <= k["drain_ms"] <= cx.drain_ms_max:
        return False
    for c in range(1, C):
        cap, batch, warm = k["tcache_cap"][c], k["tcache_batch"][c], k["warm_slabs"][c]
        if not (0 <= cap <= cx.cap_max[c] and 1 <= batch <= min(cx.batch_max, max(cap, 1))
                and 0 <= warm <= cx.warm_max[c]):
            return False
    return all(k[n][0] == 0 for n in L.KNOBS_PER_CLASS)


def test_clamp_keeps_batch_within_a_lowered_capacity():
    cx = ctx()
    k = canonical(cx.default)
    k["tcache_cap"][5] = 4            # a step down from 64 ...
    k["tcache_batch"][5] = 32         # ... that kept the old batch
    k["tcache_cap"][6] = 0            # no cache at all: batch 1
    k["tcache_batch"][6] = 32
    k["tcache_cap"][C - 1] = 100      # past the class's own bound (8)
    k["tcache_batch"][C - 1] = 50
    out = cx.clamp(k)
    assert (out["tcache_cap"][5], out["tcache_batch"][5]) == (4, 4)
    assert (out["tcache_cap"][6], out["tcache_batch"][6]) == (0, 1)
    assert (out["tcache_cap"][C - 1], out["tcache_batch"][C - 1]) == (8, 8)
    assert valid(out, cx)


def test_clamp_brings_every_value_into_bounds():
    cx = ctx()
    k = {"drain_ms": 10**9, "tcache_cap": [7] + [10**6] * (C - 1), "tcache_batch": [7] + [0] * (C - 1),
         "warm_slabs": [7] + [-3] * (C - 1)}
    out = cx.clamp(k)
    assert valid(out, cx)
    assert out["drain_ms"] == cx.drain_ms_max
    assert out["tcache_cap"][1:] == tuple(cx.cap_max[1:])      # Knobs: per-class values are tuples
    assert out["warm_slabs"][1:] == (0,) * (C - 1)
    assert cx.clamp(out) == out       # clamping twice changes nothing


# ---- Window: every counter of the layout, merged and stored in one place ----------
import numpy as np  # noqa: E402

from hakmem.learning import Window  # noqa: E402


def record(index, t_ns, scale):
    """A telemetry record whose every counter is scale times (its position + 1)."""
    r = np.zeros(1, dtype=L.RECORD)[0]
    r["index"], r["time_ns"] = index, t_ns
    for i, n in enumerate(L.CLASS_COUNTERS):
        r["cls"][n] = np.arange(C) * scale * (i + 1)
    for i, n in enumerate(L.PROC_COUNTERS):
        r["proc"][n] = scale * (i + 1)
    return r


def test_window_between_records_has_every_counter_as_a_rate_or_a_gauge():
    a, b = record(1, 0, 1), record(5, 10**9, 3)
    w = Window.between(a, b, 2.0, t_start=10.0, t_end=12.0, minflt=4.0, rss_bytes=100.0)
    assert w.active and set(w.cls) == set(L.CLASS_COUNTERS) and set(w.proc) == set(L.PROC_COUNTERS)
    for i, n in enumerate(L.CLASS_COUNTERS):
        want = np.arange(C) * 3 * (i + 1) if n in L.GAUGES else np.arange(C) * 2 * (i + 1) / 2.0
        assert np.allclose(w.cls[n], want), n
        assert getattr(w, n) is w.cls[n]
    assert w.os_calls == sum((3 - 1) * (L.PROC_COUNTERS.index(n) + 1) / 2.0
                             for n in ("mmap_calls", "munmap_calls", "madvise_calls"))
    assert w.threads == 3 * (L.PROC_COUNTERS.index("threads") + 1)        # a gauge, at b
    # A counter never goes back: below zero is zero.
    back = Window.between(b, record(6, 2 * 10**9, 1), 1.0)
    assert all((back.cls[n] >= 0).all() for n in L.CLASS_COUNTERS if n not in L.GAUGES)
    # No newer record: gauges only, not active.
    idle = Window.between(b, b, 1.0)
    assert not idle.active and idle.allocs.sum() == 0 and idle.live_bytes.sum() == b["cls"]["live_bytes"].sum()
    assert Window.between(None, None, 1.0).allocs.sum() == 0


def test_merge_sums_processes_and_row_has_every_counter_by_name():
    k = {"drain_ms": 1000, "tcache_cap": [0] + [64] * (C - 1), "tcache_batch": [0] + [32] * (C - 1),
         "warm_slabs": [0] + [1] * (C - 1)}
    a = Window.between(record(1, 0, 1), record(2, 10**9, 2), 1.0, t_start=0, t_end=1, knobs=k, minflt=1,
                       rss_bytes=10, cpu=0.5)
    b = Window.between(None, None, 1.0, t_start=0, t_end=1, knobs=k, minflt=2, rss_bytes=20, cpu=0.25)
    m = Window.merge([a, b])
    assert m.processes == 2 and m.active and m.knobs == k
    assert (m.minflt, m.rss_bytes, m.cpu) == (3, 30, 0.75)
    for n in L.CLASS_COUNTERS:
        assert np.allclose(m.cls[n], a.cls[n] + b.cls[n])
    assert Window.merge([a, b.replace(knobs=None)]).knobs is None        # a transition in one: in none
    row = m.replace(time_cost=1.0, mem_cost=2.0, cost=3.0).row()
    assert set(L.CLASS_COUNTERS) | set(L.PROC_COUNTERS) <= set(row)
    assert row["allocs"] == float(m.allocs.sum()) and row["committed_bytes"] == m.committed_bytes
    assert (row["cost"], row["os_calls"], row["rss_bytes"]) == (3.0, m.os_calls, 30)
    assert row["mix"].dtype == np.float32 and np.allclose(row["mix"], m.allocs)


def test_window_takes_counters_by_keyword_and_refuses_unknown_ones():
    w = Window(0, 1, None, 1, allocs=np.ones(C), threads=4, os_calls=2.0)
    assert w.allocs.sum() == C and w.refills.sum() == 0 and w.threads == 4 and w.os_calls == 2.0
    import pytest
    with pytest.raises(TypeError, match="unknown counter"):
        Window(0, 1, None, 1, alloc=np.ones(C))


def test_the_program_pays_for_the_pages_its_threads_give_back_and_not_for_the_decay_threads_calls():
    """A 64 MiB burst given back as its slabs empty (warm=0: ~3,500 madvise
    calls on the thread that frees) against the same pages given back by
    the decay thread a moment later (drain=100: ~400 calls, all but a few
    its own): bench-learn's spikes ran 18% dearer under the first, and a cost
    that priced calls alone ranked the two alike. Live windows (from /proc)
    and replays are priced the same way."""
    from hakmem.objective import Prices, window_time_cost
    from hakmem.procfs import PAGE
    from hakmem.replay import TraceFacts, run_cost
    prices = Prices(fault_s=1e-6, syscall_s=2e-6, zap_s=1e-7)
    burst = 64 << 20
    inline = Window(0, 1, madvise_calls=3500, returned_bytes=burst, minflt=16384)
    decay = Window(0, 1, madvise_calls=400, decay_syscalls=390, minflt=16384)
    assert window_time_cost(inline, prices) == pytest.approx(16384 * 1e-6 + 3500 * 2e-6 + burst / PAGE * 1e-7)
    assert window_time_cost(decay, prices) == pytest.approx(16384 * 1e-6 + 10 * 2e-6)
    facts = TraceFacts(path="t", hash="h", exe="e", build_id="", uid=0, class_size=[], duration_s=2.0,
                       allocs=np.zeros(L.NUM_CLASSES), events=1, mode="full")
    obj = Objective(lam=0.0)

    def run(calls, decay_calls, returned):
        return {"os_calls": {"mmap": 0, "munmap": 0, "madvise": calls}, "minflt": 16384, "mean_rss_bytes": 0,
                "counters": {"slow_ns": [0, 1000], "decay_syscalls": decay_calls, "returned_bytes": returned}}
    t_inline = run_cost(run(3500, 0, burst), facts, obj, prices)[0]
    t_decay = run_cost(run(400, 390, 0), facts, obj, prices)[0]
    assert t_inline == pytest.approx((1000e-9 + 16384 * 1e-6 + 3500 * 2e-6 + burst / PAGE * 1e-7) / 2)
    assert t_decay == pytest.approx((1000e-9 + 16384 * 1e-6 + 10 * 2e-6) / 2)
    # A replayer before layout 6 reports neither counter: its calls alone.
    old = run(3500, 0, 0)
    del old["counters"]["decay_syscalls"], old["counters"]["returned_bytes"]
    assert run_cost(old, facts, obj, prices)[0] == pytest.approx((1000e-9 + 16384 * 1e-6 + 3500 * 2e-6) / 2)


def test_a_page_given_back_in_a_large_call_is_priced_below_a_call_of_its_own():
    from hakmem.objective import Prices
    p = Prices.calibrate()
    assert 0 < p.zap_s < p.syscall_s, p
