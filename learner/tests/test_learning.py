"""learning.py's Context.clamp: whatever a learner proposes, the policy it
sends is one the allocator accepts (hk_policy_set and the snapshot check
reject a policy whole when any value is out of bounds: batch above the
capacity included)."""
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
    assert out["tcache_cap"][1:] == list(cx.cap_max[1:])
    assert out["warm_slabs"][1:] == [0] * (C - 1)
    assert cx.clamp(out) == out       # clamping twice changes nothing
