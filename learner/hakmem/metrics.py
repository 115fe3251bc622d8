"""hakmem-learnd's Prometheus endpoint (`--metrics ADDR`, `metrics = "ADDR"`).

What learnd measures, in the Prometheus text format, served by
prometheus-client's own HTTP server from a private registry (nothing of the
process-wide default registry, so no other library's metrics leak in):

  per process   (labels program, key, pid)
    hakmem_process_counter_rate{counter=...}   every counter of the layout
        (schemas/shm_layout.json), per second over the last window; class
        counters summed over the size classes; gauges (threads, committed
        bytes) as their value at the window's end
    hakmem_process_resident_bytes, hakmem_process_cost (objective units per
        second: allocator core-seconds per second plus the memory price),
        hakmem_process_cpu_cores, hakmem_process_minor_faults_rate,
        hakmem_process_policy_written_version / _applied_version (the
        snapshot learnd wrote to it, the one its allocator applied)
  per program   (labels program, key)
    hakmem_program_processes, hakmem_program_cost, hakmem_program_resident_bytes,
    hakmem_program_policy_changes_total, hakmem_program_trials_total{verdict=
        accepted|rolled_back|settled|relearn}
  learnd        hakmem_learnd_info{version}, hakmem_learnd_programs,
    hakmem_learnd_processes, hakmem_learnd_windows_total,
    hakmem_learnd_pending_writes, hakmem_learnd_dropped_writes_total

    hakmem_learnd_internal_errors_total (failures contained by learnd's
    guards: each is a bug), hakmem_learnd_metrics_clients_dropped_total{why=
    evicted|timeout|bad_request} (this endpoint's own bounds at work)
  fleet         (with --fleet, fleet.py) hakmem_fleet_up, hakmem_fleet_backlog,
    hakmem_fleet_pushed_evaluations_total, hakmem_fleet_push_batches_total,
    hakmem_fleet_pulls_total, hakmem_fleet_errors_total,
    hakmem_fleet_dropped_total, hakmem_fleet_offers,
    hakmem_fleet_adopted_total (programs started from the fleet's policy)

THREADS. One thread of its own serves HTTP (_Server: non-blocking sockets
and one epoll loop); the daemon's state is only ever read by the daemon's
loop. Each sample the loop builds a complete list of metric families
(`publish`) and swaps it in under a lock; a scrape serves the last list
whole. A scrape never sees half a turn and never slows the loop.

TRUST. The endpoint binds 127.0.0.1 by default: the metrics name every
program and pid that uses hakmem, which other users of a shared machine
need not see. An address given explicitly is bound as given. Any local user
can connect, so the endpoint is bounded whatever they do: at most
MAX_CLIENTS connections at once (a new one evicts the oldest, so a flood
costs answers, never learnd's descriptors), REQUEST_S to send a request of
at most MAX_REQUEST bytes, RESPONSE_S to take the answer, and no thread per
client (prometheus-client's own server kept a thread and a descriptor for
every idle connection, without limit: 1,000 of them took learnd's last
descriptor and libzmq then aborted it).
"""
from __future__ import annotations

import collections
import ipaddress
import os
import selectors
import socket
import threading
import time

from . import __version__
from . import layout as L

DEFAULT_PORT = 9711
DEFAULT_HOST = "127.0.0.1"
MAX_CLIENTS = 64             # connections at once; a new one evicts the oldest
REQUEST_S = 5.0              # to send the request line and headers ...
MAX_REQUEST = 8192           # ... of at most this many bytes
RESPONSE_S = 10.0            # to take the whole answer
ACCEPT_PAUSE_S = 0.1         # accepting stops this long when the process is out of descriptors
TRIAL_KINDS = {"policy_accepted": "accepted", "policy_rolled_back": "rolled_back",
               "policy_settled": "settled", "relearn": "relearn"}


class MetricsError(Exception):
    """An address that cannot be parsed or bound, in one line."""


def parse_addr(text: str) -> tuple[str, int]:
    """(host, port) from "PORT", "HOST:PORT", ":PORT" (localhost) or
    "[V6]:PORT"; port 0 binds a free port (tests)."""
    text = (text or "").strip()
    if not text:
        return DEFAULT_HOST, DEFAULT_PORT
    host, port = DEFAULT_HOST, text
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or not text[end + 1:].startswith(":"):
            raise MetricsError(f"metrics address {text!r}: expected [IPv6]:PORT")
        host, port = text[1:end], text[end + 2:]
    elif ":" in text:
        host, port = text.rsplit(":", 1)
        host = host or DEFAULT_HOST
    try:
        p = int(port)
    except ValueError:
        raise MetricsError(f"metrics address {text!r}: {port!r} is not a port number") from None
    if not 0 <= p <= 65535:
        raise MetricsError(f"metrics address {text!r}: port {p} is out of range")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise MetricsError(f"metrics address {text!r}: {host!r} is not an IP address") from None
    return host, p


