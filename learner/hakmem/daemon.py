"""hakmem-learnd: watches every process that publishes hakmem telemetry and
tunes each program's allocator policy from evidence, and remembers.

SYNCHRONIZATION AND LIFE CYCLE
 1. One thread, one loop (`Daemon.turn`). Signal handlers only set a flag; the
    loop looks at it once per turn. Periodic tasks keep their own deadlines:
    discovery (every discover_period), sampling (every sample_period),
    retention (every retain_every). Between deadlines the loop waits on the
    control socket, so requests are answered at once.
 2. A process is tracked from its telemetry file's appearance to its death.
    Its program (executable + build, procfs.py) owns the learner. A new
    process of a program gets the program's policy at once: the one its live
    siblings run, else the pinned one, else the best stored (warm start).
 3. Every `sample_period` each live process gives one window (record deltas
    from its ring, faults and resident memory from /proc); a program's
    windows are summed and given to its learner, whose decision is written
    into every live process's policy snapshot. A window counts as evidence
    for a policy only when every process that allocated in it had confirmed
    it (applied_version) before the window began (learning.Window.knobs);
    a process that allocated nothing in the window cannot have looked.
 4. Everything for the store goes through `Writes`, a queue applied in order:
    when the database is locked, read-only or full, rows wait in memory and
    are written when it can be written again. Nothing sampled is lost but
    the window being sampled when learnd is killed.
 5. The shared-memory directory is sticky and world-writable (like /tmp) so
    every user's services can publish; a file is believed only when its owner
    owns the live process it names (ring.Ring).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import stat
import sys
import time
import traceback

from . import __version__
from . import layout as L
from .cli.common import printable
from .config import Config, ConfigError, load
from .learners.base import pause
from .learning import Context, Decision, Evaluation, Window, canonical, same
from .objective import Prices, default_objective, window_time_cost
from .discovery import Candidate, Directory
from .lease import Lease, LeaseError
from .procfs import cpu_seconds_between, proc_rss, proc_start_time, proc_stat, proc_uids, program_identity
from .ring import Ring, RingError
from .store import Store, StoreError, program_key

PENDING_MAX = 200_000          # rows kept in memory while the store cannot be written
UNTAKEN_CAPTURE_S = 60.0       # a finished capture nobody took in this long is abandoned (sweep_captures)
SLOW_TURN_S = 0.5              # a turn longer than this keeps requests waiting: said in the log once a minute
STALL_TURN_S = 2.0             # ... and one longer than this every time, with the parts that took it
SWITCH_INTERVAL_S = 0.0005     # the GIL handed over this often (main): see there
NOFILE_WANT = 65536            # descriptors learnd asks for (soft RLIMIT_NOFILE, up to the hard limit)
FD_RESERVE = 256               # kept for learnd's own work: its database, sockets, directory listings,
                               # hakmem-bpf, a screening's replays (3 pipes each, 24 at once) and copies


def raise_nofile(want: int = NOFILE_WANT) -> int:
    """Raises the soft RLIMIT_NOFILE towards want (never past the hard
    limit); returns the soft limit in force. Every descriptor learnd holds
    for something outside it (a process's telemetry file, a metrics client)
    is counted against what this leaves after FD_RESERVE (Daemon.fd_budget),
    so that no user's processes or connections can take the last one."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    goal = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < goal:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (goal, hard))
            soft = goal
        except (OSError, ValueError):
            pass
    return int(soft) if soft != resource.RLIM_INFINITY else NOFILE_WANT


def where(e: BaseException) -> str:
    """file:line of the innermost frame of e in hakmem's own code: enough for
    a one-line report to be found in the source."""
    tb = traceback.extract_tb(e.__traceback__)
    ours = [f for f in tb if f"{os.sep}hakmem{os.sep}" in f.filename] or tb
    if not ours:
        return "?"
    f = ours[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno}"


class Log:
    """One line per event on stderr: timestamped with --foreground, else
    with a syslog priority prefix that journald reads (sd-daemon(3))."""
    PRIO = {"error": 3, "warning": 4, "info": 6, "debug": 7}

    def __init__(self, foreground: bool, stream=None, verbose=False):
        self.foreground = foreground
        self.stream = stream or sys.stderr
        self.verbose = verbose

    def __call__(self, level: str, msg: str):
        if level == "debug" and not self.verbose:
            return
        msg = printable(msg)     # program names are any user's to choose
        if self.foreground:
            line = f"{time.strftime('%H:%M:%S')} hakmem-learnd: {level if level != 'info' else ''}{': ' if level != 'info' else ''}{msg}"
        else:
            line = f"<{self.PRIO[level]}>{msg}"
        try:
            print(line, file=self.stream, flush=True)
        except (OSError, ValueError):
            pass


class Writes:
    """The store's write queue (point 4). Each op is a callable(store) that
    is idempotent or runs once; ops run in order and stop at the first failure."""

    def __init__(self, store: Store, log: Log):
        self.store = store
        self.log = log
        self.ops: list = []
        self.failing: str | None = None
        self.dropped = 0
        self.broken = 0                  # writes dropped because they failed for a reason not the store's

    def add(self, op):
        self.ops.append(op)
        if len(self.ops) > PENDING_MAX:
            self.ops.pop(0)
            self.dropped += 1

    def flush(self) -> bool:
        done = 0
        while True:
            try:
                for op in self.ops:
                    op(self.store)
                    done += 1
                break
            except StoreError as e:
                del self.ops[:done]
                if self.failing != str(e):
                    self.log("warning", f"{e}: keeping {len(self.ops)} writes in memory and retrying")
                self.failing = str(e)
                return False
            except Exception as e:
                # Not the database: a write that cannot be made at all (a
                # bug). Retried, it would hold every later write back for ever.
                self.broken += 1
                self.log("error", f"internal error in a write, dropped ({type(e).__name__}: {e} at {where(e)})")
                del self.ops[:done + 1]
                done = 0
        del self.ops[:done]
        if self.failing:
            self.log("info", f"database writable again: {done} pending writes stored")
            self.failing = None
        return True


@dataclasses.dataclass
class Proc:
    path: str
    ring: Ring
    pid: int
    start_time: int
    uid: int
    program: "Program"
    first_seen: float
    process_id: int | None = None
    prev_rec: object = None          # the record the current window starts from
    prev_stat: dict | None = None
    rss_sum: float = 0.0
    rss_n: int = 0
    written_version: int = 0         # the last snapshot we published
    written_knobs: dict | None = None
    confirmed_at: float | None = None  # when the allocator was seen applying written_knobs
    rejected: int = 0
    windows: int = 0
    last_cost: float = 0.0
    last_allocs: float = 0.0
    last_rss: float = 0.0
    threads: int = 0
    kernel: tuple = ("proc", "", None)   # hakmem-bpf (kernel.py): source, why, rates of its last window


@dataclasses.dataclass
class Program:
    key: str
    exe: str
    build_id: str
    users: str                       # whose evidence it pools: one uid, or the configured pool
    header: dict
    program_id: int | None = None
    default: dict | None = None
    learner: object = None
    learner_name: str = ""
    objective: object = None
    ctx: Context | None = None
    target: dict | None = None       # the knobs learnd wants in force
    target_origin: str = "default"
    pinned: bool = False
    told_mix_known: bool = False     # logged once that its mix cycles (gp.py "mix_memory")
    procs: dict = dataclasses.field(default_factory=dict)   # path -> Proc
    first_seen: float = 0.0
    last_seen: float = 0.0
    last_window: Window | None = None
    screen: object = None            # screen.Screen while a screening is under way
    fleet_prior: dict | None = None  # the fleet's policy it started from, until the local A/B judged it
    fault: str | None = None         # why its learning stopped (Daemon.guard), until its processes restart

    @property
    def class_size(self):
        return self.header["class_size"]


class Daemon:
    def __init__(self, cfg: Config, log: Log, store: Store, clock=time, prices: Prices | None = None):
        self.cfg = cfg
        self.log = log
        self.store = store
        self.clock = clock
        self.prices = prices or Prices()
        self.writes = Writes(store, log)
        self.programs: dict[str, Program] = {}
        self.procs: dict[str, Proc] = {}
        self.dir = Directory(cfg.shm_dir, clock, log)
        self.started = clock.time()
        self.next_discover = self.next_sample = 0.0
        self.next_retain = clock.monotonic() + cfg.retain_every
        self.window_start = clock.monotonic()
        self.rep = self.pub = self.zctx = None
        self.control = None                  # control.Server on self.rep (bind_sockets)
        self.lease: Lease | None = None
        self.next_lease_check = 0.0
        self.fatal: str | None = None        # why the loop stopped on its own
        self.turns = 0
        self.metrics = None                  # metrics.Metrics with --metrics: fed each sample
        self.kernel = None                   # kernel.KernelSource: hakmem-bpf, else /proc (main starts it)
        self.screen_off: str | None = None   # why screening cannot run here (no replayer), said once
        self.internal_errors = 0             # failures caught by guard(): each a bug, each contained
        self.slow_turns = 0                  # turns longer than SLOW_TURN_S (said once a minute)
        self.turn_parts: dict[str, float] = {}   # this turn's seconds, by part (guard's `what`)
        self.next_slow_note = 0.0
        self.fd_budget(raise_nofile(0))      # main() raises the limit first; here it is only read
        self.by_uid: dict[int, int] = {}     # processes tracked per owner (each holds a descriptor)
        self.fleet = None                    # fleet.FleetLink with --fleet (main starts it)
        from .learners import LEARNERS
        self.learners = LEARNERS
        if cfg.learner not in LEARNERS:
            raise ConfigError(f"unknown learner {cfg.learner!r} (known: {', '.join(sorted(LEARNERS))})")
        preload = getattr(LEARNERS[cfg.learner], "preload", None)
        if preload is not None:
            preload()                    # now, not inside a turn that requests wait on

    # ---- start and stop ---------------------------------------------------------
    def prepare_dirs(self):
        """The telemetry directory as the trust model needs it, then its lease.

        Root makes it root's, mode 1777 (every user's services publish there;
        sticky: nobody removes another's file). Whatever squats the name (a
        link, a file, a directory another user made first) would otherwise
        keep learnd from starting, or lead it elsewhere: root replaces a link
        or file, and takes a squatted directory over (chown through a
        descriptor opened without following links). Anyone else uses only a
        directory owned by root or by themselves."""
        d = self.cfg.shm_dir
        root = os.geteuid() == 0
        for _ in range(3):
            try:
                os.mkdir(d, 0o700)
                self.log("debug", f"created the telemetry directory {d}")
            except FileExistsError:
                pass
            except OSError as e:
                raise ConfigError(f"cannot create the telemetry directory {d}: {e.strerror}") from None
            st = os.lstat(d)
            if stat.S_ISDIR(st.st_mode):
                break
            if not root:
                raise ConfigError(f"{d} is not a directory (uid {st.st_uid} made it): refusing to use it")
            os.unlink(d)
            self.log("warning", f"{d} was a {'symbolic link' if stat.S_ISLNK(st.st_mode) else 'file'} of "
                                f"uid {st.st_uid}: removed, making the directory")
        else:
            raise ConfigError(f"{d} keeps being replaced while learnd makes it")
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ConfigError(f"cannot open the telemetry directory {d}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_uid not in (0, os.geteuid()):
                if not root:
                    raise ConfigError(f"{d} is owned by uid {st.st_uid}, not by root or us: refusing to trust it")
                os.fchown(fd, 0, 0)
                self.log("warning", f"{d} was made by uid {st.st_uid}: took it over (now root's, 1777)")
                st = os.fstat(fd)
            want = 0o1777 if root else stat.S_IMODE(st.st_mode) | 0o700
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != want:
                os.fchmod(fd, want)
            elif stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX:
                raise ConfigError(f"{d} is writable by others without the sticky bit: refusing to use it")
        finally:
            os.close(fd)
        try:
            self.lease = Lease(d).acquire()
        except LeaseError as e:
            raise ConfigError(str(e)) from None

    def open_endpoints(self):
        import zmq
        from . import control
        self.lock_fd = control.lock_run_dir(self.cfg.run_dir)     # held for life
        from .screen import sweep_stale
        if sweep_stale():
            self.log("info", "removed screening traces a learnd that is gone left behind")
        self.zctx = zmq.Context()
        self.rep, self.pub = control.bind(self.zctx, self.cfg.run_dir)
        self.backend = _live_backend(self)
        self.control = control.Server(self.rep, self.backend)
        # A learner's long computation (a GP's fit: seconds on a loaded
        # machine) answers, between its steps, the requests that only read.
        from .learners.base import set_pause
        set_pause(lambda: self.control.serve(readonly=True))

    def check_lease(self, now_mono):
        """Still the holder of the directory's lease? Root may have replaced a
        user's learnd, or the directory was removed; take it again when we
        can, stop when another learnd holds it."""
        if now_mono < self.next_lease_check or self.lease is None:
            return
        self.next_lease_check = now_mono + 1.0
        if self.lease.held():
            return
        self.lease.release()
        self.lease = None
        try:
            self.prepare_dirs()
            self.dir = Directory(self.cfg.shm_dir, self.clock, self.log)
            self.log("warning", f"the lease on {self.cfg.shm_dir} was lost (directory or learnd.lock removed); "
                                f"taken again")
        except ConfigError as e:
            self.fatal = f"lost the telemetry directory: {e}"
            self.log("error", self.fatal)

    def close(self):
        if self.metrics is not None:
            self.metrics.close()
        if self.fleet is not None:
            self.fleet.close()       # what it did not push waits in the outbox for the next start
        if self.kernel is not None:
            self.kernel.stop()
        for prog in self.programs.values():
            self._flush_learner(prog)
            if prog.screen is not None:
                prog.screen.close()
                prog.screen = None
        for p in list(self.procs.values()):
            p.ring.close()
        self.procs.clear()
        self.writes.flush()
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self.zctx is not None:
            from .learners.base import set_pause
            set_pause(None)
            for s in (self.rep, self.pub):
                s.close(linger=0)
            self.zctx.term()
            from . import control
            for path in (control.control_path(self.cfg.run_dir), control.events_path(self.cfg.run_dir)):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def fd_budget(self, nofile: int):
        """How many telemetry files learnd keeps open (one descriptor each):
        what RLIMIT_NOFILE leaves after FD_RESERVE and the metrics
        endpoint's clients, and at most half of that for the processes of
        any one user (a learnd of one user has them all), so that a user
        who starts thousands of preloaded processes stops being tracked
        before anybody else's processes, or learnd's own work, would."""
        from .metrics import MAX_CLIENTS
        self.nofile = nofile
        self.max_tracked = max(16, nofile - FD_RESERVE - MAX_CLIENTS)
        self.max_per_user = max(16, self.max_tracked // 2) if os.geteuid() == 0 else self.max_tracked

    def _over_budget(self, c: Candidate) -> str | None:
        if len(self.procs) >= self.max_tracked:
            return (f"learnd tracks {len(self.procs)} processes, all its descriptors allow "
                    f"(RLIMIT_NOFILE {self.nofile}): not tracked")
        if self.by_uid.get(c.uid, 0) >= self.max_per_user:
            return (f"learnd tracks {self.by_uid[c.uid]} processes of uid {c.uid}, one user's share of its "
                    f"descriptors (RLIMIT_NOFILE {self.nofile}): not tracked")
        return None

    # ---- crash-only, per program ------------------------------------------------
    @contextlib.contextmanager
    def guard(self, prog: Program | None, what: str):
        """Runs one piece of learnd's work so that its failure ends that work
        and nothing else: nothing one program's processes, screening, trial
        or pin do may end the daemon. A failure here is a bug (every
        expected failure is handled where it happens); it is logged in one
        line, counted (status, metrics), and the program it belongs to stops
        learning (_fault) until its processes restart; learnd goes on."""
        t0 = time.monotonic()
        try:
            yield
        except Exception as e:
            self.internal_errors += 1
            why = f"{type(e).__name__}: {e} at {where(e)}"
            if prog is None:
                self.log("error", f"internal error while {what} ({why}); going on")
            else:
                self._fault(prog, what, why)
        finally:
            self._took(f"{what} {os.path.basename(prog.exe)}" if prog is not None else what, t0)

    def _took(self, what: str, t0: float):
        """Adds the time since t0 to this turn's part `what`: a slow turn's
        warning names the parts that took it."""
        self.turn_parts[what] = self.turn_parts.get(what, 0.0) + time.monotonic() - t0

    def _fault(self, prog: Program, what: str, why: str):
        """Ends what the program was doing: its screening is closed, its
        learner replaced by one that only keeps the policy in force (a
        policy is only ever one the allocator accepted), until its last
        process exits and a new one starts it afresh (_activate)."""
        first = prog.fault is None
        prog.fault = f"{what}: {why}"
        if prog.screen is not None:
            scr, prog.screen = prog.screen, None
            with contextlib.suppress(Exception):
                scr.close()
        with contextlib.suppress(Exception):
            prog.learner_name = "static"
            prog.learner = self.learners["static"]()
            if prog.ctx is not None:
                prog.learner.start(prog.ctx, prog.target or prog.default, [])
        if first:
            self.event("error", f"internal error while {what} ({why}); its learning stops, the policy in force "
                                f"stays, until its processes restart", prog, level="error")
        else:
            self.log("debug", f"{prog.exe}: internal error again while {what} ({why})")

    # ---- events ---------------------------------------------------------------
    def event(self, kind, message, prog: Program | None = None, pid=0, level="info", knobs=None,
              cost=None, baseline=None):
        where = f"{os.path.basename(prog.exe)}" if prog else ""
        if pid:
            where += f"[{pid}]"
        self.log(level, f"{kind} {where}: {message}" if where else f"{kind}: {message}")
        if self.metrics is not None:
            self.metrics.event(kind, prog)
        if self.pub is None:
            return
        from . import control
        from ._pb import hakmem_pb2 as pb
        ev = pb.Event(time=self.clock.time(), kind=kind, program=prog.key if prog else "", pid=pid,
                      message=message)
        if knobs is not None:
            ev.policy.knobs.CopyFrom(control.knobs_to_pb(knobs))
            ev.policy.program = prog.key if prog else ""
        if cost is not None:
            ev.has_cost = True
            ev.cost = cost
            ev.baseline_cost = baseline if baseline is not None else 0.0
        try:
            control.publish(self.pub, ev)
        except Exception as e:    # a full or broken PUB socket must not stop learning
            self.log("debug", f"publish failed: {e}")

    # ---- discovery ------------------------------------------------------------
    def discover(self, now_mono):
        """New files tracked, files gone noticed, within discovery.py's budgets."""
        tracked = {os.path.basename(p) for p in self.procs}
        if self.dir.scan(now_mono, tracked):
            for path in [p for p in self.procs if os.path.basename(p) not in self.dir.names]:
                self._gone(self.procs[path], "its telemetry file was removed")
        self.dir.due_retries(now_mono)
        for c in self.dir.candidates(tracked):
            try:
                if proc_start_time(c.pid) != c.start_time:
                    self._remove_stale(c, now_mono)
                elif (full := self._over_budget(c)) is not None:
                    self._ignore(c, full, now_mono)
                else:
                    self._track(c, now_mono)
            except Exception as e:
                # A bug met by one file: that file is left (and looked at
                # again after its backoff), the others are not.
                self.internal_errors += 1
                self.log("error", f"internal error while examining {c.name} ({type(e).__name__}: {e} at "
                                  f"{where(e)}); leaving it")
                p = self.procs.get(c.path)
                if p is not None:
                    with contextlib.suppress(Exception):
                        self._gone(p, "internal error")
                with contextlib.suppress(Exception):
                    self._ignore(c, f"internal error ({type(e).__name__})", now_mono, quiet=True)
        if self.dir.changed_by_us:
            self.dir.changed_by_us = False
            self.dir.settle()
        for line in self.dir.summary(now_mono):
            self.log("warning", line)

    def _ignore(self, c: Candidate, why, now_mono, quiet=False):
        if self.dir.judge(c, why, now_mono, quiet) and not quiet:
            self.event("ignored_file", f"{c.name}: {why}", level="warning")

    def _remove_stale(self, c: Candidate, now_mono):
        """A name whose process is gone: whatever it is (a file left by
        _exit or a kill, a link, a FIFO), the name goes. unlink never
        follows a link; the sticky bit lets only its owner or root do it."""
        try:
            if stat.S_ISDIR(os.lstat(c.path).st_mode):
                self._ignore(c, "a directory, not a telemetry file", now_mono)
                return
            os.unlink(c.path)
            self.dir.removed(c)
            self.log("debug", f"removed stale telemetry file {c.name} (process {c.pid} is gone)")
        except FileNotFoundError:
            self.dir.forget(c.name)
        except OSError as e:
            self._ignore(c, f"stale, but cannot be removed: {e.strerror}", now_mono)

    def sweep_captures(self, now_mono):
        """Removes live captures' traces nobody will take: those whose process
        is gone (it exited or was killed mid-capture; each is up to the
        bytes asked for, 1 GiB for `hakmem trace record`, in RAM), those a
        live process finished or moved on from UNTAKEN_CAPTURE_S ago without
        the one who asked taking them (a `hakmem trace record` killed while
        it waited), and names made by somebody other than the process's user
        (a capture's name cannot be guessed now, capture.request; such a
        file is junk). Whoever owns them: the directory is sticky, and root
        may remove any; a learnd of one user removes what it may."""
        for name, pid, start, req in self.dir.captures_due(now_mono):
            path = os.path.join(self.cfg.shm_dir, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            why = None
            uids = proc_uids(pid) if proc_start_time(pid) == start else None
            if uids is None:
                why = f"process {pid} is gone"
            elif not stat.S_ISREG(st.st_mode) or st.st_uid != uids[1]:
                why = f"made by uid {st.st_uid}, not by process {pid} (uid {uids[1]})"
            else:
                p = self.procs.get(os.path.join(self.cfg.shm_dir, f"{pid}-{start}"))
                if p is not None and time.time() - st.st_mtime > UNTAKEN_CAPTURE_S:
                    from .capture import answer
                    try:
                        a = answer(p.ring, req)
                    except RingError:
                        a = (0, 0)
                    if a is None:
                        why = "its process moved on to a later capture; nobody took it"
                    elif a[0] != 1:                  # 1: recording
                        why = f"finished over {UNTAKEN_CAPTURE_S:g} s ago; nobody took it"
            if why is None:
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                self.log("debug", f"cannot remove the capture {name} ({why}): {e.strerror}")
                continue
            self.dir.tally[st.st_uid].removed += 1
            self.dir.changed_by_us = True
            self.log("debug", f"removed the capture {name}: {why}")

    @staticmethod
    def _age(path) -> float:
        try:
            return time.time() - os.lstat(path).st_mtime
        except OSError:
            return 0.0

    def _remove_squatter(self, c: Candidate):
        """A file of one user named after another user's live process keeps
        that process from making its own (it retries, backing off to 16 s):
        the name goes, when we may remove it (root may)."""
        try:
            os.unlink(c.path)
        except OSError:
            return
        self.dir.forget(c.name)
        self.dir.changed_by_us = True
        self.log("warning", f"removed {c.name}: a file of uid {c.uid} named after process {c.pid} of another user")

    def _track(self, c: Candidate, now_mono):
        path, pid = c.path, c.pid
        try:
            ring = Ring(path, writable=True)
        except RingError as e:
            why = str(e).split(": ", 1)[-1]
            # Being created: the magic is stored last. Look again soon and
            # say nothing unless it stays that way.
            young = c.ino and "bad magic" in why and self._age(path) < 2.0
            self._ignore(c, why, now_mono, quiet=young)
            if not young and "not trusted" in why:
                self._remove_squatter(c)
            return
        if not ring.alive:
            ring.close()
            return
        ident = program_identity(pid)
        if ident is None:
            ring.close()
            self._ignore(c, f"cannot read /proc/{pid}/exe", now_mono)
            return
        exe, build_id = ident
        try:
            header = ring.header()
            in_force = ring.policy_in_force(timeout=0)
        except RingError as e:
            ring.close()
            self._ignore(c, str(e).split(": ", 1)[-1], now_mono)
            return
        # Learning is per user (config.py: pool_users): what one user's
        # processes show never sets the policy of another user's.
        users = self.cfg.users_key(ring.file_uid)
        key = program_key(exe, build_id, users)
        now = self.clock.time()
        prog = self.programs.get(key)
        fresh = prog is None
        if prog is None:
            prog = Program(key=key, exe=exe, build_id=build_id, users=users, header=header, first_seen=now)
            self.programs[key] = prog
        elif list(prog.header["class_size"]) != list(header["class_size"]):
            ring.close()
            self._ignore(c, "its class table differs from the program's other processes", now_mono)
            return
        prog.last_seen = now
        p = Proc(path=path, ring=ring, pid=pid, start_time=ring.start_time, uid=ring.file_uid, program=prog,
                 first_seen=now)
        try:
            p.prev_rec = ring.latest()
        except RingError as e:
            ring.close()
            self._ignore(c, str(e).split(": ", 1)[-1], now_mono)
            return
        p.prev_stat = proc_stat(pid)
        # What it runs now counts as confirmed: a later write replaces it.
        p.written_knobs, p.confirmed_at = canonical(in_force), now_mono
        self.procs[path] = p
        self.by_uid[p.uid] = self.by_uid.get(p.uid, 0) + 1
        was_idle = not prog.procs
        prog.procs[path] = p
        self.dir.forget(c.name)
        self._register(prog, p, in_force if header["applied_version"] == 0 else None, fresh)
        if was_idle:
            self._activate(prog, p)
        elif prog.target is not None:
            self._write(p, prog.target)
        self.event("process_started", f"{exe} ({len(prog.procs)} of its program live)", prog, pid)

    def _register(self, prog: Program, p: Proc, default_knobs, fresh):
        """Program and process rows; the default policy the first time one is seen."""
        if default_knobs is not None and prog.default is None:
            prog.default = canonical(default_knobs)
        exe, build_id, users, sizes = prog.exe, prog.build_id, prog.users, list(prog.class_size)
        start, uid, pid = p.start_time, p.uid, p.pid

        def op(store: Store):
            if prog.program_id is None:
                prog.program_id = store.program(exe, build_id, users, sizes)
            if p.process_id is None:
                p.process_id = store.process(prog.program_id, pid, start, uid)
        self.writes.add(op)
        if prog.default is not None:
            knobs = prog.default
            self.writes.add(lambda s: s.policy(prog.program_id, knobs, "default"))
        self.writes.flush()

    def _stored_default(self, prog: Program):
        if prog.program_id is None:
            return None
        try:
            for pol in self.store.policies(prog.program_id):
                if pol["origin"] == "default":
                    return pol["knobs"]
        except Exception:
            return None
        return None

    def _objective_for(self, prog: Program, pid):
        over = self.cfg.for_program(prog.exe)
        if over.objective is not None:
            return over.objective
        if self.cfg.objective_explicit:
            return self.cfg.objective
        return default_objective(pid, self.cfg.objective)

    def _activate(self, prog: Program, p: Proc):
        """The first live process of a program (again): start its learner from
        the best stored policy and what was measured before (warm start)."""
        if prog.default is None:
            prog.default = self._stored_default(prog) or canonical(p.written_knobs)
        prog.fault = None
        if prog.screen is not None:          # a screening started for a learner that is replaced now
            scr, prog.screen = prog.screen, None
            scr.close()
            self.log("info", f"{os.path.basename(prog.exe)}: its screening ended with the learner it was for")
        over = self.cfg.for_program(prog.exe)
        prog.objective = self._objective_for(prog, p.pid)
        explore = self.cfg.explore if over.explore is None else over.explore
        name = over.learner or self.cfg.learner
        chosen = None
        try:
            if prog.program_id is not None:
                chosen = self.store.chosen(prog.program_id)
        except Exception as e:
            self.log("warning", f"cannot read the stored policy of {prog.exe}: {e}")
        if chosen is not None:
            # Stored by an earlier hakmem that took any value (import and pin
            # check the bounds now): the allocator would reject it whole.
            from .knobs import Bounds, Knobs, KnobsError
            try:
                Knobs.of(chosen["knobs"]).check(Bounds.from_header(prog.header), prog.class_size)
            except (KnobsError, KeyError, TypeError, ValueError) as e:
                self.event("error", f"stored policy v{chosen['version']} ({chosen['origin']}) is outside the "
                                    f"allocator's bounds ({e}): not applied", prog, p.pid, level="warning")
                chosen = None
        prog.pinned = bool(chosen and chosen["pinned"])
        if prog.pinned:
            name, explore = "static", False
        if name not in self.learners:
            self.log("warning", f"{prog.exe}: unknown learner {name!r}, using {self.cfg.learner}")
            name = self.cfg.learner
        prog.learner_name = name
        prog.learner = self.learners[name]()
        prog.ctx = Context.from_header(prog.key, prog.header, prog.default, prog.objective,
                                       sample_period_s=self.cfg.sample_period, explore=explore)
        # A program new to this host starts from the fleet's policy when the
        # fleet offers one; the local A/B against the default decides.
        prog.fleet_prior = None
        offer = None
        if chosen is None and explore and self.fleet is not None and hasattr(prog.learner, "challenge"):
            offer = self._fleet_offer(prog, p)
        if offer is not None:
            prog.fleet_prior = canonical(offer.knobs)
            self.fleet.adopted += 1
            self.writes.add(lambda s, k=prog.fleet_prior: s.policy(prog.program_id, k, "learned",
                                                                   note="from the fleet"))
        incumbent = chosen["knobs"] if chosen else (prog.fleet_prior or prog.default)
        history = []
        try:
            if prog.program_id is not None and not prog.pinned:
                history = self.store.priors(prog.program_id, prog.objective.describe())
        except Exception as e:
            self.log("warning", f"cannot read the history of {prog.exe}: {e}")
        mixes = []
        if history and hasattr(prog.learner, "remember"):
            try:
                mixes = self.store.recent_mixes(prog.program_id)
            except Exception as e:
                self.log("warning", f"cannot read the size mixes {prog.exe} ran before: {e}")
        if chosen:
            self._set_target(prog, chosen["knobs"], chosen["origin"])
            self.event("warm_start", f"policy v{chosen['version']} ({chosen['origin']}"
                                     f"{', pinned' if prog.pinned else ''}) applied at start; "
                                     f"{len(history)} policies measured before"
                                     f"{f', the size mixes of {len(mixes)} windows' if mixes else ''}",
                       prog, p.pid, knobs=chosen["knobs"])
        dec = prog.learner.start(prog.ctx, incumbent, history)
        if mixes:
            prog.learner.remember(mixes)
        if offer is not None:
            prog.learner.challenge(prog.default, "the default against the fleet's policy")
            self.event("fleet_start", f"the fleet's policy applied at start ({offer.describe()}); the local A/B "
                                      f"against the default decides", prog, p.pid, knobs=offer.knobs)
        if dec is not None:
            self._decide(prog, dec)
        elif prog.target is None:
            prog.target = prog.default
            prog.target_origin = "default"
        # A program is screened once per objective: cold, and warm until a
        # screening of it has ranked (a cold run cut short, or one whose
        # screening failed, left a stored policy and no ranking).
        if explore and self.cfg.screen and hasattr(prog.learner, "screened") and offer is None and \
                (chosen is None or not self._screened_before(prog)):
            self._start_screen(prog)

    def _fleet_offer(self, prog: Program, p: Proc):
        """The fleet's offer for this program if it fits the allocator's bounds
        (a host of the fleet may push anything: one host's outlier is never
        applied outside them)."""
        offer = self.fleet.offer(prog.build_id, prog.exe, prog.users)
        if offer is None:
            return None
        from .knobs import Bounds, Knobs, KnobsError
        try:
            Knobs.of(offer.knobs).check(Bounds.from_header(prog.header), prog.class_size)
        except (KnobsError, KeyError, TypeError, ValueError) as e:
            self.event("error", f"the fleet's policy is outside the allocator's bounds ({e}): not applied", prog,
                       p.pid, level="warning")
            return None
        return offer

    def _screened_before(self, prog: Program) -> bool:
        try:
            return prog.program_id is not None and self.store.screened(prog.program_id, prog.objective.describe())
        except Exception as e:
            self.log("warning", f"cannot read the screenings of {prog.exe}: {e}")
            return True     # unknown: no second capture of the program

    # ---- screening (screen.py) ----------------------------------------------------
    def _start_screen(self, prog: Program):
        """A cold program's candidates ranked on a trace of it before any trial."""
        from .replay import ReplayError, find_replayer
        from .screen import Screen
        try:
            exe = find_replayer()
        except ReplayError as e:
            if not self.screen_off:
                self.screen_off = str(e)
                self.log("warning", f"screening off, learners search without replay: {e}")
            return
        prog.screen = Screen(prog.ctx, self.cfg.shm_dir, prog.objective, self.prices, replayer=exe,
                             jobs=self.cfg.screen_jobs, clock=self.clock)
        prog.screen.learner = prog.learner    # its ranking is for this learner, and no other
        prog.learner.screening()

    def _step_screen(self, prog: Program, now_mono):
        scr = prog.screen
        ranked = scr.step(list(prog.procs.values()), now_mono)
        if ranked is None:
            # Replays under way have their own bound (REPLAY_TIMEOUT_S each):
            # the learner waits for them however long a busy machine leaves
            # them to run, keeping the incumbent, rather than search blind.
            if scr.state == scr.REPLAY and getattr(scr, "learner", None) is prog.learner and \
                    hasattr(prog.learner, "screen_alive"):
                prog.learner.screen_alive()
            return
        prog.screen = None
        if getattr(scr, "learner", None) is not prog.learner:
            # The learner that asked was replaced meanwhile (a pin, an
            # unpin): the ranking is nobody's now.
            self.log("debug", f"{prog.exe}: a screening ended after its learner was replaced; dropped")
            return
        if not ranked:
            self.event("screen_failed", f"{scr.why}; searching without replay", prog, level="warning")
            prog.learner.screened([], scr.why)
            return
        took = now_mono - scr.t_started if scr.t_started is not None else 0.0
        self.event("screened", f"{scr.describe(ranked)}; {took:.1f} s", prog)
        from . import replay as R
        for _, res in scr.results:
            self.writes.add(lambda s, r=res, f=scr.facts, o=prog.objective: R.save(s, f, o, r, prog.program_id,
                                                                            prices=self.prices))
        prog.learner.screened(ranked)

    # ---- applying policies ------------------------------------------------------
    def _write(self, p: Proc, knobs) -> bool:
        if same(p.written_knobs, knobs):
            return True
        try:
            v = p.ring.write_policy(knobs)
        except RingError as e:
            self.event("error", f"cannot write its policy: {e}", p.program, p.pid, level="warning")
            return False
        p.written_version, p.written_knobs, p.confirmed_at = v, canonical(knobs), None
        self._confirm(p, self.clock.monotonic())
        return True

    def _set_target(self, prog: Program, knobs, origin):
        prog.target = canonical(knobs)
        prog.target_origin = origin
        for p in prog.procs.values():
            self._write(p, prog.target)

    def _confirm(self, p: Proc, now_mono):
        if p.written_version == 0 or p.confirmed_at is not None:
            return
        try:
            s = p.ring.status()
        except Exception:
            return
        if s["applied_version"] >= p.written_version:
            p.confirmed_at = now_mono
        elif s["seen_version"] >= p.written_version and p.rejected != p.written_version:
            p.rejected = p.written_version
            self.event("error", f"the allocator rejected snapshot {p.written_version} "
                                f"(reason {s['reject_reason']})", p.program, p.pid, level="warning")

    def _decide(self, prog: Program, dec: Decision):
        ctx = prog.ctx
        knobs = ctx.clamp(dec.knobs)
        origin = "pinned" if prog.pinned else ("learned" if not same(knobs, prog.default) else "default")
        for ev in dec.evaluations:
            self._store_evaluation(prog, ev)
        changed = not same(knobs, prog.target)
        self._set_target(prog, knobs, origin)
        if changed:
            ok = origin
            self.writes.add(lambda s, k=knobs, o=ok: s.policy(prog.program_id, k, o))
        kind = {"explore": "policy_applied", "accept": "policy_accepted", "rollback": "policy_rolled_back",
                "relearn": "relearn", "settle": "policy_settled"}.get(dec.kind, "policy_applied")
        # A verdict is news even when the policy in force stays: an A/B trial
        # (paired.py) may end on one of the incumbent's blocks, and begins
        # with one.
        if changed or dec.kind in ("explore", "accept", "rollback", "relearn", "settle"):
            self.event(kind, dec.reason, prog, knobs=knobs)

    def _store_evaluation(self, prog: Program, ev: Evaluation):
        obj = prog.objective.describe()
        learner = prog.learner_name
        mix = prog.last_window.mix() if prog.last_window is not None else None
        origin = "pinned" if prog.pinned else ("default" if same(ev.knobs, prog.default) else "learned")
        body, kept_prior = None, False
        if self.fleet is not None and prog.default is not None:
            from .fleet import outbox_evaluation, program_ident
            # A trial of the fleet's policy against the default, either way
            # round, is the fleet's (a canary's verdict); the rest is this
            # host's own search.
            fp = prog.fleet_prior
            trial = fp is not None and ev.baseline_knobs is not None and (
                (same(ev.knobs, fp) and same(ev.baseline_knobs, prog.default)) or
                (same(ev.knobs, prog.default) and same(ev.baseline_knobs, fp)))
            body = outbox_evaluation(program_ident(prog.exe, prog.build_id, prog.users), ev, prog.default,
                                     "fleet" if trial else "local", learner, obj)
            # The default challenged the fleet's policy and did not win: the
            # fleet's policy is this host's best now.
            kept_prior = trial and same(ev.knobs, prog.default) and ev.verdict in ("rejected", "rolled_back")

        def op(store: Store):
            pid_ = store.policy(prog.program_id, ev.knobs, origin)
            base = store.policy(prog.program_id, ev.baseline_knobs, "learned" if not same(ev.baseline_knobs, prog.default)
                                else "default") if ev.baseline_knobs is not None else None
            store.add_evaluation(prog.program_id, pid_, ev, learner, obj, base, fleet_body=body)
            if kept_prior and base is not None:
                self._set_best(store, prog, base, ev.baseline_knobs, mix)
            elif ev.verdict == "accepted" or (ev.verdict == "measured" and store.chosen(prog.program_id) is None
                                              and not prog.pinned):
                self._set_best(store, prog, pid_, ev.knobs, mix)
        self.writes.add(op)

    def _set_best(self, store: Store, prog: Program, policy_id, knobs, mix):
        store.set_best(prog.program_id, policy_id, mix)
        if self.fleet is not None:
            from .fleet import program_ident
            fp = prog.fleet_prior
            origin = "fleet" if fp is not None and same(knobs, fp) else \
                ("default" if same(knobs, prog.default) else "learned")
            store.fleet_queue("best", {"program": program_ident(prog.exe, prog.build_id, prog.users),
                                       "knobs": canonical(knobs), "origin": origin, "t": self.clock.time()})

    def _flush_learner(self, prog: Program):
        if prog.learner is None:
            return
        try:
            for ev in prog.learner.flush():
                self._store_evaluation(prog, ev)
        except Exception as e:
            self.log("warning", f"{prog.exe}: learner flush failed: {e}")

    # ---- sampling -------------------------------------------------------------------
    def _proc_window(self, p: Proc, t0, t1) -> Window:
        """One process's window over [t0, t1] (monotonic): every counter's rate
        between its previous record and its latest, gauges at the latest
        (Window.between), faults, CPU and mean resident memory from /proc."""
        dt = max(t1 - t0, 1e-3)
        rec = p.ring.latest()
        st = proc_stat(p.pid)
        rss = p.rss_sum / p.rss_n if p.rss_n else (proc_rss(p.pid) or 0)
        p.rss_sum, p.rss_n = 0.0, 0
        minflt = cpu = 0.0
        if st is not None and p.prev_stat is not None:
            minflt = max(st["minflt"] - p.prev_stat["minflt"], 0) / dt
            cpu = cpu_seconds_between(p.prev_stat, st) / dt
        if st is not None:
            p.prev_stat = st
        kern, ksrc, kwhy = (self.kernel.window(p.pid, p.start_time, dt) if self.kernel is not None
                            else (None, "proc", "/proc/<pid>/stat: hakmem-bpf not started"))
        p.kernel = (ksrc, kwhy, kern)
        w = Window.between(p.prev_rec, rec, dt, t_start=t0, t_end=t1, minflt=minflt, rss_bytes=float(rss), cpu=cpu,
                           kern=kern, kernel_source=ksrc)
        if rec is not None:
            p.prev_rec = rec
        return w

    def sample(self, t0_mono, t1_mono):
        t1_wall = self.clock.time()
        t0_wall = t1_wall - (t1_mono - t0_mono)
        for prog in list(self.programs.values()):
            if not prog.procs:
                continue
            with self.guard(prog, "sampling"):
                self._sample_program(prog, t0_mono, t1_mono, t0_wall, t1_wall)
            pause()   # reads answered between programs too, not only inside a learner's computations

    def _sample_program(self, prog: Program, t0_mono, t1_mono, t0_wall, t1_wall):
        parts = []
        for p in list(prog.procs.values()):
            if p.ring.alive and proc_start_time(p.pid) != p.start_time:
                self._gone(p, "exited")
                continue
            self._confirm(p, t1_mono)
            try:
                w = self._proc_window(p, t0_mono, t1_mono)
            except RingError as e:
                self._drop(p, str(e).split(": ", 1)[-1], t1_mono)
                continue
            parts.append((p, w))
        if not parts or prog.ctx is None:
            return
        # Evidence for the target only when every process that allocated
        # in the window had applied it before the window began. A process
        # takes up a snapshot when it allocates (a slow path or a
        # check-in); one that allocated nothing here (it wrote no record:
        # PostgreSQL's background writer between its rounds) cannot have
        # looked, and it neither confirms the target nor holds it back.
        in_force = prog.target is not None and all(
            same(p.written_knobs, prog.target)
            and ((p.confirmed_at is not None and p.confirmed_at <= t0_mono) or not w.active)
            for p, w in parts)
        # A window a capture ran in (screening) is evidence for no policy.
        if in_force and prog.screen is not None and prog.screen.tracing_during(t0_mono, t1_mono):
            in_force = False
        knobs = prog.target if in_force else None
        parts = [(p, self._priced(prog, w.replace(t_start=t0_wall, t_end=t1_wall, knobs=knobs)))
                 for p, w in parts]
        win = self._priced(prog, Window.merge([w for _, w in parts], knobs=knobs))
        prog.last_window = win
        if self.metrics is not None:
            self.metrics.observe(prog, parts, win)
        for p, w in parts:
            p.windows += 1
            p.last_rss = w.rss_bytes
            p.last_allocs = float(w.allocs.sum())
            p.threads = w.threads
            p.last_cost = w.cost
            self._store_window(prog, p, w)
        try:
            dec = prog.learner.observe(win)
        except Exception as e:   # a learner bug must not stop learnd, nor leave a bad policy
            self.event("error", f"learner {prog.learner_name} failed ({type(e).__name__}: {e}); "
                                f"keeping the policy in force", prog, level="error")
            dec = None
        if dec is not None:
            self._decide(prog, dec)
        if getattr(prog.learner, "mixes_known", 0) == 1 and not prog.told_mix_known:
            prog.told_mix_known = True
            self.log("info", f"{os.path.basename(prog.exe)}: its size mix moved to one it ran before (a load "
                             f"that cycles): no new search for such moves")
        for ev in prog.learner.pending():
            self._store_evaluation(prog, ev)
        if prog.screen is not None:
            self._step_screen(prog, t1_mono)

    def _priced(self, prog, w: Window) -> Window:
        """w with its costs under the program's objective and learnd's prices."""
        tc = window_time_cost(w, self.prices)
        mc = prog.objective.mem_cost(w.rss_bytes)
        return w.replace(time_cost=tc, mem_cost=mc, cost=tc + mc)

    def _store_window(self, prog, p: Proc, w: Window):
        row = w.row()
        knobs = w.knobs
        origin = "pinned" if prog.pinned else ("default" if same(knobs, prog.default) else "learned")

        def op(store: Store):
            row["process_id"] = p.process_id
            row["policy_id"] = store.policy(prog.program_id, knobs, origin) if knobs is not None else None
            store.add_windows([row])
        self.writes.add(op)

    def _drop(self, p: Proc, why, now_mono):
        """A tracked file that can no longer be read (its owner truncated or
        rewrote it): the process is left, and its name judged like any file
        we cannot trust, so it is not taken up again every turn."""
        self._gone(p, f"its telemetry file became unusable ({why})")
        try:
            st = os.lstat(p.path)
        except OSError:
            return
        self._ignore(Candidate(os.path.basename(p.path), p.path, p.pid, p.start_time, st.st_uid, st.st_ino),
                     why, now_mono)

    def _gone(self, p: Proc, why):
        prog = p.program
        prog.procs.pop(p.path, None)
        if self.procs.pop(p.path, None) is not None:
            left = self.by_uid.get(p.uid, 1) - 1
            if left > 0:
                self.by_uid[p.uid] = left
            else:
                self.by_uid.pop(p.uid, None)
        if self.kernel is not None:
            self.kernel.forget(p.pid, p.start_time)
        try:
            p.ring.close()
        except Exception:
            pass
        if proc_start_time(p.pid) != p.start_time:
            try:
                os.unlink(p.path)
            except OSError:
                pass
        now = self.clock.time()
        self.writes.add(lambda s: s.process_exited(p.process_id, now) if p.process_id else None)
        self.event("process_exited", f"{why} after {now - p.first_seen:.1f} s, {p.windows} windows", prog, p.pid)
        if not prog.procs:
            self._flush_learner(prog)
            if prog.screen is not None:
                prog.screen.close()
                prog.screen = None

    def rss_tick(self, p: Proc):
        r = proc_rss(p.pid)
        if r is not None:
            p.rss_sum += r
            p.rss_n += 1

    # ---- the loop ---------------------------------------------------------------
    def turn(self, wait=True):
        """One turn: whatever is due, then wait for the next deadline or a request."""
        now = self.clock.monotonic()
        self.turn_parts = {}
        if self.control is not None:
            self.control.spent = {}
            # What woke the wait at the last turn's end is answered first, not
            # after this turn's work (seconds, on a loaded machine).
            self.control.serve()
        with self.guard(None, "checking the lease"):
            self.check_lease(now)
        if self.kernel is not None:
            with self.guard(None, "reading hakmem-bpf"):
                self.kernel.poll(p.pid for p in self.procs.values())
        if now >= self.next_discover:
            self.next_discover = now + self.cfg.discover_period
            with self.guard(None, "looking at the telemetry directory"):
                self.discover(now)
            with self.guard(None, "sweeping captures"):
                self.sweep_captures(now)
            for p in list(self.procs.values()):
                with self.guard(p.program, "looking at its process"):
                    self.rss_tick(p)
                    self._confirm(p, now)
                pause()
        if now >= self.next_sample:
            if self.turns:
                self.sample(self.window_start, now)
                if self.metrics is not None:
                    with self.guard(None, "publishing metrics"):
                        self.metrics.publish(self)
            self.window_start = now
            self.next_sample = now + self.cfg.sample_period
            t0 = time.monotonic()
            self.writes.flush()
            self._took("writing to the store", t0)
        if self.fleet is not None:
            with self.guard(None, "exchanging with the fleet"):
                self.fleet.turn(self.writes)
        if now >= self.next_retain:
            t0 = time.monotonic()
            self.next_retain = now + self.cfg.retain_every
            if self.writes.flush():
                try:
                    r = self.store.retain(raw_s=self.cfg.raw_hours * 3600, keep_s=self.cfg.keep_days * 86400,
                                          max_rows=self.cfg.max_windows)
                    self.log("debug", f"retention: {r['before']} -> {r['after']} windows")
                except StoreError as e:
                    self.log("warning", f"retention postponed: {e}")
                except Exception as e:
                    self.internal_errors += 1
                    self.log("error", f"internal error in retention ({type(e).__name__}: {e} at {where(e)}); "
                                      f"postponed")
            self._took("retention", t0)
        self.turns += 1
        if self.rep is not None:
            self.control.serve()
            for what, t in self.control.spent.items():   # here and in a learner's pauses
                self.turn_parts[what] = self.turn_parts.get(what, 0.0) + t
        took = self.clock.monotonic() - now
        if took > SLOW_TURN_S:
            # Requests that change a program waited this long (those that
            # only read are answered inside a learner's long computations).
            self.slow_turns += 1
            if now >= self.next_slow_note or took >= STALL_TURN_S:   # a stall is always said
                self.next_slow_note = now + 60.0
                parts = sorted(self.turn_parts.items(), key=lambda kv: -kv[1])[:3]
                most = ", ".join(f"{what} {t:.2f} s" for what, t in parts if t >= 0.05)
                self.log("warning", f"a turn took {took:.2f} s ({self.slow_turns} turns over {SLOW_TURN_S:g} s so far)"
                                    + (f"; longest: {most}" if most else ""))
        if wait:
            timeout = max(0.0, min(self.next_discover, self.next_sample) - self.clock.monotonic())
            if self.rep is not None:
                self.rep.poll(int(timeout * 1000) + 1)
            else:
                time.sleep(timeout)

    def status_warnings(self):
        out = []
        if self.internal_errors:
            out.append(f"{self.internal_errors} internal errors, each contained (see the log: 'internal error')")
        stopped = [g for g in self.programs.values() if g.fault and g.procs]
        for g in stopped[:5]:
            out.append(f"{os.path.basename(g.exe)}: learning stopped after an internal error ({g.fault})")
        if self.writes.failing:
            out.append(f"{self.writes.failing}: {len(self.writes.ops)} writes waiting in memory")
        if self.writes.dropped:
            out.append(f"{self.writes.dropped} writes dropped (memory bound reached)")
        if self.writes.broken:
            out.append(f"{self.writes.broken} writes dropped after an internal error")
        if self.fleet is not None and not self.fleet.up and self.fleet.last_error:
            out.append(f"fleet unreachable ({self.fleet.last_error}): {self.fleet.backlog} rows wait to be pushed")
        return out


def _live_backend(d: Daemon):
    """The control endpoint's backend: the store's answers plus what only the
    running daemon knows, and pins that take effect at once."""
    from . import control
    from ._pb import hakmem_pb2 as pb
    from .backend import StoreBackend

    class LiveBackend(StoreBackend):
        def status(self):
            st = super().status()
            st.running = True
            st.pid = os.getpid()
            st.started = d.started
            st.learner = d.cfg.learner
            st.objective = d.cfg.objective.describe() + ("" if d.cfg.objective_explicit else
                                                         " (or the cgroup memory limit)")
            st.exploration = d.cfg.explore
            st.sample_period_s = d.cfg.sample_period
            st.programs = sum(1 for g in d.programs.values() if g.procs)
            st.processes = len(d.procs)
            st.warnings.extend(d.status_warnings())
            if d.kernel is not None:
                d.kernel.describe(st)
            if d.fleet is not None:
                st.fleet = d.fleet.line()
            return st

        def live_processes(self):
            out = []
            for p in d.procs.values():
                try:
                    applied = p.ring.status()["applied_version"]
                except RingError:
                    applied = 0
                out.append(pb.Process(pid=p.pid, start_time=p.start_time, program=p.program.key, uid=p.uid,
                                      first_seen=p.first_seen, last_seen=d.clock.time(), alive=True,
                                      applied_version=applied,
                                      rss_bytes=int(p.last_rss), allocs_per_s=p.last_allocs, cost=p.last_cost,
                                      windows=p.windows, threads=p.threads,
                                      kernel_source=p.kernel[0], kernel_why=p.kernel[1],
                                      kernel=[p.kernel[2][n] for n in L.KERNEL_COUNTERS] if p.kernel[2] else []))
            return out

        def decorate_program(self, msg, row):
            super().decorate_program(msg, row)
            g = d.programs.get(row["key"])
            if g is None:
                return
            if g.learner is not None:
                msg.state = "pinned" if g.pinned else (g.learner.state() if g.procs else "idle")
            if g.fault and g.procs:
                msg.state = "stopped (internal error)"
            if g.objective is not None:
                msg.objective = g.objective.describe()
            if g.target is not None:
                msg.in_force.knobs.CopyFrom(control.knobs_to_pb(g.target))
                msg.in_force.program = g.key
            w = g.last_window
            if w is not None:      # hakmem-bpf or /proc, and why (kernel.py)
                msg.kernel_source = w.kernel_source
                msg.kernel_why = "; ".join(sorted({p.kernel[1] for p in g.procs.values() if p.kernel[1]}))
                if w.kernel_source == "bpf":
                    msg.kernel.extend(w.kern[n] for n in L.KERNEL_COUNTERS)
            hot = getattr(getattr(g.learner, "space", None), "hot", None)
            if hot:
                msg.hot_classes.extend(int(c) for c in hot)

        def _restart(self, program, kind, message, knobs=None):
            """A pin or unpin takes effect now: the learner starts again from
            what the store says the program should run."""
            g = d.programs.get(program["key"])
            if g is None or not g.procs:
                return
            # The pin is stored already; applying it is this program's work,
            # under its guard like the rest (a failure stops its learning,
            # never the daemon nor the request).
            with d.guard(g, "applying a pin or unpin"):
                d._flush_learner(g)
                d._activate(g, next(iter(g.procs.values())))
                d.event(kind, message, g, knobs=knobs)

        def on_pin(self, program, policy):
            self._restart(program, "policy_pinned", f"policy v{policy['version']} pinned by an operator",
                          policy["knobs"])

        def on_unpin(self, program, was):
            self._restart(program, "policy_unpinned", "unpinned: learning again from the best known policy")

    return LiveBackend(d.store, run_dir=d.cfg.run_dir, shm_dir=d.cfg.shm_dir)


def lock_database(path) -> int:
    """One learnd per database, whatever its directories: an flock on the
    database file, held for life. flock, not fcntl: SQLite keeps its own
    POSIX locks on this file, and a POSIX lock of ours would merge with
    them (and closing our descriptor would drop theirs). The descriptor is
    closed only after the store is. Returns it."""
    import fcntl
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"cannot open {path} to lock it: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"another hakmem-learnd is using the database {path}") from None
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"cannot lock {path}: {e.strerror}") from None
    return fd


EPILOG = """\
files (as root; see README "Running it in production"):
  /etc/hakmem/learnd.toml     configuration (--config); flags win over it
  /var/lib/hakmem/learn.db    SQLite: programs, processes, windows, policies, evaluations
  /run/hakmem/                control.sock and events.sock (`hakmem status`, `hakmem events`)
  /dev/shm/hakmem/            one telemetry file per process using hakmem (1777, sticky)

signals:
  SIGTERM, SIGINT             store what was measured, remove the sockets, exit 0
  SIGUSR1                     write every thread's stack to the log (what a slow turn is doing)

exit status:
  0 stopped by a signal; 1 an error, said in one line "hakmem-learnd: error: ..."

examples:
  hakmem-learnd --config /etc/hakmem/learnd.toml          as the systemd unit runs it
  hakmem-learnd --foreground --metrics                    by hand, Prometheus on 127.0.0.1:9711
  LD_PRELOAD=/usr/local/lib/libhakmem.so.0 redis-server   a service it will tune
  hakmem policy show redis-server                         what it learned

see also: hakmem --help, README.md (installed in /usr/local/share/doc/hakmem)"""


def build_parser():
    p = argparse.ArgumentParser(
        prog="hakmem-learnd",
        description="Watches processes that use libhakmem and tunes each program's allocator policy "
                    "(thread-cache capacity, warm pool, drain interval) from measurements, remembering "
                    "the best policy per program in SQLite.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (see deploy/learnd.toml)")
    p.add_argument("--db", help="SQLite database (default /var/lib/hakmem/learn.db as root, else "
                                "~/.local/state/hakmem/learn.db; $HAKMEM_DB)")
    p.add_argument("--shm-dir", help="telemetry directory processes publish in (default /dev/shm/hakmem)")
    p.add_argument("--run-dir", help="directory of the control and events sockets (default /run/hakmem "
                                     "as root, else $XDG_RUNTIME_DIR/hakmem; $HAKMEM_RUN_DIR)")
    p.add_argument("--sample-period", type=float, metavar="S", help="seconds per window (default 1)")
    p.add_argument("--objective", metavar="lambda=N|budget=SIZE",
                   help="what to minimise: allocator time + N per GiB resident (default lambda=0.125), or "
                        "time under a memory budget; default: the cgroup's memory limit when there is one")
    p.add_argument("--learner", help="gp (default), missdriven or static")
    p.add_argument("--pool-users", metavar="USER,...",
                   help="users whose processes share what is learned about a program (default: none; every "
                        "user's processes are a program of their own, so no user can steer another's policy)")
    p.add_argument("--no-explore", dest="explore", action="store_false", default=None,
                   help="measure and apply stored policies, never try new ones")
    p.add_argument("--no-screen", dest="screen", action="store_false", default=None,
                   help="never capture and replay a trace of a new program to rank candidates before "
                        "trying them (screening; on by default where build/hakmem-replay is found)")
    p.add_argument("--foreground", action="store_true", help="timestamped log lines on stderr "
                                                             "(default: journald-style lines)")
    p.add_argument("--metrics", metavar="ADDR", nargs="?", const="",
                   help="serve Prometheus metrics at http://ADDR/metrics: PORT, HOST:PORT or [V6]:PORT; "
                        "alone: 127.0.0.1:9711 (see hakmem/metrics.py for what is exported)")
    p.add_argument("--fleet", metavar="URL",
                   help="share evaluations and best policies with other hosts through PostgreSQL "
                        "(postgresql://ROLE@HOST/DB; the role made by `hakmem fleet add-host`)")
    p.add_argument("--fleet-pull", type=float, metavar="S", help="seconds between pulls of the fleet's offers "
                                                                "(default 5)")
    p.add_argument("--fleet-class", metavar="CLASS", help="this host's hardware class in the fleet (default: "
                                                          "from its CPUs and memory, e.g. c2-m16)")
    p.add_argument("--once", action="store_true", help="run one turn and exit (for tests)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug lines too")
    p.add_argument("--version", action="version", version=f"hakmem-learnd {__version__}")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    log = Log(args.foreground, verbose=args.verbose)

    def fail(msg):
        print(f"hakmem-learnd: error: {msg}", file=sys.stderr)
        return 1
    try:
        cfg = load(args.config, db=args.db, shm_dir=args.shm_dir, run_dir=args.run_dir,
                   sample_period=args.sample_period, objective=args.objective, learner=args.learner,
                   explore=args.explore, pool_users=args.pool_users, metrics=args.metrics,
                   screen=args.screen, fleet=args.fleet, fleet_pull=args.fleet_pull, fleet_class=args.fleet_class)
    except ConfigError as e:
        return fail(str(e))
    try:
        store = Store(cfg.db, busy_ms=100)
    except StoreError as e:
        return fail(f"cannot use the database: {e}")
    try:
        db_lock = lock_database(cfg.db)
    except ConfigError as e:
        store.close()
        return fail(str(e))
    nofile = raise_nofile()
    # `kill -USR1 PID` writes every thread's stack to the log: what a turn
    # that takes too long is doing, without stopping learnd.
    import faulthandler
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    # learnd's loop makes many short calls that let go of the GIL (SQLite,
    # /proc, its sockets); while another of its threads computes (a
    # screening reading its trace), each waits up to the switch interval
    # to take it back. `programs` over 600 stored programs took 4.3 s with
    # one busy thread beside it at Python's 5 ms, 0.7 s at 0.5 ms (0.06 s
    # alone).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    flag = []
    signal.signal(signal.SIGTERM, lambda *_: flag.append("TERM"))
    signal.signal(signal.SIGINT, lambda *_: flag.append("INT"))
    try:
        store.mark_unfinished_exited()
        d = Daemon(cfg, log, store, prices=Prices.calibrate())
        d.fd_budget(nofile)
        d.prepare_dirs()
        d.open_endpoints()
        from .kernel import KernelSource      # hakmem-bpf when it may, else /proc (issue 16)
        d.kernel = KernelSource(cfg.run_dir, log, d.zctx, d.clock).start()
        if cfg.fleet is not None:
            from .fleet import FleetError, FleetLink, redact
            try:
                d.fleet = FleetLink(cfg.fleet, store, log, pull_every=cfg.fleet_pull, klass=cfg.fleet_class,
                                    version=__version__)
            except (FleetError, StoreError) as e:
                d.close()
                return fail(f"fleet: {e}")
        if cfg.metrics is not None:
            from .metrics import Metrics, MetricsError
            try:
                d.metrics = Metrics(cfg.metrics).start(d)
            except MetricsError as e:
                d.close()          # the control sockets just made, the lease
                return fail(str(e))
    except (ConfigError, StoreError) as e:
        return fail(str(e))
    except Exception as e:
        from . import control
        if isinstance(e, control.ControlError):
            return fail(str(e))
        raise
    log("info", f"ready: watching {cfg.shm_dir}, database {cfg.db}, control {cfg.run_dir}/control.sock, "
                f"learner {cfg.learner}, objective {cfg.objective.describe()}"
                f"{'' if cfg.objective_explicit else ' (or the cgroup memory limit)'}, "
                f"fault {d.prices.fault_s * 1e6:.2f} us, syscall {d.prices.syscall_s * 1e6:.2f} us, "
                f"page given back {d.prices.zap_s * 1e9:.0f} ns, "
                f"{d.nofile} descriptors (up to {d.max_tracked} processes tracked)"
                f"{f', metrics {d.metrics.url}' if d.metrics is not None else ''}"
                + (f", fleet {redact(cfg.fleet)}" if d.fleet is not None else ""))
    try:
        if args.once:
            d.turn(wait=False)
            d.turn(wait=False)
        else:
            while not flag and not d.fatal:
                try:
                    d.turn()
                except Exception as e:
                    # Every program's work is guarded (Daemon.guard); this is
                    # the rest of a turn. The daemon goes on, a little later.
                    d.internal_errors += 1
                    log("error", f"internal error in learnd's turn ({type(e).__name__}: {e} at {where(e)}); going on")
                    time.sleep(0.1)
        log("info", f"stopping ({flag[0] if flag else ('lost the telemetry directory' if d.fatal else 'once')}): {len(d.procs)} processes, "
                    f"{len(d.writes.ops)} writes pending")
    finally:
        d.close()
        store.close()
        os.close(db_lock)   # after SQLite's own descriptors: see lock_database
    if d.fatal:
        return fail(d.fatal)
    if d.writes.ops:
        return fail(f"{len(d.writes.ops)} writes could not be stored: {d.writes.failing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
