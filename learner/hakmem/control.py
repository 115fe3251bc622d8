"""hakmem-learnd's ZeroMQ endpoints and what answers on them.

Two local sockets in the run directory (config.default_run_dir):

    control.sock  REQ/REP: one pb.Request, one pb.Reply (proto/hakmem.proto)
    events.sock   PUB: two frames per event, the kind (utf-8: the topic a
                  subscriber filters on, by prefix) and the serialized pb.Event

Contract:
1. The run directory is 0700 and owned by learnd's user; both socket files
   are 0600. Only that user (or root) can talk to learnd or listen to it,
   which is the whole access control: every request is trusted.
2. One learnd per run directory: bind() asks an existing control.sock for
   its status first and refuses when something answers.
3. Requests are answered by a Backend. StoreBackend answers from the SQLite
   store alone: the CLI uses it when learnd is not running, and the daemon
   subclasses it to add what only a running learnd knows (live processes,
   programs' learner state, pins applied at once): the methods marked
   "live" below are the ones to override.
4. serve() never blocks and never raises because of a client: a request
   that does not parse or fails gets Reply(ok=False, error=<one line>).
5. A client's REQ socket that timed out is closed, never reused (a REQ
   socket waiting for a lost reply cannot send again).
"""
from __future__ import annotations

import os
import socket as _socket
import stat
import time
from typing import Protocol

import zmq
from google.protobuf.message import DecodeError

from . import __version__
from . import layout as L
from ._pb import hakmem_pb2 as pb
from .config import ConfigError, parse_users, users_text
from .learning import KNOB_KEYS, canonical
from .ring import proc_start_time, shm_dir as _default_shm_dir
from .store import Store, StoreError

# Policy files: format 2 names the program's users (users, users_names);
# format 1, made before programs were learned per user (and still for a
# program without users), does not, and is imported only with --users.
EXPORT_FORMAT = 2
READ_FORMATS = (1, 2)
ORIGIN_TO_PB = {"default": pb.DEFAULT, "learned": pb.LEARNED, "replay": pb.REPLAY, "pinned": pb.PINNED}
ORIGIN_FROM_PB = {v: k for k, v in ORIGIN_TO_PB.items()}
PROBE_TIMEOUT_S = 0.3        # bind(): how long an existing learnd has to answer
RUNNING_TIMEOUT_S = 0.5      # is_running()


class ControlError(Exception):
    """A request that cannot be done, or an endpoint that cannot be used; one line."""


class NotRunning(ControlError):
    """learnd does not answer on its control endpoint."""


# ---- endpoints ---------------------------------------------------------------
def control_path(run_dir) -> str:
    return os.path.join(os.path.abspath(run_dir), "control.sock")


def events_path(run_dir) -> str:
    return os.path.join(os.path.abspath(run_dir), "events.sock")


def control_endpoint(run_dir) -> str:
    return f"ipc://{control_path(run_dir)}"


def events_endpoint(run_dir) -> str:
    return f"ipc://{events_path(run_dir)}"


