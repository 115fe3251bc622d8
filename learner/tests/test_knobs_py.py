"""hakmem.knobs: the Knobs type, its bounds, its forms (dict, protobuf, policy
slot) and the default batch rule, all from the layout. (allocator/tests/
test_knobs.c is the allocator's side.)"""
import json

import pytest

from hakmem import _layout
from hakmem import layout as L
from hakmem.knobs import ORDER, PER_CLASS, PER_PROCESS, Bounds, Knobs, KnobsError, default_batch

C = L.NUM_CLASSES


def header():
    return {"cap_max": [0] + [4096] * (C - 2) + [8], "warm_max": [0] + [64] * (C - 1), "batch_max": 1024,
            "drain_ms_max": 3600000, "retain_mib_max": 65536, "class_size": [16 * c for c in range(C)]}


def default():
    return {"drain_ms": 1000, "tcache_cap": [0] + [64] * (C - 1), "tcache_batch": [0] + [32] * (C - 1),
            "warm_slabs": [0] + [1] * (C - 1)}


def test_names_and_rules_come_from_the_layout():
    assert set(ORDER) == {k["name"] for k in _layout.KNOBS}
    assert PER_CLASS == L.KNOBS_PER_CLASS == tuple(k["name"] for k in _layout.KNOBS if k["per_class"])
    assert ORDER == PER_PROCESS + PER_CLASS and ORDER[0] == "drain_ms"   # the store's JSON key order
    # min(cap/2, 256), at least 1, at most the header's batch_max
    assert [default_batch(c) for c in (0, 1, 2, 3, 64, 512, 513, 4096)] == [1, 1, 1, 1, 32, 256, 256, 256]
    assert default_batch(4096, 100) == 100
    b = Bounds.from_header(header())
    assert b.lo == {"drain_ms": 0, "retain_mib": 0, "tcache_cap": 0, "tcache_batch": 1, "warm_slabs": 0}
    assert b.hi["retain_mib"] == 65536
    assert b.hi["tcache_batch"] == (1024,) * C and b.hi["drain_ms"] == 3600000


def test_knobs_are_immutable_hashable_and_read_like_the_dict_form():
    k = Knobs(default())
    assert k["tcache_cap"][3] == k.tcache_cap[3] == 64 and k.drain_ms == 1000
    assert list(k) == list(ORDER) and dict(k)["drain_ms"] == 1000
    with pytest.raises(AttributeError):
        k.drain_ms = 5
    with pytest.raises(TypeError):
        k["tcache_cap"][3] = 1
    with pytest.raises(TypeError):
        k["drain_ms"] = 1
    assert k == default() and k == Knobs(default()) and hash(k) == hash(Knobs(default()))
    assert len({k, Knobs(default())}) == 1
    assert Knobs.of(k) is k
    assert Knobs({**default(), "version": 7}) == k            # a slot's version is not a knob
    k2 = k.replace(drain_ms=5, tcache_cap={3: 100})
    assert (k2.drain_ms, k2.tcache_cap[3], k2.tcache_cap[4], k.tcache_cap[3]) == (5, 100, 64, 64)
    assert k2 != k
    with pytest.raises(KnobsError, match="classes, the layout has"):
        Knobs({**default(), "warm_slabs": [0] * (C - 1)})
    with pytest.raises(KnobsError, match="missing"):
        Knobs({"drain_ms": 1})
    with pytest.raises(KnobsError, match="unknown knob"):
        k.replace(tcache_size=1)


def test_dict_form_and_digest_are_the_stores_json():
    k = Knobs(default())
    d = k.to_dict()
    assert d == {**default(), "retain_mib": 256}
    assert list(d) == ["drain_ms", "retain_mib", "tcache_cap", "tcache_batch", "warm_slabs"]
    d["tcache_cap"][1] = 5          # a copy the caller may change
    assert k.tcache_cap[1] == 64
    import hashlib
    # retain_mib at its default is left out: the digest a store row of
    # layout 6 (no retain_mib) was kept under.
    assert k.digest() == hashlib.sha256(json.dumps(default(), separators=(",", ":")).encode()).hexdigest()
    k0 = k.replace(retain_mib=0)
    assert k0.digest() == hashlib.sha256(json.dumps(k0.to_dict(), separators=(",", ":")).encode()).hexdigest()
    assert k0.digest() != k.digest()


