"""What a control request does to hakmem-learnd's state and store, without
sockets: status, programs, processes, policies, and the rules of pin, unpin,
export and import. control.py carries requests to a Backend and back.

A Backend answers control requests (the Protocol below). StoreBackend answers
from the SQLite store alone: the CLI uses it when learnd is not running, and
the daemon subclasses it (daemon.py: _live_backend) to add what only a running
learnd knows (live processes, programs' learner state, pins applied at once):
the methods marked "live" are the ones to override. Errors: ControlError, one
line.
"""
from __future__ import annotations

import socket as _socket
import time
from typing import Protocol

from google.protobuf.message import DecodeError

from . import __version__
from . import layout as L
from ._pb import hakmem_pb2 as pb
from .config import ConfigError, parse_users, users_text
from .control import (ORIGIN_FROM_PB, ControlError, knobs_from_pb, policy_to_pb, process_to_pb,
                      program_to_pb)
from .learning import canonical
from .procfs import proc_start_time
from .ring import shm_dir as _default_shm_dir
from .store import Store

# Policy files: format 2 names the program's users (users, users_names);
# format 1, made before programs were learned per user (and still for a
# program without users), does not, and is imported only with --users.
EXPORT_FORMAT = 2
READ_FORMATS = (1, 2)


# ---- exported policy files -----------------------------------------------------
def check_export(f: pb.PolicyExport) -> None:
    """Raises ControlError(why) unless f is a complete policy file this hakmem can use."""
    if f.format not in READ_FORMATS:
        raise ControlError(f"format {f.format}, this hakmem reads formats {READ_FORMATS[0]} to {READ_FORMATS[-1]}")
    if not f.exe or not f.build_id:
        raise ControlError("no program identity (exe and build id)")
    if len(f.class_size) != L.NUM_CLASSES:
        raise ControlError(f"its class table has {len(f.class_size)} classes, this hakmem has {L.NUM_CLASSES}")
    sizes = list(f.class_size)[1:]
    if any(a <= 0 or b <= a for a, b in zip(sizes, sizes[1:])) or sizes[0] <= 0:
        raise ControlError("its class table is not a list of increasing sizes")
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


def checked_knobs(knobs, class_size) -> dict:
    """knobs (canonical) when the allocator would take them up in a program
    with this class table; else ControlError naming the first knob out of
    its bounds, from each knob's one definition (knobs.Bounds.for_class_sizes),
    as the allocator rejects such a policy whole (options.c policy_valid)."""
    from .knobs import Bounds, Knobs, KnobsError
    try:
        k = Knobs.of(knobs)
        k.check(Bounds.for_class_sizes(class_size), list(class_size))
    except KnobsError as e:
        raise ControlError(f"knobs: {e}; the allocator would refuse this policy, nothing was stored") from None
    except (TypeError, ValueError) as e:
        raise ControlError(f"knobs: {e}; nothing was stored") from None
    return k.to_dict()


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
        msg.objective = row["last_objective"] or ""      # Store.programs' row

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
        rows = self.store.programs()
        pols = self.store.policies_by_id([r[c] for r in rows for c in ("best_policy", "pinned_policy")])
        for row in rows:
            msg = program_to_pb(row, policies=pols)
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
            knobs = checked_knobs(knobs, prog["class_sizes"])
            pol_id = self.store.policy(prog["id"], knobs, "pinned", note=note or None)
        else:
            row = self.store.policy_by_version(prog["id"], version)
            # A version stored by an earlier hakmem that took any value.
            checked_knobs(row["knobs"], prog["class_sizes"])
            pol_id = row["id"]
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
        checked_knobs(knobs, list(file.class_size))
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
