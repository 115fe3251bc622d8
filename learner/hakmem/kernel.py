"""hakmem-bpf as hakmem-learnd's child: the kernel's side of each program's cost.

learnd (daemon.py) holds one `KernelSource`. When it may (root, or CAP_BPF
with CAP_PERFMON; the kernel's BTF present; tracefs mounted, which it does
itself when it is root), it starts the loader (bpf/loader.c, `hakmem-bpf`)
with a PULL socket of its own in the run directory (kernel.sock, owner-only
like the directory) and tells it, on the child's stdin, which pids to count
("pids P1 P2 ..." whenever the set changes). The loader PUSHes a
KernelSample (proto/hakmem.proto) every interval: each pid's cumulative
counts, in the order of schemas/shm_layout.json's kernel_counters.

Each window then takes, per process, the counts' growth since its last window
as rates per second (`window`): learning.Window.kern, priced by
objective.window_time_cost in place of the /proc estimate. A process that
hakmem-bpf does not measure yet (just added, or the loader restarting) is
measured from /proc/<pid>/stat for that window and says so.

If the loader dies, learnd notices at its next turn and starts it again with
a backoff (0.5 s doubling to 30 s, reset once one has run a minute). If it
cannot run here at all (exit 3: not permitted, 4: no BTF, 5: no tracefs), or
is not installed, the fallback is /proc for good, with the one-line reason
that `hakmem status` shows. HAKMEM_BPF=off turns it off; HAKMEM_BPF=PATH
names the loader (default: `hakmem-bpf` on PATH, else build/hakmem-bpf of
this checkout)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

from . import layout as L

BTF = "/sys/kernel/btf/vmlinux"
TRACEFS = "/sys/kernel/tracing"
CAP_PERFMON, CAP_BPF = 38, 39
EXIT_WHY = {3: "not permitted", 4: "no kernel BTF", 5: "tracefs not mounted"}
BACKOFF_MIN, BACKOFF_MAX, STABLE_S = 0.5, 30.0, 60.0
INTERVAL_MS = 250
DRAIN_MAX = 64                 # KernelSamples read a turn at most (also the socket's RCVHWM)


def find_loader() -> str | None:
    env = os.environ.get("HAKMEM_BPF", "")
    if env:
        return None if env == "off" else env
    exe = shutil.which("hakmem-bpf")
    if exe:
        return exe
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "build", "hakmem-bpf")
    return here if os.access(here, os.X_OK) else None


def _caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def may_load() -> str | None:
    """None when this process may load BPF programs, else why not (one line)."""
    if os.geteuid() == 0:
        return None
    caps = _caps()
    if caps & (1 << CAP_BPF) and caps & (1 << CAP_PERFMON):
        return None
    return "not permitted: learnd is neither root nor has CAP_BPF and CAP_PERFMON"


def tracefs_ready() -> bool:
    return (os.path.isdir(os.path.join(TRACEFS, "events", "syscalls"))
            or os.path.isdir("/sys/kernel/debug/tracing/events/syscalls"))


def mount_tracefs() -> str | None:
    """Mounts tracefs where the loader looks for it; None on success, else why not."""
    if tracefs_ready():
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"nodev", TRACEFS.encode(), b"tracefs", ctypes.c_ulong(0), None) != 0:
        e = ctypes.get_errno()
        return f"tracefs is not mounted at {TRACEFS} and mounting it failed: {os.strerror(e)}"
    return None if tracefs_ready() else f"tracefs mounted at {TRACEFS} has no syscall events"


class KernelSource:
    def __init__(self, run_dir, log, zctx, clock, loader: str | None = None, interval_ms: int = INTERVAL_MS):
        self.run_dir = os.path.abspath(run_dir)
        self.log = log
        self.zctx = zctx
        self.clock = clock
        self.loader = loader if loader is not None else find_loader()
        self.interval_ms = interval_ms
        self.child: subprocess.Popen | None = None
        self.sock = None
        self.why = "not started"
        self.permanent = False           # the fallback for good: no restart
        self.restarts = 0
        self.backoff = BACKOFF_MIN
        self.restart_at: float | None = None
        self.started_at = 0.0
        self.loader_pid = 0              # the loader whose counts `counts` holds
        self.counts: dict[int, tuple[float, tuple]] = {}   # pid -> (mono, values) of the running loader
        self.sent: tuple | None = None   # the pid set last sent
        self.pending = b""               # the part of the last "pids" line the pipe has not taken yet
        self.prev: dict[tuple, tuple] = {}  # (pid, start_time) -> (loader_pid, mono, values) at its last window
        self.note = ""

    @property
    def path(self) -> str:
        return os.path.join(self.run_dir, "kernel.sock")

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.poll() is None

    @property
    def source(self) -> str:
        return "bpf" if self.running else "proc"

    # ---- start, restart, stop ---------------------------------------------------
    def start(self) -> "KernelSource":
        why = None
        if self.loader is None:
            why = ("is off (HAKMEM_BPF=off)" if os.environ.get("HAKMEM_BPF") == "off"
                   else "is not installed (not on PATH, no build/hakmem-bpf; HAKMEM_BPF=PATH names it)")
        elif not os.access(self.loader, os.X_OK):
            why = f"at {self.loader} is not an executable"
        elif not os.path.exists(BTF):
            why = f"cannot run: no kernel BTF ({BTF})"
        else:
            why = may_load()
            if why is None:
                why = mount_tracefs() if os.geteuid() == 0 else (
                    None if tracefs_ready() else f"tracefs is not mounted at {TRACEFS} (learnd may not mount it)")
                why = None if why is None else f"cannot run: {why}"
        if why is not None:
            self._fallback(why)
            return self
        import zmq
        try:
            self.sock = self.zctx.socket(zmq.PULL)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.RCVHWM, DRAIN_MAX)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            old = os.umask(0o077)
            try:
                self.sock.bind(f"ipc://{self.path}")
            finally:
                os.umask(old)
            os.chmod(self.path, 0o600)
        except (zmq.ZMQError, OSError) as e:     # learnd runs on without it
            if self.sock is not None:
                self.sock.close(0)
                self.sock = None
            self._fallback(f"has no socket ({self.path}: {e})")
            return self
        self._spawn()
        return self

    def _fallback(self, why):
        """/proc for good; why completes "hakmem-bpf ..." in one line."""
        self.why = f"/proc/<pid>/stat: hakmem-bpf {why}"
        self.permanent = True
        self.log("info", f"kernel-side cost from {self.why}")

    def _spawn(self):
        now = self.clock.monotonic()
        try:
            self.child = subprocess.Popen(
                [self.loader, "--connect", f"ipc://{self.path}", "--interval-ms", str(self.interval_ms)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True)
        except OSError as e:
            self.child = None
            self._fallback(f"could not be started ({self.loader}: {e.strerror})")
            return
        os.set_blocking(self.child.stdin.fileno(), False)
        self.started_at = now
        self.sent = None
        self.pending = b""
        self.why = f"hakmem-bpf (pid {self.child.pid})"
        self.restart_at = None
        self.log("info", f"kernel-side cost from hakmem-bpf, pid {self.child.pid}")

    def stop(self):
        if self.child is not None:
            try:
                self.child.terminate()
                self.child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
            except OSError:
                pass
            for f in (self.child.stdin, self.child.stderr):
                try:
                    f.close()
                except OSError:
                    pass
            self.child = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
            try:
                os.unlink(self.path)
            except OSError:
                pass

    # ---- each turn ----------------------------------------------------------------
    def poll(self, pids):
        """Reads what the loader sent, restarts it when it died and its backoff
        is over, and gives it the pid set when that changed."""
        if self.permanent or self.sock is None:
            return
        now = self.clock.monotonic()
        if self.child is not None and self.child.poll() is not None:
            self._died(now)
        if self.child is None:
            if self.restart_at is not None and now >= self.restart_at and not self.permanent:
                self.restarts += 1
                self._spawn()
            if self.child is None:
                return
        self._drain()
        want = tuple(sorted(set(int(p) for p in pids)))
        if want != self.sent and not self.pending:
            self.pending = ("pids " + " ".join(map(str, want)) + "\n").encode()
            self.sent = want
        if self.pending:
            # Never block learnd on its child: what the pipe does not take now
            # is written on a later turn, so the loader sees whole lines only.
            try:
                n = os.write(self.child.stdin.fileno(), self.pending)
                self.pending = self.pending[n:]
            except BlockingIOError:
                pass
            except OSError:
                pass          # a dying loader: the next turn sees it gone

    def _died(self, now):
        rc = self.child.returncode
        try:
            err = self.child.stderr.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            err = []
        line = err[-1] if err else f"exit status {rc}"
        for f in (self.child.stdin, self.child.stderr):
            try:
                f.close()
            except OSError:
                pass
        self.child = None
        self.counts.clear()
        if rc in EXIT_WHY:      # it cannot run here: its own line says why
            msg = line.removeprefix("hakmem-bpf: error: ")
            self._fallback(msg if msg.startswith("not permitted") else f"cannot run: {msg}")
            return
        if now - self.started_at >= STABLE_S:
            self.backoff = BACKOFF_MIN
        self.restart_at = now + self.backoff
        self.why = f"/proc/<pid>/stat while hakmem-bpf restarts (it died: {line})"
        self.log("warning", f"hakmem-bpf died ({line}); restarting in {self.backoff:g} s")
        self.backoff = min(self.backoff * 2, BACKOFF_MAX)

    def _drain(self):
        import zmq
        from ._pb import hakmem_pb2 as pb
        n = len(L.KERNEL_COUNTERS)
        # At most a socket's worth a turn (RCVHWM): the counters are
        # cumulative, so what waits for the next turn loses nothing, and a
        # backlog (the loader's own queue behind ours) never holds up a turn.
        for _ in range(DRAIN_MAX):
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = pb.KernelSample()
            try:
                msg.ParseFromString(data)
            except Exception:
                continue            # only our child can connect (owner-only socket); still, never trust
            if msg.counters != n or msg.loader_pid != (self.child.pid if self.child else 0):
                continue
            self.loader_pid = msg.loader_pid
            self.note = msg.note
            for p in msg.procs:
                if len(p.values) == n:
                    self.counts[p.pid] = (msg.mono, tuple(p.values))

    # ---- per window -----------------------------------------------------------------
    def window(self, pid: int, start_time: int, dt: float):
        """(kern rates by name, source, why) for one process's window of dt
        seconds: rates when hakmem-bpf measured it since its last window,
        else None with the reason it is measured from /proc."""
        key = (pid, start_time)
        if not self.running:
            self.prev.pop(key, None)
            return None, "proc", self.why
        cur = self.counts.get(pid)
        if cur is None:
            return None, "proc", "/proc/<pid>/stat until hakmem-bpf's first sample of it"
        prev = self.prev.get(key)
        self.prev[key] = (self.loader_pid, cur[0], cur[1])
        if prev is None or prev[0] != self.loader_pid:
            return None, "proc", "/proc/<pid>/stat for its first window under this hakmem-bpf"
        # Over the loader's own interval between the two readings (they lag
        # the window's ends by at most one interval, by the same amount).
        span = cur[0] - prev[1] if cur[0] > prev[1] else dt
        d = [max(b - a, 0) / span for a, b in zip(prev[2], cur[1])]
        return dict(zip(L.KERNEL_COUNTERS, d)), "bpf", self.why

    def forget(self, pid: int, start_time: int):
        self.prev.pop((pid, start_time), None)
        self.counts.pop(pid, None)

    def describe(self, st):
        """Fills a Status message's kernel fields (`hakmem status`)."""
        if self.running:
            st.kernel_source = "bpf"
            st.kernel_why = f"hakmem-bpf running, pid {self.child.pid}" + (f" ({self.note})" if self.note else "")
            st.kernel_loader_pid = self.child.pid
        else:
            st.kernel_source = "proc"
            st.kernel_why = self.why
        st.kernel_restarts = self.restarts
        st.kernel_counters.extend(L.KERNEL_COUNTERS)
