"""Screening: a program's candidate policies ranked by replaying a short trace
of the live program (DESIGN "learnd uses replay itself: candidates are
screened on a sampled trace of the live program before any is tried on it;
the online trial confirms instead of searching blind").

A cold program (nothing stored for it) gets one `Screen`; learnd's loop
steps it once per window:

  WAIT     until the program has been measured for `after_windows` windows
           and one of its processes allocates;
  CAPTURE  a bounded capture request (capture.py) written into the busiest
           process's telemetry file: `seconds` long, at most `max_bytes`
           (a program that allocates fast fills the bound in a fraction of
           a second, and its replay stays short);
  REPLAY   the finished trace is taken out of the telemetry directory
           (opened without following links, its owner and size checked,
           read within its bound through that descriptor, its chunks and
           footer checked) into a private copy that has no name (a sealed
           memfd the replayers read through an inherited descriptor), and
           replayed under every screening policy, `jobs` at a time, in a
           worker thread; learnd's loop never waits for a replay;
  DONE     the results, cheapest first, go to the learner (`screened`) and
           to the store (replay_runs, as `hakmem replay` keeps them);
  FAILED   the reason goes to the log once, and the learner is told so
           (`screened([], why)`): it searches as it would without.

The policies are the coarse corners of the knobs (every class's cache deep,
shallow or at the default, warm pools full or empty, a short drain, and
their pairs) plus the trace's hot classes' caches at 4 and 16 times the
default: the points where programs' best policies were found to lie
(README "The learner's proof"), and too far from the default for a local
search to reach in a few trials.

A user's trace is data from that user's program: when learnd is root, the
replayer runs as the trace's owner, so a trace crafted to break the
replayer could at most break a process of its own user."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import dataclasses
import errno
import os
import stat
import tempfile
import threading
import time

from . import capture as C
from .knobs import Knobs, default_batch
from .learning import Context
from .objective import Prices

# How long a capture runs. A program that allocates steadily shows in 2 s
# what its policies cost (a fast one fills MAX_BYTES first). One that
# allocates in bursts seconds apart does not: bench-learn's spikes (a
# 64 MiB burst every 2 s) gave 2 s traces holding one burst's allocations
# and none of its frees, or one burst and the idle time after; replayed,
# every warm-pool policy faulted the burst in alike and the ranking was
# the replays' noise. What keeping or returning a burst's memory costs
# shows from the second burst on: an intermittent program (a waited window
# with under a quarter of the busiest one's allocations) is traced for
# BURSTY_SECONDS: 8 s held 4 bursts and ranked the grid's best first, 6 s
# holds 3 and ranks it first too, and the capture costs the program's
# bursts 40-80% more CPU while it runs (spikes: 23-30 ms against 16), so
# it is kept as short as gives the ranking.
# Replays are paced (a trace of N seconds replays in about N) and run side
# by side, so screening takes about twice the capture.
SECONDS = 2                  # the capture's bound in time ...
BURSTY_SECONDS = 6           # ... for an intermittent program
BURSTY_SHARE = 0.25          # a window under this share of the busiest one's allocations: intermittent
MAX_BYTES = 16 << 20         # ... and in bytes (about 1.3 million events)
AFTER_WINDOWS = 3            # windows measured before the capture is asked for (the first, partial, is not judged)
ACK_WAIT_S = 10.0            # a process takes a request on its next allocation or telemetry tick
GRACE_S = 10.0               # after the capture's seconds: the bound is checked at the next allocation or tick
REPLAY_TIMEOUT_S = 120.0     # one replay; a trace of N seconds replays in about N
# A capture that holds fewer events ranks nothing but the replays' fixed
# costs: PostgreSQL's traced process made 2 allocations in 6 s, and its 15
# replays put `cap=4 warm=0` at -87% (2-minute learn_real run at ad8d902).
# Such a capture, one whose process ended (a backend whose connection
# closed), or one its process never took (idle since), is taken again from
# the busiest process of a later window, up to CAPTURES times in all, before
# the screening fails and the search goes on blind (which on PostgreSQL
# tried policies that cost +217% to +290%).
MIN_EVENTS = 256
CAPTURES = 3
STAGGER_S = 0.25            # replay k starts k times this late: side by side, their bursts would coincide
# An intermittent program's replays at once: at most this many per CPU they
# run on. bench-learn's spikes (a 64 MiB burst every 2 s), spikes-only runs
# with its gate seeing every burst: with 17 replays at once on one CPU, the
# program's first burst that faulted its memory in again while they ran
# (its decay gives a burst's memory back from about 14 s on) took 50-177 ms
# of CPU in 6 runs of 6, against 25-31 ms for the same burst without
# learnd: a guard window of 1.45-3.0 times the default's median. With 8 at
# once, 23-30 ms in 4 runs of 4 (a full run among them), the screening
# ending 29 s in against 22; with 9, 26-30 ms in 2 runs of 2, ending 25-26 s
# in: 17 policies in two rounds. Why so many at once slow the program was
# not found: not this machine's free page reporting (off: the same), not
# the replays' own teardown or decay passes (held at the gate: the same),
# not 17 replays of another capture started beside it by hand without
# learnd (no slow burst).
GATED_PER_CPU = 9
REPLAY_NICE = 19            # replays take the CPUs the program leaves
MEM_SHARE = 0.25             # replays at once hold at most this share of MemAvailable ...
REPLAY_OVERHEAD = 32 << 20   # ... counting each as the traced process's RSS and this
# A busy program's replays at once fault at most this share of one CPU in
# pages, at the calibrated price of a fault, taking each replay's rate from
# the default's replay, run first and alone. Bounded by memory only, 16
# replays of sqlite3's 2 s trace ran at once (each peaking at 195 MiB and
# faulting 61-119 thousand pages in 1.6-2.3 s: a million faults in about
# 5 s on 2 CPUs), and sqlite3's allocations fell from 258,000 a second to
# 146, 22,000 and 72,000 in three of those seconds (learn_real, 40-s cold
# run at 7753447), niced replays or not: the kernel's work for their faults
# is not the program's to wait for, but it waited. Four at once (by hand,
# one round) left its worst second at its own periodic dip.
FAULT_SHARE = 0.25
HOT_FACTORS = (4, 16)        # the hot classes' caps, times the default
SHALLOW_CAP = 4              # "shallow": blocks per class
MID_CAP = 32
# Freed memory kept, a quarter of the default's 256 MiB: sqlite3's shell
# held 142 MiB on average under it against 243 (glibc 81), at a median 0.94x
# of the default's throughput, ranges overlapping (3 rounds of 20 s). One
# point only: with one more, an intermittent program's 18 replays would need
# a third round (GATED_PER_CPU); the GP learner's retain dimension searches
# the rest.
MID_RETAIN_MIB = 64


@dataclasses.dataclass
class Ranked:
    """One screening policy's replay, as the learner gets it."""
    label: str
    knobs: Knobs
    cost: float          # replay cost, the objective's units per traced second
    spread: float        # (max - min) / median over the replay's runs
    rss_bytes: float
    time_cost: float


