"""Finding telemetry files in a directory every user can write to, at a cost
no user can inflate for the others.

The telemetry directory is world-writable (sticky, like /tmp): any local
user can fill it with names, FIFOs, links and junk. hakmem-learnd looks at
it ten times a second, so what it costs to look is bounded here:

 1. Listing. The directory is listed again only when it changed (its mtime,
    ctime or size), at least every RESCAN_S, and never more often than keeps
    listing under SCAN_SHARE of a core: a directory of 20,000 names takes
    about 30 ms to list on a small machine, so such a directory is listed
    every 0.6 s, not every turn.
 2. Looking. Names that could be telemetry files (`<pid>-<starttime>`) and are
    neither tracked nor already judged are queued by owner. A name's owner
    is found with one lstat(), LOOK_PER_TURN names a turn at most, and kept
    with its inode, so a name waiting its turn costs no syscall per turn.
    (The owner only decides whose budget a name spends; what a file is
    trusted for is checked again on the opened file.)
 3. Examining (reading /proc, opening the file): at most PER_USER names of
    one owner per turn and PER_TURN in all, the owner served first rotating.
    A user who makes thousands of names waits for their own names; another
    user's new file is examined as soon as its owner is known.
 4. Judging. A name that was examined and not tracked (stale, untrusted,
    unreadable) is looked at again only when its inode changes or after a
    backoff that doubles to BACKOFF_MAX_S: a file that fails every read
    costs one examination a minute, not one a turn.
 5. Telling. What was removed, ignored or kept waiting is counted per owner
    and logged as one summary line per owner at most every SUMMARY_S; the
    reasons of the first TELL_PER_USER files an owner's names were ignored
    for are logged one by one, each once.
 6. Captures. Live captures' traces (`<pid>-<starttime>.trace-<request>`,
    made by the process) are listed with the rest and handed to learnd's
    sweep (Daemon.sweep_captures) CAPTURE_PER_TURN at a time, each name at
    most every CAPTURE_LOOK_S: whoever makes thousands of such names pays
    for their own, a few lstat()s a turn.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import os
import pwd
import re

NAME = re.compile(r"^(\d+)-(\d+)$")
CAPTURE = re.compile(r"^(\d+)-(\d+)\.trace-(\d+)$")   # a live capture's trace (allocator/src/telemetry.c live_start)
CAPTURE_PER_TURN = 64        # capture names looked at per turn at most ...
CAPTURE_LOOK_S = 10.0        # ... each at most this often
PER_USER = 16
PER_TURN = 128
LOOK_PER_TURN = 1024
SCAN_SHARE = 0.05
RESCAN_S = 2.0
BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 60.0
SUMMARY_S = 60.0
TELL_PER_USER = 5            # files ignored, each with its reason, per owner per summary
SETTLE_ABOVE_S = 0.002       # listings cheaper than this are simply done again


@dataclasses.dataclass
class Candidate:
    name: str
    path: str
    pid: int
    start_time: int
    uid: int
    ino: int


@dataclasses.dataclass
class Judged:
    ino: int
    next_look: float
    delay: float
    reason: str


@dataclasses.dataclass
class Tally:
    removed: int = 0
    ignored: int = 0
    told: int = 0           # of the ignored, logged one by one
    waiting: int = 0


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class Directory:
    """The names of one telemetry directory, looked at within the budgets above."""

    def __init__(self, path: str, clock, log):
        self.path = path
        self.clock = clock
        self.log = log
        self.names: dict[str, int] = {}          # the last listing: telemetry-like name -> inode
        self.owner: dict[str, tuple] = {}        # name -> (inode, uid) once lstat'ed (budgeting only)
        self.unsorted: collections.deque = collections.deque()   # names whose owner is not known yet
        self.queues: dict[int, collections.deque] = {}           # owner -> names waiting to be examined
        self.queued: set[str] = set()
        self.rotation = 0
        self.judged: dict[str, Judged] = {}
        self.retries: list = []                  # heap of (next_look, name); stale entries skipped
        self.ident = None                        # the directory's (mtime, ctime, size, inode) at the last listing
        self.next_scan = 0.0
        self.last_scan = -RESCAN_S
        self.scan_s = 0.0
        self.tally: dict[int, Tally] = collections.defaultdict(Tally)
        self.next_summary = 0.0
        self.changed_by_us = False
        self.captures: set[str] = set()          # capture-like names in the last listing
        self.capture_due: list = []              # heap of (next_look, name)
        self.capture_queued: set[str] = set()

    # ---- 1. listing -----------------------------------------------------------
    def scan(self, now: float, tracked: set[str]) -> bool:
        """Lists the directory when due. True when it was listed (then
        self.names is current and names gone from it can be dropped)."""
        if now < self.next_scan:
            return False
        try:
            st = os.stat(self.path)
        except OSError as e:
            self.log("error", f"cannot look at {self.path}: {e.strerror}")
            self.next_scan = now + RESCAN_S
            return False
        ident = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
        if ident == self.ident and now - self.last_scan < RESCAN_S:
            return False
        t0 = self.clock.perf_counter()
        names = {}
        captures = set()
        try:
            with os.scandir(self.path) as it:
                for e in it:
                    if NAME.match(e.name):
                        names[e.name] = e.inode()
                    elif CAPTURE.match(e.name):
                        captures.add(e.name)
        except OSError as e:
            self.log("error", f"cannot list {self.path}: {e.strerror}")
            self.next_scan = now + RESCAN_S
            return False
        self.scan_s = self.clock.perf_counter() - t0
        self.ident, self.last_scan = ident, now
        self.next_scan = now + self.scan_s / SCAN_SHARE
        before, self.names = self.names, names
        self.captures = captures
        for n in captures - self.capture_queued:
            self.capture_queued.add(n)
            heapq.heappush(self.capture_due, (now, n))
        for table in (self.judged, self.owner):
            for n in [n for n in table if n not in names]:
                del table[n]
        for n, ino in names.items():
            if n in tracked or n in self.queued:
                continue
            j = self.judged.get(n)
            if j is not None and j.ino == ino and now < j.next_look:
                continue
            self._queue(n, new=n not in before)
        return True

    def _queue(self, n, new=False):
        """Queues n for examination. A name new since the last listing goes
        ahead of those whose owner is still unknown: a process that started
        after somebody made thousands of names is looked at next turn, not
        after them."""
        self.queued.add(n)
        known = self.owner.get(n)
        if known is not None and known[0] == self.names.get(n):
            self.queues.setdefault(known[1], collections.deque()).append(n)
        elif new:
            self.unsorted.appendleft(n)
        else:
            self.unsorted.append(n)

    def due_retries(self, now: float):
        """Judged names whose backoff ran out are queued again even when the
        directory did not change."""
        while self.retries and self.retries[0][0] <= now:
            t, n = heapq.heappop(self.retries)
            j = self.judged.get(n)
            if j is not None and j.next_look == t and n not in self.queued and n in self.names:
                self._queue(n)

    # ---- 2. and 3. looking and examining ------------------------------------------
    def candidates(self, tracked: set[str]) -> list[Candidate]:
        # Looking: owners of new names, LOOK_PER_TURN at most.
        for _ in range(min(LOOK_PER_TURN, len(self.unsorted))):
            n = self.unsorted.popleft()
            try:
                st = os.lstat(os.path.join(self.path, n))
            except OSError:
                self.queued.discard(n)
                continue
            self.owner[n] = (st.st_ino, st.st_uid)
            self.queues.setdefault(st.st_uid, collections.deque()).append(n)
        # Examining: PER_USER of each owner's queue, PER_TURN in all; the
        # owner served first rotates, so the total never starves the same one.
        out: list[Candidate] = []
        uids = sorted(self.queues)
        if uids:
            self.rotation = (self.rotation + 1) % len(uids)
            uids = uids[self.rotation:] + uids[:self.rotation]
        for uid in uids:
            q = self.queues[uid]
            took = 0
            while q and took < PER_USER and len(out) < PER_TURN:
                n = q.popleft()
                self.queued.discard(n)
                if n in tracked or n not in self.names:
                    continue
                m = NAME.match(n)
                out.append(Candidate(n, os.path.join(self.path, n), int(m.group(1)), int(m.group(2)),
                                     uid, self.names[n]))
                took += 1
            if q:
                self.tally[uid].waiting = max(self.tally[uid].waiting, len(q))
            else:
                del self.queues[uid]
        return out

    def captures_due(self, now: float, most: int = CAPTURE_PER_TURN) -> list[tuple[str, int, int, int]]:
        """Up to `most` capture names due for a look, as (name, pid,
        start_time, request); each is due again CAPTURE_LOOK_S later while
        it is listed."""
        out = []
        while self.capture_due and self.capture_due[0][0] <= now and len(out) < most:
            _, n = heapq.heappop(self.capture_due)
            if n not in self.captures:
                self.capture_queued.discard(n)
                continue
            heapq.heappush(self.capture_due, (now + CAPTURE_LOOK_S, n))
            m = CAPTURE.match(n)
            out.append((n, int(m.group(1)), int(m.group(2)), int(m.group(3))))
        return out

    # ---- 4. judging -----------------------------------------------------------
    def judge(self, c: Candidate, reason: str, now: float, quiet=False) -> bool:
        """Records that c was not tracked. True when the caller should log
        the reason: new for this name, and the owner has not had TELL_PER_USER
        lines since the last summary (the rest are counted there). quiet: not
        worth a word (a file being created), looked at again soon."""
        j = self.judged.get(c.name)
        if j is None or j.ino != c.ino:
            j = self.judged[c.name] = Judged(c.ino, now + BACKOFF_FIRST_S, BACKOFF_FIRST_S, reason)
            new = not quiet
        else:
            j.delay = min(j.delay * 2, BACKOFF_MAX_S)
            j.next_look = now + j.delay
            new = j.reason != reason and not quiet
            j.reason = reason
        heapq.heappush(self.retries, (j.next_look, c.name))
        if not new:
            return False
        t = self.tally[c.uid]
        t.ignored += 1
        if t.told >= TELL_PER_USER:
            return False
        t.told += 1
        return True

    def removed(self, c: Candidate):
        self.judged.pop(c.name, None)
        self.tally[c.uid].removed += 1
        self.changed_by_us = True

    def settle(self):
        """After learnd's own removals: the directory changed because of us,
        which is no reason to list a large one again. (A change by somebody
        else in the same moment then waits for the next forced listing,
        RESCAN_S; a small directory is cheaper to list again than to risk
        that.)"""
        if self.scan_s < SETTLE_ABOVE_S:
            return
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if self.ident is not None:
            self.ident = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)

    def forget(self, name: str):
        self.judged.pop(name, None)
        self.owner.pop(name, None)

    # ---- 5. telling -------------------------------------------------------------
    def summary(self, now: float) -> list[str]:
        """One line per owner whose names cost something, at most every SUMMARY_S."""
        if now < self.next_summary or not self.tally:
            return []
        lines = []
        for uid, t in sorted(self.tally.items()):
            parts = []
            if t.removed:
                parts.append(f"removed {t.removed} stale files")
            if t.ignored:
                untold = t.ignored - t.told
                parts.append(f"ignored {t.ignored} files it cannot trust"
                             + (f" ({untold} not logged one by one)" if untold else ""))
            if t.waiting:
                parts.append(f"up to {t.waiting} names waited for their turn ({PER_USER} per user per turn)")
            if parts:
                lines.append(f"telemetry directory, files of {user_name(uid)} (uid {uid}): " + "; ".join(parts))
        self.tally.clear()
        if lines:
            self.next_summary = now + SUMMARY_S
        return lines
