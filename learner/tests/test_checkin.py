"""Every thread checks in: a program whose thread cache serves every call
still writes a telemetry record every epoch and takes up a new policy
within two epochs (alloc.c "check-in").

Before the countdown, `workload hot` (one 64-byte block allocated and freed
in a loop, every call a cache hit) never reached a slow path after its
first refill: no telemetry file was ever made, and a snapshot written to it
would never have been looked at."""
import json
import time

import numpy as np

from conftest import ring_path, run_cli, start, wait_for
from hakmem.ring import Ring

CLS64 = 4          # the class serving 64-byte blocks
EPOCH_MS = 50
PARK = 500         # blocks parked in the cache before the loop


def test_a_thread_that_only_hits_writes_a_record_every_epoch(shm):
    p = start(["hot", 64, PARK, 3.0], shm, HAKMEM_TELEMETRY_MS=EPOCH_MS)
    try:
        ring = Ring(str(ring_path(shm, p.pid)))
        wait_for(lambda: ring.ring_head() >= 20, 5, "20 records")
        recs = ring.records()
        gaps_ms = np.diff(recs["time_ns"].astype(np.int64)) / 1e6
        # A record every epoch: the writer takes the first check-in after
        # the epoch is due, and check-ins come every few microseconds here.
        # (The ring keeps the last ring_slots of them.)
        assert len(gaps_ms) >= min(ring.slots, 20) - 1
        assert gaps_ms.max() < 2 * EPOCH_MS, gaps_ms
        allocs = recs["cls"]["allocs"][:, CLS64].astype(np.int64)
        assert (np.diff(allocs) > 0).all(), "every record counts the loop's allocations"
        # The counts are exact, not guessed: hits = allocs - refills.
        last = recs[-1]["cls"]
        assert last["hits"][CLS64] == last["allocs"][CLS64] - last["refills"][CLS64]
    finally:
        p.kill()
        p.wait()


def test_a_thread_that_only_hits_takes_up_a_policy_within_two_epochs(shm):
    p = start(["hot", 64, PARK, 3.0], shm, HAKMEM_TELEMETRY_MS=EPOCH_MS)
    try:
        ring = Ring(str(ring_path(shm, p.pid)), writable=True)
        wait_for(lambda: ring.ring_head() >= 2, 5, "a record")
        # The parked blocks sit in the cache under the default capacity.
        assert ring.latest()["cls"]["cached_bytes"][CLS64] >= (PARK - 1) * 64
        pol = ring.policy_in_force()
        pol["tcache_cap"][CLS64] = 4
        pol["tcache_batch"][CLS64] = 2
        t0 = time.monotonic()
        version = ring.write_policy(pol)
        applied, status = ring.wait_applied(version, timeout=2 * EPOCH_MS / 1000)
        took = time.monotonic() - t0
        assert applied, f"not applied within two epochs ({took * 1000:.0f} ms): {status}"
        assert ring.policy_in_force()["tcache_cap"][CLS64] == 4
        # The thread itself took it up: the capacity was lowered, and the
        # blocks above it went back at once (not at the next overflow).
        wait_for(lambda: ring.latest()["proc"]["policy_version"] == version, 2 * EPOCH_MS / 1000 + 0.5,
                 "a record under the new policy")
        wait_for(lambda: ring.latest()["cls"]["cached_bytes"][CLS64] <= 4 * 64, 2 * EPOCH_MS / 1000 + 0.5,
                 "the cache drained to the new capacity")
        assert ring.latest()["cls"]["drain_blocks"][CLS64] >= PARK - 1 - 4
        # The same through the CLI, which waits two epochs at most.
        r = run_cli("ring", "set-policy", "--dir", shm, p.pid, "tcache_cap@64=8", "tcache_batch@64=4",
                    "--wait", 2 * EPOCH_MS / 1000, "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["applied"] is True and out["applied_version"] == out["version"] > version
    finally:
        p.kill()
        p.wait()