def _all_caps(ctx: Context, k: dict, cap_of) -> None:
    for c in range(1, len(ctx.class_size)):
        if ctx.default["tcache_cap"][c] > 0:
            cap = int(min(max(cap_of(c), 1), ctx.cap_max[c]))
            k["tcache_cap"][c] = cap
            k["tcache_batch"][c] = default_batch(cap, ctx.batch_max)


def _all_warm(ctx: Context, k: dict, warm_of) -> None:
    for c in range(1, len(ctx.class_size)):
        k["warm_slabs"][c] = int(min(max(warm_of(c), 0), ctx.warm_max[c]))


def policies(ctx: Context, hot: list[int]) -> list[tuple[str, Knobs]]:
    """The screening set as (label, knobs), the program's default first, no
    two alike, every one inside the program's bounds."""
    d = ctx.default
    caps = {"cap=max": lambda c: ctx.cap_max[c], f"cap={MID_CAP}": lambda c: MID_CAP,
            f"cap={SHALLOW_CAP}": lambda c: SHALLOW_CAP}
    warms = {"warm=max": lambda c: ctx.warm_max[c], "warm=0": lambda c: 0}
    out: list[tuple[str, Knobs]] = [("default", ctx.clamp(d))]

    def add(label, *edits):
        k = d.to_dict()
        for e in edits:
            e(k)
        out.append((label, ctx.clamp(k)))

    for name, f in caps.items():
        add(name, lambda k, f=f: _all_caps(ctx, k, f))
    for name, f in warms.items():
        add(name, lambda k, f=f: _all_warm(ctx, k, f))
    for cname in ("cap=max", f"cap={SHALLOW_CAP}"):
        add(f"{cname} warm=max", lambda k, f=caps[cname]: _all_caps(ctx, k, f),
            lambda k: _all_warm(ctx, k, warms["warm=max"]))
    add(f"cap={SHALLOW_CAP} warm=0", lambda k: _all_caps(ctx, k, caps[f"cap={SHALLOW_CAP}"]),
        lambda k: _all_warm(ctx, k, warms["warm=0"]))
    add(f"retain={MID_RETAIN_MIB}", lambda k: k.__setitem__("retain_mib", min(MID_RETAIN_MIB, ctx.retain_mib_max)))
    add("drain=100ms", lambda k: k.__setitem__("drain_ms", min(100, ctx.drain_ms_max)))
    add(f"cap={SHALLOW_CAP} drain=100ms", lambda k: _all_caps(ctx, k, caps[f"cap={SHALLOW_CAP}"]),
        lambda k: k.__setitem__("drain_ms", min(100, ctx.drain_ms_max)))
    for c in hot[:2]:
        for f in HOT_FACTORS:
            def hot_cap(k, c=c, f=f):
                cap = int(min(max(d["tcache_cap"][c] * f, 1), ctx.cap_max[c]))
                k["tcache_cap"][c] = cap
                k["tcache_batch"][c] = default_batch(cap, ctx.batch_max)
            add(f"cap[{ctx.class_size[c]}B]x{f}", hot_cap)
            if f == HOT_FACTORS[0]:
                add(f"cap[{ctx.class_size[c]}B]x{f} warm=max", hot_cap,
                    lambda k: _all_warm(ctx, k, warms["warm=max"]))
    seen, uniq = set(), []
    for label, k in out:
        if k.digest() not in seen:
            seen.add(k.digest())
            uniq.append((label, k))
    return uniq


