"""The interface between hakmem-learnd and a learner, and the data it passes.

learnd (daemon.py) owns processes, rings, the store and the clock; a learner
owns one program's search. Once per sampling period learnd sums the program's
live processes into one `Window` and calls `Learner.observe`; the learner
answers with a `Decision` (a policy to apply now) or None (keep the one in
force). learnd applies the decision to every live process of the program,
stores any `Evaluation` it carries, and publishes an event with its reason.

A learner never touches /proc, rings or SQLite, so it can be driven by
recorded windows in tests and offline. Learners are found by name in
`LEARNERS` (learners/__init__.py); `hakmem-learnd --learner NAME` picks one.

Knobs are `knobs.Knobs` (immutable; k["tcache_cap"][c] reads as the dict
form does); every function here also takes the dict form
    {"drain_ms": int, "retain_mib": int, "tcache_cap": [int]*C, "tcache_batch": [int]*C, "warm_slabs": [int]*C}
with C = NUM_CLASSES and class 0 (huge objects) always 0.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Protocol, Sequence

import numpy as np

from . import knobs as K
from . import layout as L
from .objective import Objective

KNOB_KEYS = K.ORDER


def canonical(knobs: Mapping) -> dict:
    """The knobs as plain ints in key order (no version, no extra keys): a
    dict the caller may change (Knobs.to_dict)."""
    return K.Knobs.of(knobs).to_dict()


def digest(knobs: Mapping) -> str:
    return K.Knobs.of(knobs).digest()


def same(a: Mapping | None, b: Mapping | None) -> bool:
    return a is not None and b is not None and K.Knobs.of(a) == K.Knobs.of(b)


@dataclasses.dataclass(frozen=True)
class Context:
    """What a learner knows about a program before its first window."""
    program: str                 # program key, for log lines
    class_size: tuple[int, ...]  # block size per class (class 0: 0)
    cap_max: tuple[int, ...]     # bounds per class, from the ring header
    warm_max: tuple[int, ...]
    batch_max: int
    drain_ms_max: int
    default: K.Knobs             # the knobs the program starts with (a dict is taken as Knobs)
    objective: Objective
    sample_period_s: float = 1.0
    explore: bool = True         # False: measure and remember, never try a new policy
    retain_mib_max: int = int(K.SPEC["retain_mib"]["max"])

    def __post_init__(self):
        object.__setattr__(self, "default", K.Knobs.of(self.default))

    @classmethod
    def from_header(cls, program, header, default, objective, sample_period_s=1.0, explore=True):
        return cls(program=program, class_size=tuple(header["class_size"]), cap_max=tuple(header["cap_max"]),
                   warm_max=tuple(header["warm_max"]), batch_max=int(header["batch_max"]),
                   drain_ms_max=int(header["drain_ms_max"]), retain_mib_max=int(header["retain_mib_max"]),
                   default=K.Knobs.of(default), objective=objective, sample_period_s=sample_period_s,
                   explore=explore)

    @functools.cached_property
    def bounds(self) -> K.Bounds:
        """The bounds this context holds, as the header publishes them."""
        return K.Bounds.from_header({"cap_max": self.cap_max, "warm_max": self.warm_max,
                                     "batch_max": self.batch_max, "drain_ms_max": self.drain_ms_max,
                                     "retain_mib_max": self.retain_mib_max})

    def clamp(self, knobs: Mapping) -> K.Knobs:
        """The nearest policy inside the allocator's bounds (batch <= cap, class 0 zero)."""
        return K.Knobs.of(knobs).clamp(self.bounds)


OS_CALLS = ("mmap_calls", "munmap_calls", "madvise_calls")   # summed into Window.os_calls