class _Client:
    __slots__ = ("sock", "deadline", "inbuf", "out")

    def __init__(self, sock, deadline):
        self.sock, self.deadline, self.inbuf, self.out = sock, deadline, b"", None


class _Server:
    """A small HTTP/1.x server for GET /metrics, bounded in every way a
    local user could push it (see TRUST above). One thread, one epoll."""

    def __init__(self, host: str, port: int, render, clock=time):
        self.render, self.clock = render, clock
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as e:
            raise OSError(e.errno, e.strerror) from None
        family, _, _, _, addr = infos[0]
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(addr)
            self.sock.listen(128)
            self.sock.setblocking(False)
        except BaseException:
            self.sock.close()
            raise
        self.server_address = self.sock.getsockname()
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.sel.register(self.sock, selectors.EVENT_READ, "listen")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.clients: collections.OrderedDict = collections.OrderedDict()   # sock -> _Client, oldest first
        self.dropped = {"evicted": 0, "timeout": 0, "bad_request": 0}
        self.served = 0
        self.accept_paused_until = 0.0
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="hakmem-metrics", daemon=True)
        self.thread.start()

    def shutdown(self):
        self.stopping = True
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(timeout=5)

    def server_close(self):
        for c in list(self.clients):
            self._close(c)
        for s in (self.sock, self.wake_r, self.wake_w):
            s.close()
        self.sel.close()

    # ---- the loop ---------------------------------------------------------------
    def _run(self):
        while not self.stopping:
            now = self.clock.monotonic()
            if self.accept_paused_until and now >= self.accept_paused_until:
                self.accept_paused_until = 0.0
                self.sel.register(self.sock, selectors.EVENT_READ, "listen")
            soonest = min((c.deadline for c in self.clients.values()), default=now + 1.0)
            if self.accept_paused_until:
                soonest = min(soonest, self.accept_paused_until)
            try:
                events = self.sel.select(max(0.0, min(soonest - now, 1.0)))
            except OSError:
                events = []
            for key, mask in events:
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    try:
                        self.wake_r.recv(64)
                    except OSError:
                        pass
                elif mask & selectors.EVENT_READ:
                    self._read(key.fileobj)
                elif mask & selectors.EVENT_WRITE:
                    self._write(key.fileobj)
            now = self.clock.monotonic()
            for sock in [s for s, c in self.clients.items() if c.deadline <= now]:
                self.dropped["timeout"] += 1
                self._close(sock)

    def _accept(self):
        for _ in range(MAX_CLIENTS):        # a bounded batch per wake-up
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # Out of descriptors (EMFILE, ENFILE) or memory: the kernel
                # keeps the rest queued; look again a little later instead
                # of being woken for them again at once.
                self.sel.unregister(self.sock)
                self.accept_paused_until = self.clock.monotonic() + ACCEPT_PAUSE_S
                return
            if len(self.clients) >= MAX_CLIENTS:
                oldest = next(iter(self.clients))
                self.dropped["evicted"] += 1
                self._close(oldest)
            sock.setblocking(False)
            self.clients[sock] = _Client(sock, self.clock.monotonic() + REQUEST_S)
            self.sel.register(sock, selectors.EVENT_READ, "client")

    def _close(self, sock):
        self.clients.pop(sock, None)
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        sock.close()

    def _read(self, sock):
        c = self.clients.get(sock)
        if c is None:
            return
        try:
            data = sock.recv(MAX_REQUEST)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(sock)
            return
        if not data:
            self._close(sock)
            return
        c.inbuf += data
        end = c.inbuf.find(b"\r\n\r\n")
        if end < 0:
            end = c.inbuf.find(b"\n\n")
        if end < 0:
            if len(c.inbuf) >= MAX_REQUEST:
                self.dropped["bad_request"] += 1
                self._answer(c, 431, "text/plain; charset=utf-8", b"request header fields too large\n")
            return
        self._answer(c, *self._respond(c.inbuf[:end]))

    def _respond(self, head: bytes):
        line = head.split(b"\n", 1)[0].strip().split()
        if len(line) != 3 or not line[2].startswith(b"HTTP/"):
            self.dropped["bad_request"] += 1
            return 400, "text/plain; charset=utf-8", b"bad request\n", False
        method, target = line[0], line[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return 405, "text/plain; charset=utf-8", b"only GET and HEAD\n", method == b"HEAD"
        head_only = method == b"HEAD"
        if target == b"/metrics":
            from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
            self.served += 1
            return 200, CONTENT_TYPE_PLAIN_0_0_4, self.render(), head_only
        if target == b"/":
            return 200, "text/html; charset=utf-8", (b"<html><body><a href=\"/metrics\">hakmem-learnd metrics"
                                                     b"</a></body></html>\n"), head_only
        return 404, "text/plain; charset=utf-8", b"not found: see /metrics\n", head_only

    def _answer(self, c: _Client, status, ctype, body, head_only=False):
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                  431: "Request Header Fields Too Large"}[status]
        hdr = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
               f"Connection: close\r\n\r\n").encode()
        c.out = memoryview(hdr + (b"" if head_only else body))
        c.deadline = self.clock.monotonic() + RESPONSE_S
        try:
            self.sel.modify(c.sock, selectors.EVENT_WRITE, "client")
        except (KeyError, ValueError, OSError):
            self._close(c.sock)

    def _write(self, sock):
        c = self.clients.get(sock)
        if c is None or c.out is None:
            return
        try:
            n = sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(sock)
            return
        c.out = c.out[n:]
        if not c.out:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._close(sock)


