"""The interface between hakmem-learnd and a learner, and the data it passes.

learnd (daemon.py) owns processes, rings, the store and the clock; a learner
owns one program's search. Once per sampling period learnd sums the program's
live processes into one `Window` and calls `Learner.observe`; the learner
answers with a `Decision` (a policy to apply now) or None (keep the one in
force). learnd applies the decision to every live process of the program,
stores any `Evaluation` it carries, and publishes an event with its reason.

A learner never touches /proc, rings or SQLite, so it can be driven by
recorded windows in tests and offline. Learners are found by name in
`LEARNERS` (learners.py); `hakmem-learnd --learner NAME` picks one.

Knobs are plain dicts, the same shape everywhere (ring.py, store, proto):
    {"drain_ms": int, "tcache_cap": [int]*C, "tcache_batch": [int]*C, "warm_slabs": [int]*C}
with C = NUM_CLASSES and class 0 (huge objects) always 0.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Protocol

import numpy as np

from . import layout as L
from .objective import Objective

KNOB_KEYS = ("drain_ms", *L.KNOBS_PER_CLASS)


def canonical(knobs: dict) -> dict:
    """The knobs as plain ints in key order (no version, no extra keys)."""
    out = {"drain_ms": int(knobs["drain_ms"])}
    for k in L.KNOBS_PER_CLASS:
        v = [int(x) for x in knobs[k]]
        if len(v) != L.NUM_CLASSES:
            raise ValueError(f"{k} has {len(v)} classes, the layout has {L.NUM_CLASSES}")
        out[k] = v
    return out


def digest(knobs: dict) -> str:
    return hashlib.sha256(json.dumps(canonical(knobs), separators=(",", ":")).encode()).hexdigest()


def same(a: dict | None, b: dict | None) -> bool:
    return a is not None and b is not None and canonical(a) == canonical(b)


@dataclasses.dataclass(frozen=True)
class Context:
    """What a learner knows about a program before its first window."""
    program: str                 # program key, for log lines
    class_size: tuple[int, ...]  # block size per class (class 0: 0)
    cap_max: tuple[int, ...]     # bounds per class, from the ring header
    warm_max: tuple[int, ...]
    batch_max: int
    drain_ms_max: int
    default: dict                # the knobs the program starts with
    objective: Objective
    sample_period_s: float = 1.0
    explore: bool = True         # False: measure and remember, never try a new policy

    @classmethod
    def from_header(cls, program, header, default, objective, sample_period_s=1.0, explore=True):
        return cls(program=program, class_size=tuple(header["class_size"]), cap_max=tuple(header["cap_max"]),
                   warm_max=tuple(header["warm_max"]), batch_max=int(header["batch_max"]),
                   drain_ms_max=int(header["drain_ms_max"]), default=canonical(default),
                   objective=objective, sample_period_s=sample_period_s, explore=explore)

    def clamp(self, knobs: dict) -> dict:
        """The nearest policy inside the allocator's bounds (batch <= cap, class 0 zero)."""
        k = canonical(knobs)
        k["drain_ms"] = min(max(k["drain_ms"], 0), self.drain_ms_max)
        for c in range(L.NUM_CLASSES):
            if c == 0:
                k["tcache_cap"][0] = k["tcache_batch"][0] = k["warm_slabs"][0] = 0
                continue
            cap = min(max(k["tcache_cap"][c], 0), self.cap_max[c])
            k["tcache_cap"][c] = cap
            k["tcache_batch"][c] = min(max(k["tcache_batch"][c], 1), self.batch_max, max(cap, 1))
            k["warm_slabs"][c] = min(max(k["warm_slabs"][c], 0), self.warm_max[c])
        return k


@dataclasses.dataclass
class Window:
    """One sampling period of one program: its live processes summed.

    Per-class arrays have NUM_CLASSES entries. Rates are per second over the
    window; gauges are the values at its end. `knobs` is the policy learnd
    had confirmed in force in every process for the whole window, or None
    when it changed during the window (a transition: not evidence for
    either policy)."""
    t_start: float
    t_end: float
    knobs: dict | None
    processes: int
    allocs: np.ndarray
    refills: np.ndarray
    drains: np.ndarray
    remote_frees: np.ndarray
    slabs_from_os: np.ndarray
    slabs_to_os: np.ndarray
    slabs_from_warm: np.ndarray
    slabs_to_warm: np.ndarray
    slow_ns: np.ndarray
    cached_bytes: np.ndarray
    live_bytes: np.ndarray
    os_calls: float              # mmap + munmap + madvise per second
    minflt: float                # page faults per second (/proc)
    rss_bytes: float
    threads: int
    active: bool                 # some process wrote a record (ran a slow path) in the window
    time_cost: float
    mem_cost: float
    cost: float
    cpu: float = 0.0             # the processes' CPU use, cores (/proc utime+stime): a busy window
                                 # without any slow path is evidence that the policy in force
                                 # served every call from the caches, not an idle program

    @property
    def busy(self) -> bool:
        """Some process ran a slow path, or used at least 5% of a core."""
        return self.active or self.cpu >= 0.05

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start

    def mix(self) -> np.ndarray:
        """Share of allocations per class (zeros when nothing was allocated)."""
        tot = float(self.allocs.sum())
        return self.allocs / tot if tot > 0 else np.zeros_like(self.allocs, dtype=float)


@dataclasses.dataclass
class Evaluation:
    """A verdict on one policy, measured over several windows."""
    knobs: dict
    t_start: float
    t_end: float
    windows: int
    cost_mean: float
    cost_sd: float
    time_cost: float
    mem_cost: float
    verdict: str                         # measured | accepted | rejected | rolled_back
    baseline_knobs: dict | None = None   # the incumbent it was compared with
    baseline_cost: float | None = None


@dataclasses.dataclass
class Decision:
    knobs: dict                          # apply this now
    kind: str                            # explore | accept | rollback | relearn | settle
    reason: str                          # one line for a person
    evaluations: list[Evaluation] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Prior:
    """A policy measured before (warm start): from the store's evaluations."""
    knobs: dict
    cost_mean: float
    cost_sd: float
    windows: int


class Learner(Protocol):
    name: str

    def start(self, ctx: Context, incumbent: dict, history: list[Prior]) -> Decision | None:
        """Called once per program (again after learnd restarts). incumbent is
        the best known policy (the stored best, else the default); history
        what was measured before. May return the first policy to apply."""

    def observe(self, w: Window) -> Decision | None:
        """Once per window. Return a policy to apply now, or None to keep it."""

    def incumbent(self) -> tuple[dict, float | None]:
        """The best policy so far and its measured mean cost (None: unmeasured)."""

    def state(self) -> str:
        """measuring | exploring | settled | idle, for `hakmem status`."""

    def pending(self) -> list[Evaluation]:
        """Evaluations closed since the last call and not carried by a
        Decision (a settled or static learner measures without deciding).
        Called once per window; never interrupts a trial."""

    def flush(self) -> list[Evaluation]:
        """Everything not yet reported, open measurements closed as they
        stand (called when the program goes idle or learnd stops)."""