SCREEN_PREFIX = "hakmem-screen-"   # what learnds before the memfd copies left in the temporary directory


def sweep_stale(directory: str | None = None) -> int:
    """Removes the trace copies and gates an earlier learnd left in the
    temporary directory (<tmp>/hakmem-screen-<pid>-XXXX.trace or .gate: a
    learnd killed while screening could not remove its own, each up to
    MAX_BYTES, and it had given the traces to the traced user), whoever owns
    them now, when the learnd named is gone. Learnd makes none there now
    (its copies are memfds). Only regular files; nothing is followed; a
    learnd that is not root can remove only its own. Returns how many went."""
    d = directory or tempfile.gettempdir()
    gone = 0
    try:
        names = os.listdir(d)
    except OSError:
        return 0
    for name in names:
        if not (name.startswith(SCREEN_PREFIX) and name.endswith((".trace", ".gate"))):
            continue
        pid = name[len(SCREEN_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or os.path.exists(f"/proc/{int(pid)}"):
            continue
        path = os.path.join(d, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and (os.geteuid() == 0 or st.st_uid == os.geteuid()):
                os.unlink(path)
                gone += 1
        except OSError:
            continue
    return gone


class _Again(C.CaptureError):
    """A capture that another process, or a later window, may do better
    (MIN_EVENTS, CAPTURES)."""


class Gate:
    """Keeps an intermittent program's replays out of its bursts.

    Measured on bench-learn's spikes (a 64 MiB burst every 2 s, 16 ms of
    CPU, its blocks held 100 ms and freed): with learnd screening beside it,
    one or two bursts while the replays ran took 35-79 ms, in four of six
    runs; the program beside 17 replays of its trace without learnd's
    capture and telemetry never did in six. Why was not found (this
    machine is a VM that hands freed memory back to its host). Gates tried,
    on spikes: replays held only while the program's CPU time moved, bursts
    of 52-77 ms in 3 runs of 4; held until 50 ms after it stopped
    moving (inside the 100 ms hold, so the replays ran while the program
    freed its blocks) and from half a second before the next burst, windows
    25-40% busier than the default's in 3 of 3; as here (QUIET_S 0.25 s),
    the worst window after 10 s at 1.02, 1.05 and 1.03 times the default's
    median, where the default's own worst was 1.07, 1.04 and 1.03.

    The gate watches from the capture's request on (Screen._ask), so it
    knows the period before the first replay starts, and a replay waits
    for it before it loads its trace too. Started with the replays, it saw
    the first two bursts beside them unguarded: in spikes-only bench-learn
    runs the worst window after 10 s (default's median = 1) was past the
    default's own worst in 4 of 8 (3 with one burst at 55-80 ms of CPU
    against 15-20); watching from the capture, in 2 of 9 (one such burst;
    1.043 against 1.028). Not gone: in a full run, spikes' window
    at 16-18 s still took 27 ms (1.17 against 1.07).

    So the replays run in the middle of the program's idle time. A thread
    here reads the program's CPU time every POLL_S; a burst starts when
    the program ran for BUSY_SHARE of the time since the last reading and
    ends QUIET_S after it last did (a burst's own pauses are part of it);
    its start counts toward the period once it took MIN_BURST_CPU_S.
    The CPU time is the process's CPU clock, all its threads, to the
    nanosecond (clock_gettime of its pid's clock id). /proc/PID/stat,
    read before, counts whole ticks of 10 ms, and spikes' bursts take
    6 ms of CPU once its memory is warm: watched so for 16 s (spikes
    alone, no replays), the gate missed 4 of 8 bursts and took a stray
    tick between two for a burst, the period it said was wrong, and it
    stood open through 3 of the bursts. Watched by its CPU clock it saw
    all 8 and was closed from half a second before each. (spikes' guard
    missed at 16-18 s in three full runs, 1.98x the default's median at
    3ba734a: a burst of 93 ms of CPU while its 17 replays ran.) The gate
    file's byte (`hakmem-replay --gate`) is set from a burst's start to
    its end and, once two bursts gave a period, from MARGIN_S (at least a
    quarter of the period) before the next one is due. A gate closed for
    MAX_CLOSED_S opens as long again, so a program that turns busy, or
    bursts when none was due, holds the replays at most half the time.

    The gate is an anonymous file of learnd's (a memfd): the replays get a
    read-only descriptor of it (`hakmem-replay --gate-fd`), so a replay run
    as the program's user can neither change it nor find it by a name; it
    is written with pwrite. Mapped here read-only, only for its address: a
    replay's held thread sleeps on its first word (a shared futex), and
    learnd wakes it as it opens the gate, so held replays need not poll
    (9 processes waking every 5 ms on MariaDB's CPU, as held replays' looks
    did, cost it 4% of its transactions: README). Sealed, it cannot shrink
    under the mapping."""

    POLL_S = 0.005
    BUSY_SHARE = 0.1      # a thread waking to sleep again uses far less; a tick of /proc/PID/stat far more
    QUIET_S = 0.25
    # A burst's start counts toward the period once the program ran this
    # much in busy readings, none LAPSE_S apart. In one CI run the gate
    # counted one start too many, 0.4 s after a 4-ms burst, where the
    # program had only a thread that wakes every 20 ms (80-170 us of CPU
    # a wake in most runs here): one reading of more than 0.5 ms.
    # In 1 of 20 runs here, four wakes in a row took 0.34-0.58 ms each,
    # 1.9 ms in all. A guess, not proven: this VM's vCPUs lose time to
    # their host (/proc/stat's steal), which a task's CPU clock may count
    # as the task's. The gate still closes at the first busy reading; only
    # the period ignores such moments.
    MIN_BURST_CPU_S = 0.003
    LAPSE_S = 0.05
    MARGIN_S = 0.5
    MAX_CLOSED_S = 1.0

    def __init__(self, pid: int, clock=time):
        self.pid, self.clock = int(pid), clock
        import fcntl
        fd = os.memfd_create("hakmem-screen-gate", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.pwrite(fd, b"\0" * 8, 0)
            # Its size fixed: a replayer that truncated it (through
            # /proc/self/fd) would die of SIGBUS on its own mapping.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            # What the replays get: read-only, so a replayer run as the
            # program's user cannot hold the others, nor learnd's own byte.
            self.ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._word = _map_word(fd)    # None where it cannot be mapped: the replays then look on their own
        self.woken = 0                # replays' threads its openings woke
        self.closed = False
        self.closed_s = 0.0      # how long the gate was closed, in all
        self.closings = 0
        self.starts: list[float] = []   # the program's bursts' starts
        self._since = 0.0
        self._stop = threading.Event()
        # The process CPU clock of a pid (the kernel's MAKE_PROCESS_CPUCLOCK:
        # ~pid << 3 | CPUCLOCK_SCHED), as a signed 32-bit clockid_t.
        self._clock = ctypes.c_int32((~self.pid << 3) | 2).value
        self._last_ns = self._last_ticks = None
        self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        try:
            self._stat = os.open(f"/proc/{self.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._stat = None
        self._thread = threading.Thread(target=self._run, name="hakmem-screen-gate", daemon=True)
        self._thread.start()

    def _cpu(self):
        """The program's utime + stime in clock ticks; None once it is gone."""
        if self._stat is None:
            return None
        try:
            b = os.pread(self._stat, 1024, 0)
            f = b.rsplit(b")", 1)[1].split()    # fields from the 3rd on, whatever the name holds
            return int(f[11]) + int(f[12])
        except (OSError, IndexError, ValueError):
            return None

    def _ran_s(self, ticks: int) -> float:
        """Seconds of CPU the program used since the last call, all its
        threads together, those that ended meanwhile too: its process CPU
        clock (clock_gettime of the pid's clock id, to the nanosecond),
        or where that cannot be read, its stat's ticks."""
        ns = None
        if self._clock is not None:
            try:
                ns = time.clock_gettime_ns(self._clock)
            except OSError:
                self._clock = None
        if ns is not None:
            last, self._last_ns = self._last_ns, ns
            return 0.0 if last is None else max(0, ns - last) / 1e9
        last, self._last_ticks = self._last_ticks, ticks
        return 0.0 if last is None else max(0, ticks - last) * self._tick_s

    def period(self) -> float | None:
        """The median time between the program's last bursts, once two are seen."""
        st = self.starts[-5:]
        d = sorted(b - a for a, b in zip(st, st[1:]))
        return d[len(d) // 2] if d else None

    def _set(self, closed: bool, now: float):
        if closed == self.closed:
            return
        with contextlib.suppress(OSError):
            os.pwrite(self.fd, b"\1" if closed else b"\0", 0)
        if not closed and self._word:
            self.woken += _futex_wake(self._word)
        if closed:
            self.closings += 1
        else:
            self.closed_s += now - self._since
        self.closed, self._since = closed, now

    def want_closed(self, now: float, burst: bool) -> bool:
        if burst:
            return True
        per = self.period()
        return per is not None and now >= self.starts[-1] + per - max(self.MARGIN_S, per / 4)

    def _run(self):
        self._ran_s(self._cpu() or 0)
        prev = self.clock.monotonic()
        last_busy, burst, open_until = float("-inf"), False, 0.0
        first, first_cpu = None, 0.0     # a burst not yet counted: its start, its CPU so far
        while not self._stop.wait(self.POLL_S):
            ticks = self._cpu()
            if ticks is None:          # the program is gone: nothing left to spare
                break
            # The stat read first: a pid that ended and was reused reads
            # as gone here before its clock is another process's. The time
            # read right after the program's clock, with no read between
            # (the stat's releases the GIL, and learnd's other threads can
            # keep it for milliseconds): the CPU time and the time it is
            # shared over span the same interval.
            ran = self._ran_s(ticks)
            now = self.clock.monotonic()
            dt, prev = max(now - prev, self.POLL_S), now
            if ran >= self.BUSY_SHARE * dt:
                if not burst or (first is not None and now - last_busy > self.LAPSE_S):
                    first, first_cpu = now, 0.0
                if first is not None:
                    first_cpu += ran
                    if first_cpu >= self.MIN_BURST_CPU_S:
                        self.starts = (self.starts + [first])[-8:]
                        first = None
                last_busy, burst = now, True
            elif burst and now - last_busy >= self.QUIET_S:
                burst, first = False, None
            want = self.want_closed(now, burst) and now >= open_until
            if want and self.closed and now - self._since >= self.MAX_CLOSED_S:
                want, open_until = False, now + self.MAX_CLOSED_S
            self._set(want, now)
        self._set(False, self.clock.monotonic())

    def count_from(self, now: float):
        """Holds are counted from here (the replays' start), not from the
        capture's, when the gate began to watch."""
        self.closings, self.closed_s = int(self.closed), 0.0
        if self.closed:
            self._since = now

    def close(self):
        self._stop.set()
        self._thread.join()
        if self._word:
            _LIBC.munmap(ctypes.c_void_p(self._word), ctypes.c_size_t(8))
            self._word = None
        fds, self._stat, self.fd, self.ro = (self._stat, self.fd, self.ro), None, None, None
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_LIBC.syscall.restype = ctypes.c_long
# futex(2)'s number where known; elsewhere the replays find the gate open
# on their own (hakmem-replay's GATE_LOOK_NS).
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)
_FUTEX_WAKE = 1
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_word(fd: int) -> int | None:
    """The address of the gate's first word, mapped shared and read-only."""
    import mmap
    if _SYS_FUTEX is None:
        return None
    a = _LIBC.mmap(None, 8, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    return None if a in (None, _MAP_FAILED) else a


def _futex_wake(addr: int) -> int:
    """Wakes every thread sleeping on the word; how many there were."""
    return max(0, _LIBC.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
                  ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0)))


def replay_cpus() -> set[int] | None:
    """The CPUs an intermittent program's replays run on: the upper half of
    learnd's own (None where it has one).

    Replays let out of the gate fault their memory in between the program's
    bursts, and nice 19 does not keep them off the program's CPU's kernel
    work: many processes faulting memory in on every CPU at once slow the
    program's next burst, where the same faulting on half the CPUs does not.
    Measured beside bench-learn's spikes program (a 64 MiB burst every 2 s,
    15-20 ms of CPU each), 17 processes at nice 19 each writing 100 MiB of
    fresh malloc'ed memory at 5 s, then sleeping: on both CPUs the bursts
    after took 75-108 ms in 3 runs of 3, and 60-99 ms again whether the
    sleepers woke every 1 ms, 20 ms or not at all; all 17 on one CPU, none
    over 23 ms in 3 runs. In bench-learn full runs such a burst was the
    guard's one miss on spikes (1.975x at 16-18 s, full run at 2b48959)."""
    try:
        mine = sorted(os.sched_getaffinity(0))
    except OSError:
        return None
    if len(mine) < 2:
        return None
    return set(mine[len(mine) // 2:])


def _mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes, 0 when unreadable."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Screen:
    """One program's screening (see the module's docstring). `step` once per
    window; it returns the ranked results once (DONE), an empty list with
    `why` set once (FAILED), else None."""

    WAIT, CAPTURE, REPLAY, DONE, FAILED = "wait", "capture", "replay", "done", "failed"

    def __init__(self, ctx: Context, shm_dir: str, objective, prices, *, replayer=None, jobs=24, repeat=1,
                 seconds=SECONDS, bursty_seconds=BURSTY_SECONDS, max_bytes=MAX_BYTES, after_windows=AFTER_WINDOWS,
                 clock=time):
        self.ctx, self.shm_dir, self.objective, self.prices = ctx, shm_dir, objective, prices
        self.replayer, self.jobs, self.repeat = replayer, max(1, int(jobs)), max(1, int(repeat))
        self.seconds, self.max_bytes, self.after_windows = int(seconds), int(max_bytes), after_windows
        self.bursty_seconds = int(bursty_seconds)
        self.seen: list[float] = []       # the busiest process's allocations in each judged waited window
        self.intermittent = False
        self.capture_s = self.seconds     # the capture asked for
        self.rss_bytes = 0.0              # the traced process's RSS when asked (a replay's memory, roughly)
        self.jobs_run = 0                 # replays run at once
        self.probed = False               # the default's replay ran first, alone (jobs_for)
        self.cpus: set[int] | None = None # the CPUs they ran on, where held to some (replay_cpus)
        self._stop = threading.Event()
        self.clock = clock
        self.state = self.WAIT
        self.why = ""
        self.windows = 0
        self.proc = None
        self.req = 0
        self.deadline = 0.0
        self.trace_fd: int | None = None  # the private copy of the trace (a sealed memfd, replay.sealed_copy)
        self.label = ""                   # its name in messages
        self.runner = None                # replay.Runner: this screening's replays, and nobody else's
        self.footer: dict | None = None
        self.facts = None
        self.results: list[tuple[Ranked, object]] = []   # (ranked, replay.Result)
        self._pool: cf.ThreadPoolExecutor | None = None
        self._fut: cf.Future | None = None
        self.t_started = self.t_traced = self.t_done = None   # t_started: the first capture's
        self.t_capture_end: float | None = None
        self.retried: list[str] = []      # why each earlier capture was taken again
        self.deaf: set[int] = set()       # pids that let a request go untaken: never asked again
        self.min_events = MIN_EVENTS
        self.gate: Gate | None = None     # while an intermittent program's replays run

    # ---- the steps -------------------------------------------------------------------
    def step(self, procs, now: float):
        """procs: the program's live processes (daemon.Proc) now."""
        if self.state in (self.DONE, self.FAILED):
            return None
        try:
            if self.state == self.WAIT:
                self.windows += 1
                if self.windows > 1:      # the first window holds the process's start, partial
                    self.seen = (self.seen + [max((p.last_allocs for p in procs), default=0.0)])[-4:]
                if self.windows >= self.after_windows:
                    self._ask(procs, now)
                return None
            if self.state == self.CAPTURE:
                self._wait_capture(procs, now)
                return None
            if self.state == self.REPLAY and self._fut.done():
                ranked = self._fut.result()
                self.state, self.t_done = self.DONE, now
                self._cleanup()
                return ranked
        except _Again as e:
            self.retried.append(str(e))
            if len(self.retried) >= CAPTURES:
                return self._fail(f"{e} (capture {len(self.retried)} of {CAPTURES})")
            self._again(now)
        except C.CaptureError as e:
            return self._fail(str(e))
        except Exception as e:   # a replay that failed (replay.ReplayError), a trace that does not parse
            return self._fail(f"{type(e).__name__}: {e}" if not str(e).startswith(("hakmem", "/")) else str(e))
        return None

    def tracing_during(self, t0: float, t1: float) -> bool:
        """Whether a capture may have run in [t0, t1] (monotonic): such a
        window is no evidence for a policy, every call having taken the
        capture's slow path."""
        return self.t_started is not None and self.t_started < t1 and \
            (self.t_capture_end is None or self.t_capture_end > t0)

    def _fail(self, why: str):
        if self.t_capture_end is None:
            self.t_capture_end = self.clock.monotonic()
        self.state, self.why = self.FAILED, why
        self._cleanup()
        return []

    def _again(self, now):
        """Back to waiting: the next capture comes from the busiest process
        AFTER_WINDOWS windows on. Windows since the first capture's start
        stay out of the evidence until the last one ends (tracing_during)."""
        self.t_capture_end = now
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        self.state, self.windows, self.proc, self.req, self.t_traced = self.WAIT, 0, None, 0, None

    def _ask(self, procs, now):
        # A process that did not take a request in ACK_WAIT_S would not take
        # the next: PostgreSQL's busiest process at 1 allocation a second
        # (a background worker) was asked three times, and the screening failed.
        busy = [p for p in procs if p.last_allocs > 0 and p.ring.alive and p.pid not in self.deaf]
        if not busy:
            return            # nothing allocates: nothing to trace yet
        p = max(busy, key=lambda p: p.last_allocs)
        self.proc = p
        top = max(self.seen, default=0.0)
        self.intermittent = top > 0 and min(self.seen) < BURSTY_SHARE * top
        self.capture_s = self.bursty_seconds if self.intermittent else self.seconds
        self.rss_bytes = float(getattr(p, "last_rss", 0.0) or 0.0)
        self.req = C.request(p.ring, self.capture_s, self.max_bytes)
        self.state, self.t_capture_end = self.CAPTURE, None
        if self.t_started is None:
            self.t_started = now
        # Watching from the capture on, the gate knows the bursts' period
        # when the first replay starts. Started with the replays, it saw its
        # first two bursts unguarded: on spikes one of them took 80 ms of
        # CPU against 15-20 (the replays, starting, took 18 ms of CPU beside it).
        if self.intermittent:
            self.gate = Gate(p.pid)
        self.deadline = now + ACK_WAIT_S

    def _wait_capture(self, procs, now):
        p = self.proc
        if p not in procs:
            raise _Again(f"process {p.pid} ended during the capture")
        a = C.answer(p.ring, self.req)
        if a is None:
            if now >= self.deadline:
                # An idle process (a backend between connections, with no
                # background thread) takes a request at its next call, and
                # would record then for nobody.
                with contextlib.suppress(Exception):
                    C.withdraw(p.ring, self.req)
                self.deaf.add(p.pid)
                raise _Again(f"process {p.pid} did not take the capture request within {ACK_WAIT_S:g} s")
            return
        state, err = a
        if state == C.REFUSED:
            raise C.CaptureError(f"process {p.pid} refused the capture: "
                                 + ("a capture is already on" if err == errno.EBUSY else os.strerror(err)))
        if state != C.DONE:
            if self.t_traced is None:        # taken: now the capture's own bound
                self.t_traced = now
                self.deadline = now + self.capture_s + GRACE_S
            if now >= self.deadline:
                raise C.CaptureError(f"process {p.pid} did not end the capture within "
                                     f"{self.capture_s + GRACE_S:g} s")
            return
        self.t_capture_end = now
        self._take(p)
        self._start_replays()

    def _take(self, p):
        """The finished trace out of the telemetry directory, into a private
        copy nobody else can name or change (a sealed memfd the replays read
        through a descriptor), checked whole. Read through the descriptor
        that was checked, bounded: never opened again by its name."""
        from . import replay as R
        name = C.trace_name(p.ring, self.req)
        dfd, fd, st = C._open_trace(self.shm_dir, name, p.ring.file_uid)
        try:
            if st.st_size > self.max_bytes + (1 << 20):
                raise C.CaptureError(f"process {p.pid}'s capture is {st.st_size} bytes, past the "
                                     f"{self.max_bytes}-byte bound it was asked for")
            with os.fdopen(fd, "rb") as f:
                data = f.read(self.max_bytes + (1 << 20))
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)
        self.footer = C.check_trace(data)
        if self.footer["events"] < self.min_events:
            raise _Again(f"process {p.pid}'s capture holds {self.footer['events']} events, "
                         f"too few to rank policies by (under {self.min_events})")
        # A capture asked for N seconds ends at the first allocation or tick
        # after them: a footer claiming much longer is not this capture, and
        # the replays would pace its idle gaps for as long as it says.
        most = self.capture_s + GRACE_S + ACK_WAIT_S
        if self.footer["duration_s"] > most:
            raise C.CaptureError(f"process {p.pid}'s capture says it lasted {self.footer['duration_s']:.1f} s; "
                                 f"it was asked for {self.capture_s} s")
        self.trace_fd = R.sealed_copy("hakmem-screen-trace", data)
        self.label = f"the screening trace of {p.pid}"
        self.uid = p.ring.file_uid

    def _start_replays(self):
        from .replay import Runner
        self.state = self.REPLAY
        self.runner = Runner()
        # The worker's own descriptors of the copy and the gate: close()
        # does not wait for it (its trace's analysis takes a second for a
        # large trace, learnd's loop none of it), and a descriptor closed
        # under it could be reused for another file by then.
        fds = (os.dup(self.trace_fd), os.dup(self.gate.ro) if self.gate is not None else None)
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hakmem-screen")
        self._fut = self._pool.submit(self._replay_owned, *fds)

    # ---- the worker thread ---------------------------------------------------------------
    def _replay_owned(self, trace_fd: int, gate_fd: int | None) -> list[Ranked]:
        try:
            return self._replay_all(trace_fd, gate_fd)
        finally:
            for fd in (trace_fd, gate_fd):
                if fd is not None:
                    os.close(fd)

    def _replay_all(self, trace_fd: int | None = None, gate_fd: int | None = None) -> list[Ranked]:
        from . import replay as R
        from .trace import Opened
        trace_fd = self.trace_fd if trace_fd is None else trace_fd
        gate_fd = (self.gate.ro if self.gate is not None else None) if gate_fd is None else gate_fd

        def stopped(_done, _size):    # between the trace's chunks: a screening closed meanwhile ends here
            if self._stop.is_set():
                raise R.ReplayStopped(f"{self.label}: replays stopped")
        facts = R.trace_facts(Opened(trace_fd, self.label), on_progress=stopped)
        self.facts = facts
        hot = facts.hot_classes(most=2)
        pol = policies(self.ctx, hot)
        user = self.uid if os.geteuid() == 0 and self.uid != 0 else None

        # Only an intermittent program has idle time to replay in; a busy
        # one would hold every replay for MAX_CLOSED_S out of two.
        gate = self.gate
        cpus = None
        if gate is not None:
            gate.count_from(time.monotonic())
            cpus = self.cpus = replay_cpus()

        t0 = time.monotonic()   # rebound below, before the pool: one() reads it then

        def one(item):
            i, (label, k) = item
            # Started in step, every replay would take a bursty trace's bursts
            # at the same moment, and 17 processes faulting 64 MiB at once on
            # 2 cores wait on each other in the kernel's locks and for a CPU.
            # Replay i starts STAGGER_S * i after the first of the pool, not
            # after a worker came free: with fewer workers than replays the
            # waits added up (4 at once: 3 s of sleep before the 13th).
            if self._stop.wait(max(0.0, t0 + i * STAGGER_S - time.monotonic())):
                raise R.ReplayStopped(f"{self.label}: replays stopped")
            # The replays are learnd's errand, not the program's: at nice 19
            # they take the CPUs the program leaves. The replayer sets its
            # niceness and CPUs itself: this thread, niced, held the GIL
            # through the fork of a replay run as another user (no vfork
            # then) on busy CPUs, and learnd's loop waited up to 1.5 s for
            # it in a bench of that alone, seconds in the chaos walk.
            # Their niceness weighs only inside their session's scheduling
            # group (autogroup), which weighs as much as the program's: a busy
            # program's replays nice their group too (07518cc: a nice-0 loop
            # kept 0.98 of its CPU beside them, 0.52 before). An intermittent
            # one's, held by the gate while it runs, do not: niced so, beside
            # a MariaDB busy between its idle seconds, 9 gated replays never
            # ranked in four 120-s runs, the default in force, 0.75-0.86 times
            # its transactions (bench/learn_real at 06a6ef0, README).
            res = R.run_replayer(trace_fd, k.to_dict(), repeat=self.repeat, replayer=self.replayer,
                                 timeout=REPLAY_TIMEOUT_S, user=user, gate=gate_fd if gate else None,
                                 runner=self.runner, label=self.label, nice=REPLAY_NICE, cpus=cpus,
                                 nice_group=gate is None)
            return label, k, R.result_of(res, k.to_dict(), facts, self.objective, self.prices)
        # A busy program's default replay goes first, alone: how fast a
        # replay of this trace faults pages bounds how many run at once
        # (FAULT_SHARE). An intermittent program's replays wait at the gate
        # while it runs and fault between its bursts, on half the CPUs.
        first = None
        if gate is None and len(pol) > 1:
            first = one((0, pol[0]))
            rest = pol[1:]
            self.probed = True
        else:
            rest = pol
        gated_cpus = None
        if gate is not None:
            try:
                gated_cpus = len(cpus) if cpus else len(os.sched_getaffinity(0))
            except OSError:
                gated_cpus = 1
        jobs = self.jobs_run = self.jobs_for(len(rest), first[2] if first else None, gated_cpus)
        t0 = time.monotonic()
        # The gate is closed in _cleanup, with the rest of the screening's
        # state, on every way out.
        with cf.ThreadPoolExecutor(max_workers=jobs) as ex:
            done = ([first] if first else []) + list(ex.map(one, enumerate(rest)))
        # Ranked in learnd's own units (replay.run_cost): the same prices as
        # a live window's, and what replay_runs stores and `policy explain`
        # shows.
        self.results = [(Ranked(label, k, self._cost(r, done), r.spread, r.mean_rss_bytes, r.time_cost), r)
                        for label, k, r in done]
        return sorted((rk for rk, _ in self.results), key=lambda r: r.cost)

    def _cost(self, r, done) -> float:
        """A replay's cost as the program would pay it. Priced memory is
        linear, so the replay's own mean RSS ranks as well as any. A budget
        is not: a replay of a second of the program holds a fraction of its
        memory and never nears the budget, so every policy's memory was free
        and a program over its budget ranked nothing cheaper than the
        default (sqlite3's shell at 243 MiB under a 160 MiB budget; retain_mib
        =64 holds 142). Under a budget the replay's memory is taken as what
        it changes: the traced process's RSS (under the policy in force,
        taken as the default's) plus the replay's mean RSS less the default
        replay's."""
        budget = getattr(self.objective, "budget_bytes", None)
        base = next((b for label, _, b in done if label == "default"), None)
        if not budget or base is None or self.rss_bytes <= 0:
            return r.cost
        rss = max(0.0, self.rss_bytes + r.mean_rss_bytes - base.mean_rss_bytes)
        return r.time_cost + self.objective.mem_cost(rss)

    def jobs_for(self, n: int, probe=None, gated_cpus: int | None = None) -> int:
        """Replays at once: all n where memory and faults allow (a paced
        replay mostly sleeps, and run one after another they would take n
        times the trace), at most `jobs`; no more than MEM_SHARE of
        MemAvailable holds, each counted as the default's replay peaked
        (probe, a replay.Result) or else as the traced process's RSS and
        REPLAY_OVERHEAD; and together faulting pages for no more than
        FAULT_SHARE of one CPU's time, each at the probe's rate. An
        intermittent program's replays, which run on gated_cpus CPUs,
        at most GATED_PER_CPU on each."""
        k = max(1, min(n, self.jobs))
        if gated_cpus:
            k = min(k, GATED_PER_CPU * gated_cpus)
        each = self.rss_bytes + REPLAY_OVERHEAD
        if probe is not None and probe.peak_rss_bytes > 0:
            each = probe.peak_rss_bytes
        avail = _mem_available()
        if avail:
            k = max(1, min(k, int(avail * MEM_SHARE // each)))
        if probe is not None and probe.minflt > 0 and probe.wall_s > 0:
            fault_s = getattr(self.prices, "fault_s", None) or Prices().fault_s
            cores = probe.minflt / probe.wall_s * fault_s
            k = max(1, min(k, int(FAULT_SHARE // cores)))
        return k

    # ---- the end --------------------------------------------------------------------------
    def _cleanup(self):
        if self.gate is not None:
            self.gate.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        # The replays hold their own descriptors: closing ours ends nothing
        # of theirs, and the memfd goes with the last of them.
        if self.trace_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.trace_fd)
            self.trace_fd = None

    def close(self):
        """The screening ends early (its program's last process exited, an
        operator pinned a policy, learnd stops): its own replays are ended,
        and only those."""
        if self.state == self.REPLAY:
            # Its replays are ended now; the worker, its own descriptors in
            # hand, stops at its next step (a chunk of the trace, a replay
            # to start), without learnd waiting for it.
            self._stop.set()
            self.runner.stop()
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._cleanup()

    def describe(self, ranked: list[Ranked], top=3) -> str:
        base = next((r.cost for r in ranked if r.label == "default"), None)
        parts = []
        for r in ranked[:top]:
            rel = f" {100 * (r.cost / base - 1):+.0f}%" if base else ""
            parts.append(f"{r.label}{rel}")
        f = self.footer or {}
        how = f", {self.jobs_run} at once" if self.jobs_run else ""
        if self.jobs_run and self.probed:
            how = f", the default first, the rest {self.jobs_run} at once"
        if self.jobs_run and self.cpus:
            n = len(self.cpus)
            how += f" on {n} CPU{'s' if n > 1 else ''}"
        burst = ", intermittent program" if self.intermittent else ""
        if self.gate is not None:
            burst += (f", replays held {self.gate.closings} times for {self.gate.closed_s:.1f} s"
                      f" while it ran")
        if self.retried:
            burst += f", capture {len(self.retried) + 1} ({'; '.join(self.retried)})"
        return (f"{len(ranked)} policies replayed on {f.get('events', 0):,} events "
                f"({f.get('duration_s', 0):.2f} s traced{burst}{how}; ranked by slow-path time, priced faults and memory); "
                f"best: {', '.join(parts)}")