def test_a_policy_from_before_a_later_knob_means_its_default():
    """retain_mib came with layout 7: a stored row, an exported file or a
    protobuf message from before it has no value for it, and means the
    default (256), never 0 (keep no freed memory)."""
    from hakmem._pb import hakmem_pb2 as pb
    from hakmem.knobs import LATER
    assert LATER == {"retain_mib": 256}
    old = default()                                   # layout 6's dict form
    assert Knobs(old).retain_mib == 256 and Knobs(old) == Knobs({**old, "retain_mib": 256})
    msg = pb.Knobs(drain_ms=old["drain_ms"], tcache_cap=old["tcache_cap"], tcache_batch=old["tcache_batch"],
                   warm_slabs=old["warm_slabs"])   # written before has_retain_mib existed
    assert Knobs.from_pb(msg).retain_mib == 256
    for r in (0, 64, 65536):
        k = Knobs(old).replace(retain_mib=r)
        back = pb.Knobs.FromString(k.to_pb().SerializeToString())
        assert back.has_retain_mib and Knobs.from_pb(back) == k
    with pytest.raises(KnobsError, match="retain_mib=65537 is outside 0..65536"):
        Knobs(old).replace(retain_mib=65537).check(Bounds.from_header(header()))


def test_protobuf_round_trip():
    k = Knobs(default()).replace(tcache_cap={5: 4000}, drain_ms=0)
    m = k.to_pb()
    assert m.drain_ms == 0 and list(m.tcache_cap)[5] == 4000
    assert Knobs.from_pb(m) == k
    from hakmem import control
    assert control.knobs_from_pb(control.knobs_to_pb(k)) == k.to_dict()


def test_clamp_fits_every_value_and_check_names_the_first_outside():
    b = Bounds.from_header(header())
    wild = {"drain_ms": 10**9, "tcache_cap": [7] + [10**6] * (C - 2) + [100], "tcache_batch": [7] + [0] * (C - 1),
            "warm_slabs": [7] + [-3] * (C - 1)}
    k = Knobs(wild).clamp(b)
    k.check(b)
    assert k.drain_ms == 3600000 and k.tcache_cap[C - 1] == 8 and k.tcache_cap[1] == 4096
    assert all(k[n][0] == 0 for n in PER_CLASS) and k.warm_slabs[1:] == (0,) * (C - 1)
    assert k.tcache_batch[1:] == (1,) * (C - 1)
    assert k.clamp(b) == k
    # a capacity lowered under its batch: the batch follows (0 cap: batch 1)
    low = Knobs(default()).replace(tcache_cap={5: 4, 6: 0}).clamp(b)
    assert (low.tcache_batch[5], low.tcache_batch[6], low.tcache_batch[7]) == (4, 1, 32)
    with pytest.raises(KnobsError, match=r"tcache_batch\[5\]=32 \(class 80 B\) is outside 1..4 \(at most the capacity\)"):
        Knobs(default()).replace(tcache_cap={5: 4}).check(b, header()["class_size"])
    with pytest.raises(KnobsError, match="drain_ms=3600001 is outside 0..3600000"):
        Knobs(default()).replace(drain_ms=3600001).check(b)
    with pytest.raises(KnobsError, match=r"warm_slabs\[0\] must be 0"):
        Knobs(default()).clamp(b).replace(warm_slabs={0: 1}).check(b)


def test_the_policy_slot_carries_knobs_unchanged():
    from hakmem.ring import Ring, encode_slot
    k = Knobs(default()).replace(tcache_cap={9: 777}, drain_ms=250)
    b = encode_slot(k, 3)
    assert encode_slot(k.to_dict(), 3) == b
    pol = Ring.slot_to_policy(b)
    assert pol["version"] == 3 and Knobs(pol) == k