def _prepare_run_dir(run_dir):
    parent = os.path.dirname(run_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(run_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ControlError(f"cannot create the run directory {run_dir}: {e.strerror}") from None
    st = os.lstat(run_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise ControlError(f"{run_dir} is not a directory (a symbolic link is not accepted); refusing to use it")
    if st.st_uid != os.geteuid():
        raise ControlError(f"{run_dir} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                           f"refusing to use it")
    if st.st_mode & 0o022:
        raise ControlError(f"{run_dir} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                           f"refusing to use it (chmod 700 it)")


def _probe(ctx, run_dir, timeout) -> pb.Status | None:
    """The status of whatever answers on run_dir's control.sock within timeout, or None."""
    if not os.path.exists(control_path(run_dir)):
        return None
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(control_endpoint(run_dir))
        s.send(pb.Request(status=pb.StatusRequest()).SerializeToString())
        if not s.poll(int(timeout * 1000)):
            return None
        data = s.recv()
    except zmq.ZMQError:
        return None
    finally:
        s.close()
    try:
        return pb.Reply.FromString(data).status
    except DecodeError:
        return pb.Status()     # something answers, even if not in our language


def bind(ctx: zmq.Context, run_dir) -> tuple[zmq.Socket, zmq.Socket]:
    """learnd's (REP, PUB) sockets, bound in run_dir (see the contract above)."""
    run_dir = os.path.abspath(run_dir)
    _prepare_run_dir(run_dir)
    other = _probe(ctx, run_dir, PROBE_TIMEOUT_S)
    if other is not None:
        raise ControlError(f"another hakmem-learnd is running on {run_dir} (pid {other.pid or '?'})")
    for path in (control_path(run_dir), events_path(run_dir)):
        try:
            os.unlink(path)      # stale: left by a learnd that was killed
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ControlError(f"cannot remove the stale {path}: {e.strerror}") from None
    rep = ctx.socket(zmq.REP)
    pub = ctx.socket(zmq.PUB)
    for s in (rep, pub):
        s.setsockopt(zmq.LINGER, 0)
    try:
        rep.bind(control_endpoint(run_dir))
        pub.bind(events_endpoint(run_dir))
        # The directory is 0700 already; the files say so too.
        os.chmod(control_path(run_dir), 0o600)
        os.chmod(events_path(run_dir), 0o600)
    except (zmq.ZMQError, OSError) as e:
        rep.close()
        pub.close()
        raise ControlError(f"cannot listen in {run_dir}: {e.strerror if isinstance(e, OSError) else e}") from None
    return rep, pub


# ---- conversions -------------------------------------------------------------
def knobs_to_pb(knobs: dict) -> pb.Knobs:
    k = canonical(knobs)
    return pb.Knobs(drain_ms=k["drain_ms"], tcache_cap=k["tcache_cap"], tcache_batch=k["tcache_batch"],
                    warm_slabs=k["warm_slabs"])


def knobs_from_pb(k: pb.Knobs) -> dict:
    out = {"drain_ms": int(k.drain_ms)}
    for name in L.KNOBS_PER_CLASS:
        v = [int(x) for x in getattr(k, name)]
        if len(v) != L.NUM_CLASSES:
            raise ControlError(f"knobs: {name} has {len(v)} classes, this hakmem has {L.NUM_CLASSES}")
        out[name] = v
    return out


def policy_to_pb(d: dict) -> pb.Policy:
    """A store policy row (Store.policies) as a message."""
    p = pb.Policy(id=d["id"], program=d["program"], version=d["version"], origin=ORIGIN_TO_PB[d["origin"]],
                  knobs=knobs_to_pb(d["knobs"]), evaluations=d.get("evaluations") or 0,
                  created=d["created"], pinned=bool(d.get("pinned")), best=bool(d.get("best")),
                  note=d.get("note") or "", users=d.get("users") or "")
    if d.get("objective") is not None:
        p.has_objective = True
        p.objective = d["objective"]
        p.objective_sd = d.get("objective_sd") or 0.0
    return p


def process_to_pb(d: dict) -> pb.Process:
    """A store process row (Store.processes) as a message; alive as far as the store knows."""
    return pb.Process(pid=d["pid"], start_time=d["start_time"], program=d["program"], uid=d["uid"],
                      first_seen=d["first_seen"], last_seen=d["last_seen"], alive=d.get("exited") is None,
                      windows=d.get("windows") or 0, users=d.get("users") or "")


def program_to_pb(d: dict, store: Store | None = None) -> pb.Program:
    """A store program row (Store.programs); with store, its best and pinned policies too."""
    p = pb.Program(id=d["id"], key=d["key"], exe=d["exe"], build_id=d["build_id"], first_seen=d["first_seen"],
                   last_seen=d["last_seen"], processes_seen=d.get("processes_seen") or 0,
                   class_size=d["class_sizes"], users=d["users"], users_names=d["users_names"])
    if store is not None:
        for field, col in (("best", "best_policy"), ("pinned", "pinned_policy")):
            if d.get(col):
                row = store.policy_by_id(d[col])
                if row:
                    getattr(p, field).CopyFrom(policy_to_pb(row))
    if d.get("mix"):
        share = sorted(((s, c) for c, s in enumerate(d["mix"]) if s >= 0.05), reverse=True)[:8]
        p.hot_classes.extend(c for _, c in share)
    return p


def _repeated(f) -> bool:
    # protobuf >= 5 has is_repeated (7 dropped label); 4.x only label.
    return f.is_repeated if hasattr(f, "is_repeated") else f.label == f.LABEL_REPEATED


def to_dict(msg) -> dict:
    """A message as plain JSON-able data: every field, 64-bit ints as ints
    (json_format would make them strings), enums as lower-case names."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        v = getattr(msg, f.name)
        repeated = _repeated(f)
        if f.type == f.TYPE_MESSAGE:
            if repeated:
                out[f.name] = [to_dict(x) for x in v]
            else:
                out[f.name] = to_dict(v) if msg.HasField(f.name) else None
        elif f.type == f.TYPE_ENUM:
            name = f.enum_type.values_by_number[v].name if v in f.enum_type.values_by_number else str(v)
            out[f.name] = name.lower()
        elif repeated:
            out[f.name] = list(v)
        else:
            out[f.name] = v
    return out


# ---- exported policy files -----------------------------------------------------
def check_export(f: pb.PolicyExport) -> None:
    """Raises ControlError(why) unless f is a complete policy file this hakmem can use."""
    if f.format not in READ_FORMATS:
        raise ControlError(f"format {f.format}, this hakmem reads formats {READ_FORMATS[0]} to {READ_FORMATS[-1]}")
    if not f.exe or not f.build_id:
        raise ControlError("no program identity (exe and build id)")
    if len(f.class_size) != L.NUM_CLASSES:
        raise ControlError(f"its class table has {len(f.class_size)} classes, this hakmem has {L.NUM_CLASSES}")
    if not f.HasField("policy") or not f.policy.HasField("knobs"):
        raise ControlError("no policy in it")
    if f.policy.origin not in ORIGIN_FROM_PB:
        raise ControlError(f"unknown policy origin {f.policy.origin}")
    knobs_from_pb(f.policy.knobs)
    # export() always writes these last fields (fields are written in the
    # order of their numbers): a file cut short lacks them.
    if f.exported_at <= 0 or not f.exported_from:
        raise ControlError("incomplete: no export time or host (truncated?)")
    if f.format >= 2 and not (f.users and f.users_names):
        raise ControlError("incomplete: no users (truncated?)")


def read_export(data: bytes, name: str) -> pb.PolicyExport:
    """A policy file's bytes, checked; ControlError("NAME: not a hakmem policy file (why)")."""
    try:
        f = pb.PolicyExport.FromString(data)
    except (DecodeError, ValueError) as e:
        raise ControlError(f"{name}: not a hakmem policy file (cannot be parsed: {e})") from None
    try:
        check_export(f)
    except ControlError as e:
        raise ControlError(f"{name}: not a hakmem policy file ({e})") from None
    return f


# ---- the backend -----------------------------------------------------------------
class Backend(Protocol):
    """What answers control requests. Programs are named as Store.find_program
    reads them (id, key, executable path, base name, each of the last two
    with #USERS). Errors: ControlError."""

    def status(self) -> pb.Status: ...
    def programs(self) -> list[pb.Program]: ...
    def processes(self, all: bool) -> list[pb.Process]: ...
    def policies(self, program: str) -> list[pb.Policy]: ...
    def policy(self, program: str, version: int) -> pb.Policy: ...
    def pin(self, program: str, version: int, knobs: dict | None, note: str) -> pb.Policy: ...
    def unpin(self, program: str) -> str: ...
    def export(self, program: str, version: int) -> pb.PolicyExport: ...
    def import_(self, file: pb.PolicyExport, pin: bool, users: str = "") -> pb.Policy: ...


class StoreBackend:
    """A Backend over the store alone. The daemon subclasses it; the methods
    under "live" are the ones a running learnd overrides."""

    def __init__(self, store: Store, run_dir: str = "", shm_dir: str | None = None):
        self.store = store
        self.run_dir = run_dir
        self.shm_dir = shm_dir or _default_shm_dir()

    # ---- live: what only a running learnd knows ---------------------------------
    def live_processes(self) -> list[pb.Process]:
        """The processes learnd tracks now, with their live figures."""
        return []

    def process_alive(self, row: dict) -> bool:
        """Whether a stored process (exited IS NULL) still runs: the same pid
        with the same start time."""
        return row.get("exited") is None and proc_start_time(row["pid"]) == row["start_time"]

    def decorate_program(self, msg: pb.Program, row: dict) -> None:
        """Fills what the store does not know: state, in_force, objective.
        live_processes is already set from processes()."""
        msg.state = "pinned" if row.get("pinned_policy") else ""
        evs = self.store.evaluations(row["id"], limit=1)
        if evs:
            msg.objective = evs[0]["objective"]

    def on_pin(self, program: dict, policy: dict) -> None:
        """Called after a pin is stored (program and policy: store rows).
        learnd applies it to the program's live processes at once."""

    def on_unpin(self, program: dict, was: dict | None) -> None:
        """Called after a pin is removed; learnd goes back to learning."""

    def status(self) -> pb.Status:
        procs = [p for p in self.processes(False) if p.alive]
        return pb.Status(version=__version__, pid=0, db_path=self.store.path, shm_dir=self.shm_dir,
                         run_dir=self.run_dir, programs=len({p.program for p in procs}),
                         processes=len(procs), windows_stored=self.store.windows_count(), running=False)

    # ---- the requests -------------------------------------------------------
    def _program(self, name) -> dict:
        return self.store.find_program(name)

    def programs(self) -> list[pb.Program]:
        live: dict[str, int] = {}
        for p in self.processes(False):
            if p.alive:
                live[p.program] = live.get(p.program, 0) + 1
        out = []
        for row in self.store.programs():
            msg = program_to_pb(row, self.store)
            msg.live_processes = live.get(row["key"], 0)
            self.decorate_program(msg, row)
            out.append(msg)
        return out

    def processes(self, all: bool = False) -> list[pb.Process]:
        live = {(p.pid, p.start_time): p for p in self.live_processes()}
        out = list(live.values())
        for p in out:
            if not p.users and "#" in p.program:
                p.users = p.program.rsplit("#", 1)[1]
        for row in self.store.processes(all=all):
            if (row["pid"], row["start_time"]) in live:
                continue
            msg = process_to_pb(row)
            msg.alive = self.process_alive(row)
            if msg.alive or all:
                out.append(msg)
        out.sort(key=lambda p: p.first_seen)
        return out

    def policies(self, program: str) -> list[pb.Policy]:
        pid = self._program(program)["id"] if program else None
        return [policy_to_pb(r) for r in self.store.policies(pid)]

    def _policy_row(self, prog: dict, version: int) -> dict:
        if version:
            return self.store.policy_by_version(prog["id"], version)
        row = self.store.chosen(prog["id"])
        if row is None:
            raise ControlError(f"{prog['key']} has no pinned or best policy yet; name a version "
                               f"(hakmem policy list {prog['id']})")
        return row

    def policy(self, program: str, version: int) -> pb.Policy:
        return policy_to_pb(self._policy_row(self._program(program), version))

    def pin(self, program: str, version: int, knobs: dict | None, note: str = "") -> pb.Policy:
        prog = self._program(program)
        if (version and knobs is not None) or (not version and knobs is None):
            raise ControlError("pin takes a stored version or knobs, one of the two")
        if knobs is not None:
            try:
                knobs = canonical(knobs)
            except (KeyError, ValueError, TypeError) as e:
                raise ControlError(f"knobs: {e}") from None
            bad = [k for k in KNOB_KEYS for x in (knobs[k] if isinstance(knobs[k], list) else [knobs[k]])
                   if not 0 <= x < 2**32]
            if bad:
                raise ControlError(f"knobs: {bad[0]} has a value outside 0..2^32-1")
            pol_id = self.store.policy(prog["id"], knobs, "pinned", note=note or None)
        else:
            pol_id = self.store.policy_by_version(prog["id"], version)["id"]
        self.store.pin(prog["id"], pol_id)
        row = self.store.policy_by_id(pol_id)
        self.on_pin(self.store.program_by_id(prog["id"]), row)
        return policy_to_pb(row)

    def unpin(self, program: str) -> str:
        prog = self._program(program)
        if not prog.get("pinned_policy"):
            return f"{prog['key']} has no pinned policy"
        was = self.store.policy_by_id(prog["pinned_policy"])
        self.store.unpin(prog["id"])
        self.on_unpin(self.store.program_by_id(prog["id"]), was)
        return f"unpinned v{was['version'] if was else '?'} of {prog['key']}"

    def export(self, program: str, version: int) -> pb.PolicyExport:
        prog = self._program(program)
        pol = policy_to_pb(self._policy_row(prog, version))
        pol.id = 0              # a row id means nothing on another machine
        return pb.PolicyExport(format=EXPORT_FORMAT if prog["users"] else 1, exe=prog["exe"],
                               build_id=prog["build_id"], class_size=prog["class_sizes"], policy=pol,
                               exported_at=time.time(), exported_from=_socket.gethostname() or "unknown",
                               users=prog["users"], users_names=prog["users_names"])

    def import_(self, file: pb.PolicyExport, pin: bool, users: str = "") -> pb.Policy:
        """Stores the file's policy for the program with its exe, build id and
        users: the given ones (uids or names here, separated by commas), else
        the file's uids. The program is made if new."""
        try:
            check_export(file)
        except ControlError as e:
            raise ControlError(f"not a hakmem policy file ({e})") from None
        knobs = knobs_from_pb(file.policy.knobs)
        if not users and not file.users:
            raise ControlError("the file does not say whose program it was (made by a hakmem that learned "
                               "per program, not per user); name the users here with --users")
        try:
            target = users_text(parse_users(users, "--users")) if users else \
                users_text(parse_users(file.users, "the file's users"))
        except ConfigError as e:
            raise ControlError(str(e)) from None
        if not target:
            raise ControlError("--users names no user")
        prog = next((p for p in self.store.programs()
                     if p["exe"] == file.exe and p["build_id"] == file.build_id and p["users"] == target), None)
        if prog is None:
            prog = self.store.program_by_id(self.store.program(file.exe, file.build_id, target,
                                                               list(file.class_size)))
        elif list(prog["class_sizes"]) != list(file.class_size):
            c = next(i for i, (a, b) in enumerate(zip(file.class_size, prog["class_sizes"])) if a != b)
            raise ControlError(f"the file's class table differs from {prog['key']}'s (class {c}: "
                               f"{file.class_size[c]} B in the file, {prog['class_sizes'][c]} B here); refusing "
                               f"to import knobs that would apply to other sizes")
        note = file.policy.note or f"imported from {file.exported_from}"
        pol_id = self.store.policy(prog["id"], knobs, ORIGIN_FROM_PB[file.policy.origin], note=note)
        if pin:
            self.store.pin(prog["id"], pol_id)
            self.on_pin(self.store.program_by_id(prog["id"]), self.store.policy_by_id(pol_id))
        return policy_to_pb(self.store.policy_by_id(pol_id))


# ---- serving ---------------------------------------------------------------------
def handle(backend: Backend, req: pb.Request) -> pb.Reply:
    """One request answered (errors raised, see serve)."""
    kind = req.WhichOneof("body")
    r = pb.Reply(ok=True)
    if kind == "status":
        r.status.CopyFrom(backend.status())
    elif kind == "programs":
        r.programs.extend(backend.programs())
    elif kind == "procs":
        r.processes.extend(backend.processes(req.procs.all))
    elif kind == "policy_list":
        r.policies.extend(backend.policies(req.policy_list.program))
    elif kind == "policy_show":
        r.policies.append(backend.policy(req.policy_show.program, req.policy_show.version))
    elif kind == "policy_pin":
        q = req.policy_pin
        knobs = knobs_from_pb(q.knobs) if q.HasField("knobs") else None
        r.policies.append(backend.pin(q.program, q.version, knobs, q.note))
    elif kind == "policy_unpin":
        r.message = backend.unpin(req.policy_unpin.program)
    elif kind == "policy_export":
        r.export.CopyFrom(backend.export(req.policy_export.program, req.policy_export.version))
    elif kind == "policy_import":
        q = req.policy_import
        r.policies.append(backend.import_(q.file, q.pin, q.users))
    else:
        raise ControlError("malformed request: no request in it (a newer hakmem's?)")
    return r


def _one_line(e) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def serve(rep: zmq.Socket, backend: Backend, max_requests: int = 16) -> int:
    """Answers every request waiting on rep (up to max_requests) without
    blocking; returns how many. Never raises because of a request."""
    n = 0
    while n < max_requests:
        try:
            frames = rep.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        n += 1
        try:
            if len(frames) != 1:
                raise ControlError(f"malformed request: {len(frames)} frames, expected 1")
            try:
                req = pb.Request.FromString(frames[0])
            except (DecodeError, ValueError) as e:
                raise ControlError(f"malformed request: {_one_line(e)}") from None
            reply = handle(backend, req)
        except (ControlError, StoreError) as e:
            reply = pb.Reply(ok=False, error=_one_line(e))
        except Exception as e:          # the daemon must never die from a client
            reply = pb.Reply(ok=False, error=f"internal error: {type(e).__name__}: {_one_line(e)}")
        try:
            rep.send(reply.SerializeToString(), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass                        # the client has gone; REP drops the reply itself
    return n


# ---- the client side --------------------------------------------------------------
class Client:
    """Requests to learnd's control endpoint. Not thread-safe."""

    def __init__(self, run_dir, timeout: float = 2.0, ctx: zmq.Context | None = None):
        self.run_dir = os.path.abspath(run_dir)
        self.timeout = timeout
        self.ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    def call(self, request: pb.Request) -> pb.Reply:
        path = control_path(self.run_dir)
        if not os.path.exists(path):
            raise NotRunning(f"hakmem-learnd is not running (no {path})")
        if self._sock is None:
            self._sock = self.ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(control_endpoint(self.run_dir))
        s = self._sock
        s.send(request.SerializeToString())
        if not s.poll(int(self.timeout * 1000)):
            self.close()
            raise NotRunning(f"hakmem-learnd did not answer within {self.timeout:g} s on {path}")
        data = s.recv()
        try:
            return pb.Reply.FromString(data)
        except DecodeError:
            raise ControlError(f"the reply on {path} does not parse (another program listens there?)") from None

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def is_running(run_dir) -> bool:
    """control.sock exists and answers a status request within 0.5 s."""
    return _probe(zmq.Context.instance(), os.path.abspath(run_dir), RUNNING_TIMEOUT_S) is not None


class ClientBackend:
    """The Backend interface over a Client: what the CLI uses while learnd runs."""

    def __init__(self, client: Client):
        self.client = client

    def _call(self, **body) -> pb.Reply:
        r = self.client.call(pb.Request(**body))
        if not r.ok:
            raise ControlError(r.error or "hakmem-learnd refused the request")
        return r

    def status(self) -> pb.Status:
        return self._call(status=pb.StatusRequest()).status

    def programs(self) -> list[pb.Program]:
        return list(self._call(programs=pb.ProgramsRequest()).programs)

    def processes(self, all: bool = False) -> list[pb.Process]:
        return list(self._call(procs=pb.ProcsRequest(all=all)).processes)

    def policies(self, program: str) -> list[pb.Policy]:
        return list(self._call(policy_list=pb.PolicyListRequest(program=program)).policies)

    def _one(self, r: pb.Reply) -> pb.Policy:
        if len(r.policies) != 1:
            raise ControlError(f"hakmem-learnd answered {len(r.policies)} policies, expected 1")
        return r.policies[0]

    def policy(self, program: str, version: int) -> pb.Policy:
        return self._one(self._call(policy_show=pb.PolicyShowRequest(program=program, version=version)))

    def pin(self, program: str, version: int, knobs: dict | None, note: str = "") -> pb.Policy:
        q = pb.PolicyPinRequest(program=program, version=version, note=note)
        if knobs is not None:
            try:
                q.knobs.CopyFrom(knobs_to_pb(knobs))
            except (KeyError, ValueError, TypeError) as e:
                raise ControlError(f"knobs: {e}") from None
        return self._one(self._call(policy_pin=q))

    def unpin(self, program: str) -> str:
        return self._call(policy_unpin=pb.PolicyUnpinRequest(program=program)).message

    def export(self, program: str, version: int) -> pb.PolicyExport:
        return self._call(policy_export=pb.PolicyExportRequest(program=program, version=version)).export

    def import_(self, file: pb.PolicyExport, pin: bool, users: str = "") -> pb.Policy:
        return self._one(self._call(policy_import=pb.PolicyImportRequest(file=file, pin=pin, users=users)))


# ---- events -------------------------------------------------------------------------
def publish(pub: zmq.Socket, event: pb.Event) -> None:
    """Two frames: the kind (the topic) and the event. Never blocks: with no
    subscriber, or one too slow, the event is dropped."""
    try:
        pub.send_multipart([event.kind.encode("utf-8"), event.SerializeToString()], zmq.NOBLOCK)
    except zmq.Again:
        pass


def subscribe(run_dir, kinds=(), ctx: zmq.Context | None = None) -> zmq.Socket:
    """A SUB socket on learnd's events; kinds filter by prefix (none: every event)."""
    s = (ctx or zmq.Context.instance()).socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    for k in kinds or ("",):
        s.setsockopt(zmq.SUBSCRIBE, k.encode("utf-8"))
    s.connect(events_endpoint(run_dir))
    return s


def recv_event(sub: zmq.Socket, timeout: float | None = None) -> pb.Event | None:
    """The next event, or None after timeout seconds (None: wait). A message
    that does not parse is skipped."""
    while True:
        if timeout is not None and not sub.poll(int(timeout * 1000)):
            return None
        frames = sub.recv_multipart()
        if len(frames) == 2:
            try:
                return pb.Event.FromString(frames[1])
            except DecodeError:
                pass
