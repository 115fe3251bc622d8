"""discovery.Directory's budgets, one at a time, on a real directory with a
clock the test moves (learner/hakmem/discovery.py, points 1-5). The
end-to-end cost among thousands of names is test_trust_learnd's; these say
which rule holds it down."""
import os
import sys

import pytest

from conftest import ROOT, need_root

sys.path.insert(0, str(ROOT / "learner"))
from hakmem import discovery as D  # noqa: E402

MALLORY = 4242      # an owner with no account: only chown needs to know it


class Clock:
    def __init__(self):
        self.t = 0.0

    def perf_counter(self):
        return self.t


def names(n, uid, base=5_000_000):
    return [(f"{base + i}-{i}", uid) for i in range(n)]


@pytest.fixture
def tree(tmp_path):
    need_root()

    def make(entries):
        for name, uid in entries:
            p = tmp_path / name
            p.write_bytes(b"")
            os.chown(p, uid, uid)
        return tmp_path
    return make


def directory(path):
    lines = []
    return D.Directory(str(path), Clock(), lambda level, msg: lines.append(msg)), lines


def by_owner(cands):
    out = {}
    for c in cands:
        out[c.uid] = out.get(c.uid, 0) + 1
    return out


def test_each_owner_is_examined_within_its_share_and_a_newcomer_is_not_kept_waiting(tree):
    # More names than a turn looks at (their owners are found LOOK_PER_TURN
    # at a time): after the first turn, most are still unsorted.
    path = tree(names(D.LOOK_PER_TURN * 2 + 500, MALLORY))
    d, _ = directory(path)
    assert d.scan(0.0, set())
    first = d.candidates(set())
    assert by_owner(first) == {MALLORY: D.PER_USER}
    assert len(d.unsorted) == D.LOOK_PER_TURN + 500, "owners are looked up LOOK_PER_TURN a turn"
    # Root's process starts after the flood: it is examined on the next
    # turn, beside mallory's share, not after her waiting names.
    (path / "6000000-7").write_bytes(b"")
    d.next_scan = 0.0
    assert d.scan(1.0, set())
    second = d.candidates(set())
    assert by_owner(second) == {MALLORY: D.PER_USER, 0: 1}
    assert "6000000-7" in {c.name for c in second}


def test_a_name_not_tracked_waits_for_its_backoff_or_a_new_inode(tree):
    path = tree(names(3, MALLORY))
    d, _ = directory(path)
    d.scan(0.0, set())
    cands = d.candidates(set())
    for c in cands:
        d.judge(c, "bad checksum", 0.0)
    d.due_retries(0.1)
    assert d.candidates(set()) == [], "judged names must not come back before their backoff"
    d.due_retries(D.BACKOFF_FIRST_S + 0.01)
    again = d.candidates(set())
    assert len(again) == 3
    for c in again:
        d.judge(c, "bad checksum", D.BACKOFF_FIRST_S + 0.01)
    d.due_retries(D.BACKOFF_FIRST_S * 2.5)
    assert d.candidates(set()) == [], "the backoff doubles"
    # The same name with a new file behind it is looked at when listed.
    # The same name with a new file behind it (renamed over it, so surely
    # another inode) is looked at as soon as it is listed.
    victim = path / cands[0].name
    (path / "new").write_bytes(b"x")
    os.chown(path / "new", MALLORY, MALLORY)
    os.rename(path / "new", victim)
    d.next_scan = 0.0
    assert d.scan(D.BACKOFF_FIRST_S * 2.5, set())
    assert [c.name for c in d.candidates(set())] == [victim.name]


def test_reasons_are_told_a_few_per_owner_then_summed_up(tree):
    path = tree(names(30, MALLORY))
    d, _ = directory(path)
    d.scan(0.0, set())
    told = 0
    for turn in range(3):
        for c in d.candidates(set()):
            told += d.judge(c, "not a hakmem telemetry file", 0.0)
    assert told == D.TELL_PER_USER
    lines = d.summary(0.0)
    assert len(lines) == 1 and "ignored 30 files" in lines[0] and f"({30 - D.TELL_PER_USER} not logged" in lines[0]
    assert d.summary(1.0) == [], "one summary per owner per SUMMARY_S"


def test_listing_is_skipped_when_unchanged_and_held_to_its_share_of_a_core(tree):
    path = tree(names(10, MALLORY))
    d, _ = directory(path)
    clock = d.clock

    def timed_scan(now, cost):
        real = D.os.scandir

        def slow(p):
            clock.t += cost       # the listing "takes" cost seconds
            return real(p)
        D.os.scandir = slow
        try:
            return d.scan(now, set())
        finally:
            D.os.scandir = real
    assert timed_scan(0.0, 0.05)
    assert d.next_scan == pytest.approx(0.05 / D.SCAN_SHARE)
    (path / "7000000-1").write_bytes(b"")
    assert not timed_scan(0.5, 0.05), "a changed directory still waits for its share"
    assert timed_scan(1.0, 0.001)
    assert not timed_scan(1.1, 0.001), "an unchanged directory is not listed again"
    assert timed_scan(1.0 + D.RESCAN_S, 0.001), "except every RESCAN_S"
