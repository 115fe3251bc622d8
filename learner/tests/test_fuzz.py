"""Hostile policy snapshots against a running process: random bytes, values
out of range, wrong checksums, wrong slot versions and writers killed
mid-write. The process must not crash, must never apply a policy partly,
must keep the policy it had and must count every rejection."""
import random
import signal
import subprocess
import sys
import time

from conftest import ring_path, scaled, start, wait_for
from hakmem import layout as L
from hakmem.ring import Ring
from hakmem.ring import encode_slot as encode

CLS64 = 4
SLOT = L.POLICY_SLOT.itemsize


def slot_offset(ring, which):
    return ring.policy_offset + L.offset_of("policy_area", "slot") + (which % 2) * SLOT


def publish_raw(ring, version, slot_bytes):
    off = slot_offset(ring, version)
    ring.write(off, slot_bytes)
    ring.publish(version)


def out_of_range(rng, ring, pol):
    """A copy of pol with one value out of bounds, and what it breaks."""
    h = ring.header()
    bad = {k: (list(v) if isinstance(v, list) else v) for k, v in pol.items()}
    c = rng.randrange(1, L.NUM_CLASSES)
    kind = rng.choice(["cap", "batch0", "batch_over_cap", "warm", "drain", "retain", "class0", "batch_max"])
    if kind == "cap":
        bad["tcache_cap"][c] = h["cap_max"][c] + rng.randrange(1, 1 << 20)
    elif kind == "batch0":
        bad["tcache_batch"][c] = 0
    elif kind == "batch_over_cap":
        bad["tcache_cap"][c] = max(2, min(bad["tcache_cap"][c], 64))
        bad["tcache_batch"][c] = bad["tcache_cap"][c] + 1
    elif kind == "warm":
        bad["warm_slabs"][c] = h["warm_max"][c] + rng.randrange(1, 1 << 30)
    elif kind == "drain":
        bad["drain_ms"] = h["drain_ms_max"] + rng.randrange(1, 1 << 31)
    elif kind == "retain":
        bad["retain_mib"] = h["retain_mib_max"] + rng.randrange(1, 1 << 31)
    elif kind == "class0":
        bad[rng.choice(L.KNOBS_PER_CLASS)][0] = rng.randrange(1, 100)
    else:   # over batch_max or over the capacity, whichever is lower
        bad["tcache_cap"][c] = h["cap_max"][c]
        bad["tcache_batch"][c] = min(h["cap_max"][c], h["batch_max"]) + 1
    return bad, kind


KILLED_WRITER = r'''
import sys, time
sys.path.insert(0, sys.argv[1])
from hakmem.ring import Ring
r = Ring(sys.argv[2], writable=True)
off, n = int(sys.argv[3]), int(sys.argv[4])
data = bytes.fromhex(sys.argv[5])
for i in range(0, n, 8):          # slowly, so the kill lands mid-slot
    r.write(off + i, data[i:i + 8])
    if i == (n // 16) * 8:
        print("half", flush=True)
        time.sleep(30)
'''