class _Collector:
    def __init__(self):
        self.lock = threading.Lock()
        self.families: list = []

    def collect(self):
        with self.lock:
            fams = self.families
        yield from fams


class Metrics:
    """The endpoint. start() binds it; observe() per program window and
    event() per learnd event feed it (the loop's thread); publish() makes
    what the next scrape sees; close() stops the server."""

    def __init__(self, addr: str):
        from prometheus_client import CollectorRegistry
        self.host, self.port = parse_addr(addr)
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = _Collector()
        self.registry.register(self.collector)
        self.server = self.thread = None
        self.windows = 0
        self.last: dict = {}          # proc path -> (program, Proc, Window)
        self.programs: dict = {}      # key -> (program, merged Window)
        self.trials: dict = {}        # (key, verdict) -> count
        self.changes: dict = {}       # key -> count
        self.names: dict = {}         # key -> base name

    def start(self, daemon=None):
        from prometheus_client.exposition import generate_latest
        try:
            self.server = _Server(self.host, self.port, lambda: generate_latest(self.registry))
        except OSError as e:
            raise MetricsError(f"cannot serve metrics on {self.host}:{self.port}: {e.strerror or e}") from None
        self.port = self.server.server_address[1]
        self.publish(daemon)
        return self

    @property
    def url(self):
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # ---- fed by the daemon's loop ---------------------------------------------
    def observe(self, prog, parts, win):
        """One program's sample: its processes' windows and their merge."""
        self.windows += 1
        self.names[prog.key] = os.path.basename(prog.exe)
        self.programs[prog.key] = (prog, win)
        for p, w in parts:
            self.last[p.path] = (prog, p, w)

    def event(self, kind, prog):
        if prog is None:
            return
        self.names[prog.key] = os.path.basename(prog.exe)
        if kind in TRIAL_KINDS:
            k = (prog.key, TRIAL_KINDS[kind])
            self.trials[k] = self.trials.get(k, 0) + 1
        if kind in ("policy_applied", "policy_accepted", "policy_rolled_back", "policy_pinned", "policy_unpinned"):
            self.changes[prog.key] = self.changes.get(prog.key, 0) + 1

    def publish(self, daemon):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        live = set(daemon.procs) if daemon is not None else set()
        self.last = {k: v for k, v in self.last.items() if k in live}
        fams = []
        info = GaugeMetricFamily("hakmem_learnd_info", "hakmem-learnd's version", labels=["version"])
        info.add_metric([__version__], 1)
        fams.append(info)
        if daemon is not None:
            fams.append(GaugeMetricFamily("hakmem_learnd_programs", "programs with live processes",
                                          value=sum(1 for g in daemon.programs.values() if g.procs)))
            fams.append(GaugeMetricFamily("hakmem_learnd_processes", "processes learnd tracks",
                                          value=len(daemon.procs)))
            fams.append(GaugeMetricFamily("hakmem_learnd_pending_writes",
                                          "rows waiting in memory for the database", value=len(daemon.writes.ops)))
            fams.append(CounterMetricFamily("hakmem_learnd_dropped_writes", "rows dropped at the memory bound",
                                            value=daemon.writes.dropped))
            fams.append(CounterMetricFamily("hakmem_learnd_internal_errors", "failures learnd's guards contained "
                                            "(each one a bug: see the log)", value=daemon.internal_errors))
            if daemon.fleet is not None:
                fl = daemon.fleet
                fams.append(GaugeMetricFamily("hakmem_fleet_up", "1 when the last exchange with the fleet "
                                              "database succeeded", value=1 if fl.up else 0))
                fams.append(GaugeMetricFamily("hakmem_fleet_backlog", "rows waiting in the outbox to be pushed",
                                              value=fl.backlog))
                fams.append(CounterMetricFamily("hakmem_fleet_pushed_evaluations", "evaluations the fleet "
                                                "database took (new ones: a batch sent again counts once)",
                                                value=fl.pushed))
                fams.append(CounterMetricFamily("hakmem_fleet_push_batches", "batches pushed", value=fl.push_batches))
                fams.append(CounterMetricFamily("hakmem_fleet_pulls", "pulls of the fleet's offers", value=fl.pulls))
                fams.append(CounterMetricFamily("hakmem_fleet_errors", "exchanges with the fleet that failed",
                                                value=fl.errors))
                fams.append(CounterMetricFamily("hakmem_fleet_dropped", "plain measurements dropped from a full "
                                                "outbox", value=fl.dropped))
                fams.append(GaugeMetricFamily("hakmem_fleet_offers", "programs the fleet offers this host a policy "
                                              "for", value=len(fl.offers)))
                fams.append(CounterMetricFamily("hakmem_fleet_adopted", "programs started from the fleet's policy",
                                                value=fl.adopted))
        if self.server is not None:
            drop = CounterMetricFamily("hakmem_learnd_metrics_clients_dropped",
                                       "connections to this endpoint closed unanswered by its bounds",
                                       labels=["why"])
            for why, n in sorted(self.server.dropped.items()):
                drop.add_metric([why], n)
            fams.append(drop)
        fams.append(CounterMetricFamily("hakmem_learnd_windows", "program windows sampled", value=self.windows))

        pl = ["program", "key", "pid"]
        rate = GaugeMetricFamily("hakmem_process_counter_rate",
                                 "a telemetry counter per second over the last window (class counters summed "
                                 "over size classes; gauges: the value at the window's end)",
                                 labels=pl + ["counter"])
        rss = GaugeMetricFamily("hakmem_process_resident_bytes", "mean resident memory over the last window",
                                labels=pl)
        cost = GaugeMetricFamily("hakmem_process_cost", "the objective's cost of the last window "
                                 "(allocator core-seconds per second plus the memory price)", labels=pl)
        cpu = GaugeMetricFamily("hakmem_process_cpu_cores", "CPU used over the last window, in cores", labels=pl)
        flt = GaugeMetricFamily("hakmem_process_minor_faults_rate", "minor page faults per second", labels=pl)
        wv = GaugeMetricFamily("hakmem_process_policy_written_version",
                               "the policy snapshot version learnd last wrote to the process", labels=pl)
        av = GaugeMetricFamily("hakmem_process_policy_applied_version",
                               "the policy snapshot version the process's allocator applied", labels=pl)
        for path, (prog, p, w) in sorted(self.last.items()):
            lab = [self.names.get(prog.key, prog.key), prog.key, str(p.pid)]
            for name in L.CLASS_COUNTERS:
                rate.add_metric(lab + [name], float(w.cls[name].sum()))
            for name in L.PROC_COUNTERS:
                rate.add_metric(lab + [name], float(w.proc[name]))
            rss.add_metric(lab, w.rss_bytes)
            cost.add_metric(lab, w.cost)
            cpu.add_metric(lab, w.cpu)
            flt.add_metric(lab, w.minflt)
            wv.add_metric(lab, p.written_version)
            try:
                applied = p.ring.status()["applied_version"]
            except Exception:      # the process is leaving: its file may be gone
                applied = 0
            av.add_metric(lab, applied)
        fams += [rate, rss, cost, cpu, flt, wv, av]

        gl = ["program", "key"]
        nproc = GaugeMetricFamily("hakmem_program_processes", "live processes of the program", labels=gl)
        gcost = GaugeMetricFamily("hakmem_program_cost", "the program's cost over its last window (summed "
                                  "over its processes)", labels=gl)
        grss = GaugeMetricFamily("hakmem_program_resident_bytes", "the program's resident memory (summed)",
                                 labels=gl)
        chg = CounterMetricFamily("hakmem_program_policy_changes", "policies learnd put in force", labels=gl)
        trials = CounterMetricFamily("hakmem_program_trials", "trials decided, by verdict",
                                     labels=gl + ["verdict"])
        progs = daemon.programs if daemon is not None else {}
        for key in sorted(set(self.programs) | set(self.changes) | {k for k, _ in self.trials}):
            lab = [self.names.get(key, key), key]
            g = progs.get(key)
            if key in self.programs:
                _, win = self.programs[key]
                nproc.add_metric(lab, len(g.procs) if g is not None else 0)
                gcost.add_metric(lab, win.cost)
                grss.add_metric(lab, win.rss_bytes)
            chg.add_metric(lab, self.changes.get(key, 0))
            for verdict in ("accepted", "rolled_back", "settled", "relearn"):
                trials.add_metric(lab + [verdict], self.trials.get((key, verdict), 0))
        fams += [nproc, gcost, grss, chg, trials]
        with self.collector.lock:
            self.collector.families = fams