class Window:
    """One sampling period of one process, or of a program (its live
    processes summed: `merge`).

    Every counter of the layout is here, by its name (schemas/shm_layout.json):
    `cls[name]` per class (NUM_CLASSES floats; also `w.allocs`, `w.slow_ns`),
    `proc[name]` per process (`w.threads`, `w.committed_bytes`). Cumulative
    counters are rates per second over the window, gauges the values at its
    end (ring.window). From /proc: minflt (faults per second), rss_bytes,
    cpu (cores). `knobs` is the policy learnd had confirmed in force in every
    process for the whole window, or None when it changed during the window
    (a transition: not evidence for either policy). `row()` is the store's
    windows row; a counter added to the layout is in it by its name.

    Window(t_start, t_end, knobs, processes, allocs=..., refills=..., ...):
    counters not given are zeros; os_calls and threads may be given for the
    process counters they stand for.

    The kernel's side (hakmem-bpf, kernel.py): `kern[name]` for each of the
    layout's kernel_counters (`w.k_faults`, `w.k_os_ns`), rates per second,
    and `kernel_source`: "bpf" when hakmem-bpf measured every process of the
    window (then the objective prices these in place of the /proc estimate),
    "proc" when none was, "mixed" for a merge of both (priced from /proc)."""

    SCALARS = ("minflt", "rss_bytes", "cpu", "time_cost", "mem_cost", "cost")

    def __init__(self, t_start: float, t_end: float, knobs: Mapping | None = None, processes: int = 1, *,
                 cls: Mapping | None = None, proc: Mapping | None = None, active: bool = False,
                 minflt: float = 0.0, rss_bytes: float = 0.0, cpu: float = 0.0, time_cost: float = 0.0,
                 mem_cost: float = 0.0, cost: float = 0.0, os_calls: float | None = None,
                 threads: int | None = None, kern: Mapping | None = None, kernel_source: str = "proc",
                 **counters):
        self.t_start, self.t_end = float(t_start), float(t_end)
        self.knobs = K.Knobs.of(knobs) if knobs is not None else None
        self.processes = int(processes)
        cls, proc = dict(cls or {}), dict(proc or {})
        for name, v in counters.items():
            if name in L.CLASS_COUNTERS:
                cls[name] = v
            elif name in L.PROC_COUNTERS:
                proc[name] = v
            else:
                raise TypeError(f"Window: unknown counter {name!r}")
        if threads is not None:
            proc["threads"] = threads
        self.cls = {n: np.asarray(cls[n], dtype=float) if n in cls else np.zeros(L.NUM_CLASSES)
                    for n in L.CLASS_COUNTERS}
        for n, v in self.cls.items():
            if v.shape != (L.NUM_CLASSES,):
                raise ValueError(f"Window: {n} has shape {v.shape}, the layout has {L.NUM_CLASSES} classes")
        self.proc = {n: float(proc.get(n, 0.0)) for n in L.PROC_COUNTERS}
        kern = dict(kern or {})
        self.kern = {n: float(kern.get(n, 0.0)) for n in L.KERNEL_COUNTERS}
        self.kernel_source = str(kernel_source)
        self.os_calls = float(sum(self.proc[n] for n in OS_CALLS) if os_calls is None else os_calls)
        self.active = bool(active)
        self.minflt, self.rss_bytes, self.cpu = float(minflt), float(rss_bytes), float(cpu)
        self.time_cost, self.mem_cost, self.cost = float(time_cost), float(mem_cost), float(cost)

    def __getattr__(self, name):
        # Counters by name: w.allocs (per class), w.committed_bytes (per process).
        d = self.__dict__
        if "cls" in d and name in d["cls"]:
            return d["cls"][name]
        if "proc" in d and name in d["proc"]:
            v = d["proc"][name]
            return int(v) if name == "threads" else v
        if "kern" in d and name in d["kern"]:
            return d["kern"][name]
        raise AttributeError(name)

    def __repr__(self):
        return (f"Window({self.t_start:.3f}..{self.t_end:.3f}, {self.processes} processes, "
                f"allocs {float(self.allocs.sum()):.4g}/s, cost {self.cost:.4g})")

    def replace(self, **changes) -> "Window":
        """A copy with some fields changed (t_start, knobs, costs, ...)."""
        kw = dict(knobs=self.knobs, processes=self.processes, cls=self.cls, proc=self.proc, active=self.active,
                  os_calls=self.os_calls, kern=self.kern, kernel_source=self.kernel_source,
                  **{n: getattr(self, n) for n in self.SCALARS})
        kw.update(changes)
        if "proc" in changes and "os_calls" not in changes:
            kw["os_calls"] = None
        t0, t1 = kw.pop("t_start", self.t_start), kw.pop("t_end", self.t_end)
        return Window(t0, t1, **kw)

    # ---- made from records, summed, stored --------------------------------------
    @classmethod
    def between(cls, prev, rec, seconds: float, **fields) -> "Window":
        """One process's window from two telemetry records (prev older, either
        may be None): rates of every counter over `seconds` (a counter never
        goes back: below zero is zero), gauges at rec. Without a newer record
        than prev, the rates are zero and the window is not active."""
        from .ring import window as rates
        if rec is None:
            return cls(fields.pop("t_start", 0.0), fields.pop("t_end", seconds), **fields)
        if prev is not None and int(rec["index"]) > int(prev["index"]):
            r = rates(prev, rec, seconds=seconds, clamp=True)
            active = True
        else:     # gauges only
            r = {"cls": {n: rec["cls"][n] if n in L.GAUGES else np.zeros(L.NUM_CLASSES) for n in L.CLASS_COUNTERS},
                 "proc": {n: int(rec["proc"][n]) if n in L.GAUGES else 0.0 for n in L.PROC_COUNTERS}}
            active = False
        return cls(fields.pop("t_start", 0.0), fields.pop("t_end", seconds), cls=r["cls"], proc=r["proc"],
                   active=active, **fields)

    @classmethod
    def merge(cls, parts: Sequence["Window"], **fields) -> "Window":
        """The sum of several processes' windows of one period: every counter,
        /proc measure and cost summed, active when any is; processes counted;
        the knobs all of them had (None unless the same). fields (t_start,
        knobs, ...) are set on the result."""
        if not parts:
            raise ValueError("Window.merge of no windows")
        knobs = parts[0].knobs if all(w.knobs == parts[0].knobs for w in parts) else None
        kw = dict(t_start=parts[0].t_start, t_end=parts[0].t_end, knobs=knobs, processes=len(parts),
                  cls={n: sum(w.cls[n] for w in parts) for n in L.CLASS_COUNTERS},
                  proc={n: sum(w.proc[n] for w in parts) for n in L.PROC_COUNTERS},
                  os_calls=sum(w.os_calls for w in parts), active=any(w.active for w in parts),
                  kern={n: sum(w.kern[n] for w in parts) for n in L.KERNEL_COUNTERS},
                  kernel_source=parts[0].kernel_source if all(w.kernel_source == parts[0].kernel_source
                                                              for w in parts) else "mixed",
                  **{n: sum(getattr(w, n) for w in parts) for n in cls.SCALARS})
        kw.update(fields)
        return cls(kw.pop("t_start"), kw.pop("t_end"), **kw)

    def row(self) -> dict:
        """The store's windows row: every counter summed over classes, by its
        name, the /proc measures, the costs, and the allocation mix. The store
        keeps the keys its windows table has columns for (store.py)."""
        out = {"t_start": self.t_start, "t_end": self.t_end}
        out.update({n: float(v.sum()) for n, v in self.cls.items()})
        out.update(self.proc)
        out.update(self.kern, k_bpf=1.0 if self.kernel_source == "bpf" else 0.0)
        out.update(os_calls=self.os_calls, **{n: getattr(self, n) for n in self.SCALARS})
        out["mix"] = self.allocs.astype(np.float32)
        return out

    @property
    def busy(self) -> bool:
        """Some process ran a slow path, or used at least 5% of a core: a busy
        window without any slow path is evidence that the policy in force
        served every call from the caches, not an idle program."""
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
    kind: str                            # explore | ab (an A/B trial's switch) | accept | rollback | relearn | settle
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
