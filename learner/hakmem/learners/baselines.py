"""The baselines a learner has to beat: "missdriven", the heuristic any
production allocator could ship without a learner (tcmalloc sizes its
per-thread caches this way), and "static", which never changes anything and
only measures, to price the default or a pinned policy."""
from __future__ import annotations

import numpy as np

from .. import layout as L
from ..knobs import Knobs, default_batch
from ..learning import Context, Decision, Evaluation, Prior, Window, canonical, same
from ..objective import format_size
from .base import Reporting, _active, _Meter, _push, _rate, _start_decision


class _Baseline(Reporting):
    """A learner that keeps one policy at a time (`_knobs`) and measures it
    with a _Meter: start, incumbent and flush shared by both baselines."""

    def __init__(self, *, seed: int = 0, report_every: int = 10):
        self.seed = seed      # deterministic anyway; kept so every learner takes it
        self.report_every = report_every
        self.ctx: Context | None = None

    def start(self, ctx: Context, incumbent, history: list[Prior]) -> Decision | None:
        self.ctx = ctx
        self._knobs, first = _start_decision(ctx, incumbent, history)
        self._meter = _Meter(self.report_every)
        self._pending: list[Evaluation] = []
        self._inactive = False
        return first

    def _check_started(self) -> None:
        if self.ctx is None:
            raise RuntimeError("observe() before start()")

    def incumbent(self) -> tuple[Knobs, float | None]:
        run = self._meter.run
        return self._knobs, (run.mean if run is not None and run.n and same(run.knobs, self._knobs) else None)

    def flush(self) -> list[Evaluation]:
        if self.ctx is None:
            return []
        return self._take() + self._meter.flush()


# ---- a cache-miss controller ---------------------------------------------------------
class MissDrivenLearner(_Baseline):
    """Doubles a class's capacity while its thread caches miss often; halves
    it once the class has sat idle for a few windows still holding cached
    blocks. Warm pools and the drain interval are left alone, and the cost is
    never looked at: this is the heuristic a learner has to beat."""

    name = "missdriven"

    def __init__(self, *, seed: int = 0, miss_ratio: float = 0.05, miss_rate: float = 50.0,
                 idle_windows: int = 3, min_cap: int = 4, report_every: int = 10):
        super().__init__(seed=seed, report_every=report_every)
        self.miss_ratio, self.miss_rate = miss_ratio, miss_rate
        self.idle_windows, self.min_cap = idle_windows, min_cap

    def start(self, ctx: Context, incumbent, history: list[Prior]) -> Decision | None:
        first = super().start(ctx, incumbent, history)
        self._idle = np.zeros(L.NUM_CLASSES, dtype=int)
        self._quiet = 0
        return first

    def observe(self, w: Window) -> Decision | None:
        self._check_started()
        # Counters from a transition or from the policy before ours would
        # double what was already doubled.
        if w.knobs is None or not same(w.knobs, self._knobs):
            return None
        if not _active(w):
            self._inactive = True
            return None
        self._inactive = False
        _push(self._pending, self._meter.add(w))
        k = canonical(self._knobs)       # the dict form, changed here, clamped into Knobs below
        changes = []
        for c in range(1, L.NUM_CLASSES):
            cap = k["tcache_cap"][c]
            a, r = float(w.allocs[c]), float(w.refills[c])
            if a > 0:
                self._idle[c] = 0
                # A miss is a block the cache did not have: a refill brings a
                # batch of them, so count blocks, not refills (a cache cycling
                # through 512-block batches misses on every block it hands out).
                missed = r * k["tcache_batch"][c] / a
                if r > self.miss_rate and missed > self.miss_ratio and cap < self.ctx.cap_max[c]:
                    new = min(max(cap * 2, 1), self.ctx.cap_max[c])
                    changes.append(f"grow cap@{self.ctx.class_size[c]}B {cap}->{new} "
                                   f"(refills {_rate(r)}/s, {min(missed, 1) * 100:.2g}% of blocks from refills)")
                    self._set_cap(k, c, new)
                continue
            self._idle[c] += 1
            floor = max(1, min(self.min_cap, self.ctx.default["tcache_cap"][c]))
            if self._idle[c] >= self.idle_windows and w.cached_bytes[c] > 0 and cap > floor:
                new = max(cap // 2, floor)
                changes.append(f"shrink cap@{self.ctx.class_size[c]}B {cap}->{new} "
                               f"(idle {self._idle[c]} windows, {format_size(float(w.cached_bytes[c]))} cached)")
                self._set_cap(k, c, new)
                self._idle[c] = 0
        if not changes:
            self._quiet += 1
            return None
        self._quiet = 0
        self._knobs = self.ctx.clamp(k)
        more = f"; and {len(changes) - 4} more" if len(changes) > 4 else ""
        return Decision(self._knobs, "explore", "; ".join(changes[:4]) + more, self._take())

    def _set_cap(self, k: dict, c: int, cap: int) -> None:
        k["tcache_cap"][c] = cap
        k["tcache_batch"][c] = default_batch(cap, self.ctx.batch_max)

    def state(self) -> str:
        if self.ctx is None or self._inactive:
            return "idle"
        return "exploring" if self._quiet < self.idle_windows else "settled"


# ---- measure only -----------------------------------------------------------------
class StaticLearner(_Baseline):
    """Keeps the policy it starts with and measures it."""

    name = "static"

    def start(self, ctx: Context, incumbent, history: list[Prior]) -> Decision | None:
        first = super().start(ctx, incumbent, history)
        if first is not None:
            first.reason = "apply the given policy and keep it"
        return first

    def observe(self, w: Window) -> Decision | None:
        self._check_started()
        if w.knobs is None:
            return None
        self._inactive = not w.busy
        _push(self._pending, self._meter.add(w))
        return None

    def state(self) -> str:
        return "idle" if self.ctx is None or self._inactive else "measuring"
