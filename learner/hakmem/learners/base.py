"""What every learner shares: the interface learnd drives (defined with the
data it passes in learning.py, re-exported here), and the pieces the
learners are built of: windows measured under one policy (`_Run`), plain
measurement (`_Meter`), the evaluations a learner hands over (`Reporting`),
the decision a learner starts with, and the counters' helpers.

A new learner: a module in this package with a class that has `name` and the
`Learner` methods (usually a `Reporting` subclass), registered in
`LEARNERS` (__init__.py); `hakmem-learnd --learner NAME` picks it.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from ..knobs import Knobs
from ..learning import Context, Decision, Evaluation, Learner, Prior, Window, same

__all__ = ["Context", "Decision", "Evaluation", "Learner", "Prior", "Reporting", "Window", "MAX_PENDING"]

MAX_PENDING = 1000           # evaluations kept for flush(); older "measured" ones are dropped
PAUSE_EVERY_S = 0.02         # pause() calls its hook at most this often

_pause_hook = None
_pause_last = 0.0


def set_pause(hook) -> None:
    """What pause() calls (None: nothing): learnd answers the requests that
    only read while a learner computes (control.Server.serve(readonly=True))."""
    global _pause_hook
    _pause_hook = hook


def pause() -> None:
    """Called by a learner's long computations (the GP's fit, once per
    optimizer step): learnd's loop is one thread, and a fit that takes
    seconds on a loaded machine would keep every request waiting that long.
    The hook must not touch the learner computing."""
    global _pause_last
    if _pause_hook is None:
        return
    import time
    now = time.monotonic()
    if now - _pause_last >= PAUSE_EVERY_S:
        _pause_last = now
        _pause_hook()


def _churn(w: Window) -> np.ndarray:
    return w.slabs_from_os + w.slabs_to_os + w.slabs_from_warm + w.slabs_to_warm


def _rate(v: float) -> str:
    """31k, 1.2M: rates for a person."""
    for unit, k in (("M", 1e6), ("k", 1e3)):
        if abs(v) >= k:
            return f"{v / k:.3g}{unit}"
    return f"{v:.3g}"


def _pct(v: float) -> str:
    return f"{v * 100:+.1f}%"


def _mean_windows(ws: Sequence[Window], field: str) -> np.ndarray:
    return np.mean([np.asarray(getattr(w, field), dtype=float) for w in ws], axis=0)


# ---- measurements -----------------------------------------------------------------
class _Run:
    """Windows measured under one policy."""

    def __init__(self, knobs: Knobs, x: np.ndarray | None = None, radius: float = 0.0):
        self.knobs = knobs
        self.x = x
        self.radius = radius
        self.t0: float | None = None
        self.t1: float | None = None
        self.cost: list[float] = []
        self.time: list[float] = []
        self.mem: list[float] = []
        self.flushed = 0      # windows handed over in a "measured" evaluation already (GPLearner.flush)

    def add(self, w: Window) -> None:
        self.t0 = w.t_start if self.t0 is None else self.t0
        self.t1 = w.t_end
        self.cost.append(float(w.cost))
        self.time.append(float(w.time_cost))
        self.mem.append(float(w.mem_cost))

    @property
    def n(self) -> int:
        return len(self.cost)

    @property
    def mean(self) -> float:
        return float(np.mean(self.cost))

    @property
    def sd(self) -> float:
        return float(np.std(self.cost, ddof=1)) if self.n > 1 else 0.0

    def rel_ss(self) -> tuple[float, int]:
        """Squared deviations relative to the run's own mean, and their degrees
        of freedom: relative, because noise scales with the cost and the search
        visits policies whose costs differ tenfold."""
        if self.n < 2 or self.mean <= 0:
            return 0.0, 0
        r = np.asarray(self.cost) / self.mean - 1.0
        return float(np.sum(r * r)), self.n - 1

    def evaluation(self, verdict: str, baseline_knobs: Knobs | None = None,
                   baseline_cost: float | None = None) -> Evaluation:
        return Evaluation(knobs=self.knobs, t_start=float(self.t0), t_end=float(self.t1), windows=self.n,
                          cost_mean=self.mean, cost_sd=self.sd, time_cost=float(np.mean(self.time)),
                          mem_cost=float(np.mean(self.mem)), verdict=verdict,
                          baseline_knobs=baseline_knobs, baseline_cost=baseline_cost)


class _Meter:
    """Consecutive windows of the policy in force, reported as "measured"."""

    def __init__(self, report_every: int):
        self.report_every = report_every
        self.run: _Run | None = None

    def add(self, w: Window) -> list[Evaluation]:
        out = []
        if self.run is not None and not same(self.run.knobs, w.knobs):
            out.append(self.run.evaluation("measured"))
            self.run = None
        if self.run is None:
            self.run = _Run(Knobs.of(w.knobs))
        self.run.add(w)
        if self.run.n >= self.report_every:
            out.append(self.run.evaluation("measured"))
            self.run = _Run(self.run.knobs)
        return out

    def flush(self) -> list[Evaluation]:
        out = [self.run.evaluation("measured")] if self.run is not None and self.run.n else []
        if self.run is not None:
            self.run = _Run(self.run.knobs)
        return out


def _active(w: Window) -> bool:
    # A window where nothing ran a slow path says nothing about the caches.
    return bool(w.active) and float(np.sum(w.allocs)) > 0


def _push(pending: list[Evaluation], evs: Iterable[Evaluation]) -> None:
    pending.extend(evs)
    # A settled program reports only through flush(); keep memory bounded by
    # dropping the oldest plain measurements, never a verdict.
    while len(pending) > MAX_PENDING:
        i = next((j for j, e in enumerate(pending) if e.verdict == "measured"), 0)
        pending.pop(i)


def _start_decision(ctx: Context, incumbent, history: Sequence[Prior]) -> tuple[Knobs, Decision | None]:
    inc = ctx.clamp(incumbent)
    if same(inc, ctx.default):
        return inc, None
    prior = next((p for p in history if same(p.knobs, inc)), None)
    why = f" (cost {prior.cost_mean:.4g} over {prior.windows} windows)" if prior else ""
    return inc, Decision(inc, "accept", f"start from the best known policy{why}")



class Reporting:
    """Evaluations a learner has closed, handed over without disturbing it
    (Learner.pending), or carried by its next Decision (_take)."""
    _pending: list

    def pending(self) -> list[Evaluation]:
        out, self._pending = self._pending, []
        return out

    def _take(self) -> list[Evaluation]:
        out, self._pending = self._pending, []
        return out
