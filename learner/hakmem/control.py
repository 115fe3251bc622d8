"""hakmem-learnd's ZeroMQ endpoints: the transport between the CLI and learnd,
and the conversions between store rows and messages. What a request does is
backend.py's.

Two local sockets in the run directory (config.default_run_dir):

    control.sock  REQ/ROUTER: one pb.Request, one pb.Reply (proto/hakmem.proto);
                  learnd's ROUTER may answer clients out of order (Server)
    events.sock   PUB: two frames per event, the kind (utf-8: the topic a
                  subscriber filters on, by prefix) and the serialized pb.Event

Contract:
1. The run directory is 0700 and owned by learnd's user; both socket files
   are 0600. Only that user (or root) can talk to learnd or listen to it,
   which is the whole access control: every request is trusted.
2. One learnd per run directory: lock_run_dir() takes learnd.lock in it, held
   for life, before bind() replaces whatever socket files are there.
3. Requests are answered by a Backend (backend.py); handle() maps a request
   to its method and the answer to a reply.
4. serve() never blocks and never raises because of a client: a request
   that does not parse or fails gets Reply(ok=False, error=<one line>).
5. A client's REQ socket that timed out is closed, never reused (a REQ
   socket waiting for a lost reply cannot send again).
"""
from __future__ import annotations

import collections
import fcntl
import os
import stat
import time
from typing import TYPE_CHECKING

import zmq
from google.protobuf.message import DecodeError

from . import layout as L
from ._pb import hakmem_pb2 as pb
from .knobs import PER_CLASS, Knobs, KnobsError
from .store import StoreError

if TYPE_CHECKING:
    from .backend import Backend

ORIGIN_TO_PB = {"default": pb.DEFAULT, "learned": pb.LEARNED, "replay": pb.REPLAY, "pinned": pb.PINNED}
ORIGIN_FROM_PB = {v: k for k, v in ORIGIN_TO_PB.items()}
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