def test_hostile_snapshots_are_rejected_whole(shm):
    rng = random.Random(1234)
    p = start(["mixed", 2, scaled(8.0)], shm)
    ring = Ring(str(ring_path(shm, p.pid)), writable=True)
    wait_for(lambda: ring.ring_head() >= 2, 5, "records")

    # A good policy first: the one every attack below must leave in force.
    good = ring.policy_in_force()
    good["tcache_cap"][CLS64] = 700
    good["tcache_batch"][CLS64] = 100
    good["drain_ms"] = 500
    v = ring.write_policy(good)
    applied, st = ring.wait_applied(v, scaled(2.0))
    assert applied, st
    in_force = ring.policy_in_force()
    kept = {k: in_force[k] for k in ("drain_ms", *L.KNOBS_PER_CLASS)}
    applied_version = v

    def expect_rejected(version, reason, what):
        nonlocal rejected
        ok = wait_for(lambda: ring.status()["seen_version"] == version or p.poll() is not None, 3.0,
                      f"the allocator to examine {what}")
        assert ok and p.poll() is None, f"process died after {what}: {p.stderr.read()}"
        s = ring.status()
        rejected += 1
        assert s["applied_version"] == applied_version, f"{what} was applied: {s}"
        assert s["rejected"] == rejected, f"{what}: rejected count {s['rejected']}, expected {rejected}"
        if reason is not None:
            assert s["reject_reason"] == reason, f"{what}: reason {s['reject_reason']}, expected {reason}"
        now = ring.policy_in_force()
        assert {k: now[k] for k in kept} == kept, f"policy changed after {what}"

    rejected = ring.status()["rejected"]
    version = v
    attacks = {"random": 0, "range": 0, "checksum": 0, "slot_version": 0, "random_word": 0}
    deadline = time.monotonic() + scaled(4.0)
    while time.monotonic() < deadline:
        kind = rng.choice(list(attacks))
        attacks[kind] += 1
        version += 1
        if kind == "random":
            publish_raw(ring, version, rng.randbytes(SLOT))
            expect_rejected(version, None, "random bytes")
        elif kind == "range":
            bad, what = out_of_range(rng, ring, kept | {"version": 0})
            publish_raw(ring, version, encode(bad, version))
            expect_rejected(version, 3, f"out of range ({what})")
        elif kind == "checksum":
            b = encode(kept, version)
            chk = int.from_bytes(b[8:16], "little") ^ (1 << rng.randrange(64))
            publish_raw(ring, version, encode(kept, version, checksum=chk))
            expect_rejected(version, 2, "a wrong checksum")
        elif kind == "slot_version":
            publish_raw(ring, version, encode(kept, version + 7))
            expect_rejected(version, 1, "a slot carrying another version")
        else:
            # A random version word over whatever the slots hold.
            version += rng.randrange(1, 1 << 40)
            off = slot_offset(ring, version)
            ring.write(off, rng.randbytes(SLOT))
            ring.publish(version)
            expect_rejected(version, None, "a random version word")

    # Writers killed mid-write: half a good slot, never published.
    for _ in range(3):
        version += 1
        seen_before = ring.status()["seen_version"]
        good_slot = encode(kept | {"drain_ms": 1234}, version)
        w = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(L.__file__.rsplit("/hakmem/", 1)[0]),
                              ring.path, str(slot_offset(ring, version)), str(SLOT), good_slot.hex()],
                             stdout=subprocess.PIPE, text=True)
        assert w.stdout.readline().strip() == "half"
        w.send_signal(signal.SIGKILL)
        w.wait()
        # The allocator looks at the version word on its slow paths: two more
        # records (each from a slow path, an epoch apart) and it has looked.
        head = ring.ring_head()
        wait_for(lambda: ring.ring_head() >= head + 2 or p.poll() is not None, 3.0, "two more records")
        assert p.poll() is None, p.stderr.read()
        s = ring.status()
        assert s["seen_version"] == seen_before and s["applied_version"] == applied_version
        now = ring.policy_in_force()
        assert {k: now[k] for k in kept} == kept and now["drain_ms"] != 1234

    # After all that, a good snapshot still goes through.
    version += 1
    fresh = dict(kept)
    fresh["tcache_cap"] = list(kept["tcache_cap"])
    fresh["tcache_cap"][CLS64] = 900
    publish_raw(ring, version, encode(fresh, version))
    wait_for(lambda: ring.status()["applied_version"] == version, 3.0, "a good snapshot after the attacks")
    assert ring.policy_in_force()["tcache_cap"][CLS64] == 900

    out, err = p.communicate(timeout=scaled(30))
    assert p.returncode == 0, err
    assert "hakmem" not in err, err
    final = ring.latest()
    assert int(final["proc"]["policies_rejected"]) >= rejected
    ring.close()
    assert sum(attacks.values()) >= 20, attacks
    assert all(attacks.values()), f"every attack should have run: {attacks}"