def lock_run_dir(run_dir) -> int:
    """The run directory (made private if missing, refused if unsafe) locked
    for this process's life: learnd.lock, flock'ed, with our pid in it. Two
    learnds started at the same moment would both find no one answering on
    control.sock; the lock settles it. Returns the descriptor (closing it
    releases the lock)."""
    run_dir = os.path.abspath(run_dir)
    _prepare_run_dir(run_dir)
    path = os.path.join(run_dir, "learnd.lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise ControlError(f"cannot lock {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        except OSError:
            pid = "?"
        os.close(fd)
        raise ControlError(f"another hakmem-learnd is running on {run_dir} (pid {pid}, it holds learnd.lock)") \
            from None
    except OSError as e:
        os.close(fd)
        raise ControlError(f"cannot lock {path}: {e.strerror}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def bind(ctx: zmq.Context, run_dir) -> tuple[zmq.Socket, zmq.Socket]:
    """learnd's (ROUTER, PUB) sockets, bound in run_dir (see the contract above):
    socket files already there are a killed learnd's and are replaced, so
    the caller holds the run directory's lock (lock_run_dir)."""
    run_dir = os.path.abspath(run_dir)
    _prepare_run_dir(run_dir)
    for path in (control_path(run_dir), events_path(run_dir)):
        try:
            os.unlink(path)      # stale: left by a learnd that was killed
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ControlError(f"cannot remove the stale {path}: {e.strerror}") from None
    rep = ctx.socket(zmq.ROUTER)
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
def knobs_to_pb(knobs) -> pb.Knobs:
    """Knobs (or their dict form) as a message (knobs.Knobs.to_pb)."""
    return Knobs.of(knobs).to_pb()


def knobs_from_pb(k: pb.Knobs) -> dict:
    """A message's knobs in the dict form; a message made for another class
    table is a ControlError."""
    for name in PER_CLASS:
        n = len(getattr(k, name))
        if n != L.NUM_CLASSES:
            raise ControlError(f"knobs: {name} has {n} classes, this hakmem has {L.NUM_CLASSES}")
    return Knobs.from_pb(k).to_dict()


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


def program_to_pb(d: dict, policies: dict[int, dict] | None = None) -> pb.Program:
    """A store program row (Store.programs); its best and pinned policies
    too, from policies (Store.policies_by_id), when given."""
    p = pb.Program(id=d["id"], key=d["key"], exe=d["exe"], build_id=d["build_id"], first_seen=d["first_seen"],
                   last_seen=d["last_seen"], processes_seen=d.get("processes_seen") or 0,
                   class_size=d["class_sizes"], users=d["users"], users_names=d["users_names"])
    for field, col in (("best", "best_policy"), ("pinned", "pinned_policy")):
        row = policies.get(d[col]) if policies and d.get(col) else None
        if row:
            getattr(p, field).CopyFrom(policy_to_pb(row))
    if d.get("mix"):
        share = sorted(((s, c) for c, s in enumerate(d["mix"]) if s >= 0.05), reverse=True)[:8]
        p.hot_classes.extend(c for _, c in share)
    return p


def _repeated(f) -> bool:
    # protobuf >= 5 has is_repeated (7 dropped label); 4.x only label.
    return f.is_repeated if hasattr(f, "is_repeated") else f.label == f.LABEL_REPEATED


def _knobs_dict(m) -> dict:
    """Knobs as their dict form (the store's JSON, what --json has always
    printed): a later knob's presence flag (has_retain_mib) folded into its
    value, unset meaning the default."""
    try:
        return Knobs.from_pb(m).to_dict()
    except KnobsError:
        return {f.name: (list(getattr(m, f.name)) if _repeated(f) else getattr(m, f.name))
                for f in m.DESCRIPTOR.fields if not f.name.startswith("has_")}


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
            elif not msg.HasField(f.name):
                out[f.name] = None
            elif f.message_type.name == "Knobs":
                out[f.name] = _knobs_dict(v)
            else:
                out[f.name] = to_dict(v)
        elif f.type == f.TYPE_ENUM:
            name = f.enum_type.values_by_number[v].name if v in f.enum_type.values_by_number else str(v)
            out[f.name] = name.lower()
        elif repeated:
            out[f.name] = list(v)
        else:
            out[f.name] = v
    return out


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


# Requests that change what learnd does: never answered in the middle of a
# learner's computation (Server.serve(readonly=True)), only between its turns.
MUTATING = frozenset({"policy_pin", "policy_unpin", "policy_import"})


# Changes kept for the turn's end at most; past that a change is refused
# at once ("busy"), so a flood of them cannot grow learnd's memory.
KEPT_MAX = 64


class Server:
    """learnd's side of the control socket. serve() answers what is waiting;
    serve(readonly=True) is called from inside a long computation of a
    learner's (learners.base.pause: a GP's fit takes seconds on a loaded
    machine, and `hakmem status` gives up after 5): it answers what only
    reads, and a request that would change a program (a pin, whose learner
    may be the one computing) is kept, unanswered, until the next serve()
    between turns, which answers the kept ones first, in the order they
    came. The socket is a ROUTER, so a kept change holds up only the client
    that sent it: a status from another client is answered meanwhile (with
    REP, which takes no request before the last one's reply, one pin during
    a 10 s fit left every status behind it unanswered)."""

    def __init__(self, sock: zmq.Socket, backend: Backend):
        self.sock, self.backend = sock, backend
        self.kept: collections.deque[tuple[list[bytes], pb.Request]] = collections.deque()
        self.serving = False
        self.spent: dict[str, float] = {}   # seconds by "answering <kind>" (learnd's slow-turn log)

    def serve(self, max_requests: int = 16, readonly: bool = False) -> int:
        """Answers requests waiting on the socket (up to max_requests)
        without blocking; returns how many. Never raises because of a request."""
        if self.serving:                 # a computation inside an answer: no answers inside that
            return 0
        self.serving = True
        try:
            return self._serve(max_requests, readonly)
        finally:
            self.serving = False

    def _serve(self, max_requests, readonly):
        n = 0
        while self.kept and not readonly and n < max_requests:
            env, req = self.kept.popleft()
            n += 1
            self._answer(env, req)
        while n < max_requests:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            env, body = _envelope(frames)
            if env is None:
                continue                 # not from a REQ socket: there is no one to answer
            try:
                req = _parse(body)
            except ControlError as e:
                n += 1
                self._reply(env, pb.Reply(ok=False, error=_one_line(e)))
                continue
            if readonly and req.WhichOneof("body") in MUTATING:
                if len(self.kept) < KEPT_MAX:
                    self.kept.append((env, req))
                    continue
                n += 1
                self._reply(env, pb.Reply(ok=False, error="learnd is busy: too many changes wait for its "
                                                          "turn's end; try again"))
                continue
            n += 1
            self._answer(env, req)
        return n

    def _answer(self, env: list[bytes], req: pb.Request):
        t0 = time.monotonic()
        self._reply(env, answer(self.backend, req))
        what = f"answering {req.WhichOneof('body')}"
        self.spent[what] = self.spent.get(what, 0.0) + time.monotonic() - t0

    def _reply(self, env: list[bytes], reply: pb.Reply):
        try:
            self.sock.send_multipart([*env, reply.SerializeToString()], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass                        # the client has gone; ROUTER drops what it cannot route


def _envelope(frames: list[bytes]) -> tuple[list[bytes] | None, list[bytes]]:
    """A ROUTER's message from a REQ socket: the envelope (the peer's
    identity, then an empty frame) and the body after it. (None, []) when
    there is no empty frame: not a REQ peer, nothing to answer to."""
    for i, f in enumerate(frames[:8]):
        if f == b"":
            return frames[:i + 1], frames[i + 1:]
    return None, []


def _parse(frames) -> pb.Request:
    if len(frames) != 1:
        raise ControlError(f"malformed request: {len(frames)} frames, expected 1")
    try:
        return pb.Request.FromString(frames[0])
    except (DecodeError, ValueError) as e:
        raise ControlError(f"malformed request: {_one_line(e)}") from None


def answer(backend: Backend, req: pb.Request) -> pb.Reply:
    """The reply to one parsed request; never raises because of it."""
    try:
        return handle(backend, req)
    except (ControlError, StoreError) as e:
        return pb.Reply(ok=False, error=_one_line(e))
    except Exception as e:          # the daemon must never die from a client
        return pb.Reply(ok=False, error=f"internal error: {type(e).__name__}: {_one_line(e)}")


def serve(sock: zmq.Socket, backend: Backend, max_requests: int = 16) -> int:
    """Answers every request waiting on learnd's socket (up to max_requests)
    without blocking; returns how many. Never raises because of a request."""
    return Server(sock, backend).serve(max_requests)


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


def _holder_alive(run_dir) -> bool:
    """Whether the learnd whose pid learnd.lock holds (lock_run_dir) still
    runs: a hakmem process of that pid. Looked at without taking the lock
    (a learnd starting at that moment would find it taken)."""
    try:
        fd = os.open(os.path.join(run_dir, "learnd.lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        pid = int(os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "0")
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return pid > 0 and b"hakmem" in f.read()
    except OSError:
        return False


def is_running(run_dir) -> bool:
    """control.sock exists and answers a status request within 0.5 s, or
    its learnd is alive (a turn can take longer than that: the CLI must not
    then take learnd for stopped and read, or write, the database behind
    its back)."""
    run_dir = os.path.abspath(run_dir)
    return _probe(zmq.Context.instance(), run_dir, RUNNING_TIMEOUT_S) is not None or \
        (os.path.exists(control_path(run_dir)) and _holder_alive(run_dir))


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
