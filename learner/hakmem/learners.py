"""The learners hakmem-learnd can run, found by name in `LEARNERS`.

"gp" is the learner proper. It first measures the policy it starts from for a
few windows, to know the cost and how noisy a window is. It then searches a
small space (`PolicySpace`): the thread-cache capacity and warm pool of the
program's few hot size classes, one multiplier for every other class's
capacity, and the drain interval, all in log2 units around the allocator's
defaults. Each proposal is one step inside a trust region around the best
policy so far (the incumbent), picked by expected improvement under a Gaussian
process fitted to every measured policy, with the counters (refills, cached
bytes, slab churn) deciding the order while the process knows too little. A
candidate runs for a few windows and is kept only when it beats the incumbent
by more than the noise; otherwise the incumbent is back at the next decision.
Successes widen the region, failures narrow it; repeated failures at the
smallest step settle the search until the program's size-class mix changes,
which starts it again around the incumbent.

"missdriven" is the baseline any production allocator could ship without a
learner (tcmalloc sizes its per-thread caches this way): double a class's
capacity when its cache misses often, halve it when the class sits idle
holding memory. "static" never changes anything and only measures, to price
the default or a pinned policy. A learner earns its place by beating both.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import warnings
from typing import Iterable, Sequence

import numpy as np

from . import layout as L
from .learning import Context, Decision, Evaluation, Prior, Window, canonical, digest, same
from .objective import format_size

DRAIN_MIN_MS = 10
DRAIN_MAX_MS = 60000
BATCH_DEFAULT_MAX = 256      # the allocator's default batch never exceeds this (options.c)
MAX_PENDING = 1000           # evaluations kept for flush(); older "measured" ones are dropped


def batch_for(cap: int, batch_max: int) -> int:
    """The batch the allocator's default pairs with a capacity (options.c)."""
    return max(1, min(cap // 2, BATCH_DEFAULT_MAX, batch_max))


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

    def __init__(self, knobs: dict, x: np.ndarray | None = None, radius: float = 0.0):
        self.knobs = knobs
        self.x = x
        self.radius = radius
        self.t0: float | None = None
        self.t1: float | None = None
        self.cost: list[float] = []
        self.time: list[float] = []
        self.mem: list[float] = []

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

    def evaluation(self, verdict: str, baseline_knobs: dict | None = None,
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
            self.run = _Run(canonical(w.knobs))
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


def _start_decision(ctx: Context, incumbent: dict, history: Sequence[Prior]) -> tuple[dict, Decision | None]:
    inc = ctx.clamp(incumbent)
    if same(inc, ctx.default):
        return inc, None
    prior = next((p for p in history if same(p.knobs, inc)), None)
    why = f" (cost {prior.cost_mean:.4g} over {prior.windows} windows)" if prior else ""
    return inc, Decision(inc, "accept", f"start from the best known policy{why}")


# ---- the search space --------------------------------------------------------------
class PolicySpace:
    """A few log2 dimensions standing for the full knobs (61 classes x 3 + drain).

    Per hot class: log2(cap/base_cap) and log2((warm+1)/(base_warm+1)), bases
    being the allocator's defaults, so 0 is the default and 1 doubles it. Then
    one log2 multiplier on the anchor's caps of every other class, and
    log2(drain_ms/1000). Values a dimension does not move stay exactly the
    anchor's (the incumbent the space was built around), so to_knobs of
    from_knobs(anchor) is the anchor itself, custom batches and all."""

    def __init__(self, ctx: Context, incumbent: dict, windows: Sequence[Window], max_hot: int = 3,
                 min_score: float = 0.05):
        self.ctx = ctx
        self.anchor = ctx.clamp(incumbent)
        self.hot: tuple[int, ...] = self.hot_classes(windows, max_hot, min_score)
        d = ctx.default
        self.base_cap = {c: max(1, int(d["tcache_cap"][c])) for c in self.hot}
        self.base_warm = {c: int(d["warm_slabs"][c]) for c in self.hot}
        self.dims: list[tuple[str, int | None]] = []
        for c in self.hot:
            self.dims += [("cap", c), ("warm", c)]
        self.dims += [("rest", None), ("drain", None)]
        self.names = [self._name(k, c) for k, c in self.dims]
        lo, hi = [], []
        for k, c in self.dims:
            if k == "cap":
                b = self.base_cap[c]
                lo.append(max(math.log2(1.0 / b), -6.0))
                hi.append(math.log2(max(ctx.cap_max[c], 1) / b))
            elif k == "warm":
                b = self.base_warm[c] + 1
                lo.append(math.log2(1.0 / b))
                hi.append(math.log2((ctx.warm_max[c] + 1) / b))
            elif k == "rest":
                lo.append(-4.0)
                hi.append(3.0)
            else:
                top = min(DRAIN_MAX_MS, max(ctx.drain_ms_max, DRAIN_MIN_MS))
                lo.append(math.log2(DRAIN_MIN_MS / 1000))
                hi.append(math.log2(top / 1000))
        self.lo = np.array(lo)
        self.hi = np.maximum(np.array(hi), self.lo)
        self.x_anchor = self.from_knobs(self.anchor)   # before any to_knobs

    @staticmethod
    def hot_classes(windows: Sequence[Window], max_hot: int = 3, min_score: float = 0.05) -> tuple[int, ...]:
        """Classes ranked by share of allocations plus share of slab churn."""
        score = np.zeros(L.NUM_CLASSES)
        n = 0
        for w in windows:
            a = np.asarray(w.allocs, dtype=float)
            ch = np.asarray(_churn(w), dtype=float)
            if a.sum() > 0:
                score += a / a.sum()
            if ch.sum() > 0:
                score += ch / ch.sum()
            n += a.sum() > 0 or ch.sum() > 0
        if n:
            score /= n   # windows without counts say nothing about which class is hot
        score[0] = 0.0   # huge objects have no knobs
        order = sorted(range(L.NUM_CLASSES), key=lambda c: (-score[c], c))
        return tuple(c for c in order[:max_hot] if score[c] >= min_score)

    def _name(self, kind: str, c: int | None) -> str:
        if kind in ("cap", "warm"):
            return f"{kind}@{self.ctx.class_size[c]}B"
        return "cap@rest" if kind == "rest" else "drain"

    @property
    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return self.lo.copy(), self.hi.copy()

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def rest_classes(self) -> list[int]:
        return [c for c in range(1, L.NUM_CLASSES) if c not in self.hot]

    def from_knobs(self, knobs: dict) -> np.ndarray:
        k = canonical(knobs)
        x = []
        for kind, c in self.dims:
            if kind == "cap":
                x.append(math.log2(max(k["tcache_cap"][c], 1e-9) / self.base_cap[c]))
            elif kind == "warm":
                x.append(math.log2((k["warm_slabs"][c] + 1) / (self.base_warm[c] + 1)))
            elif kind == "rest":
                r = [math.log2(k["tcache_cap"][c] / self.anchor["tcache_cap"][c]) for c in self.rest_classes()
                     if self.anchor["tcache_cap"][c] > 0 and k["tcache_cap"][c] > 0]
                x.append(float(np.median(r)) if r else 0.0)
            else:
                # 0 (never) is longer than any interval in the space: its top.
                x.append(math.log2(k["drain_ms"] / 1000) if k["drain_ms"] > 0 else math.inf)
        return np.clip(np.array(x), self.lo, self.hi)

    def to_knobs(self, x: Sequence[float]) -> dict:
        x = np.clip(np.asarray(x, dtype=float), self.lo, self.hi)
        ctx, k = self.ctx, canonical(self.anchor)
        keep = np.abs(x - self.x_anchor) < 1e-9
        for i, (kind, c) in enumerate(self.dims):
            if keep[i]:
                continue
            if kind == "cap":
                cap = int(min(max(round(self.base_cap[c] * 2.0 ** x[i]), 1), ctx.cap_max[c]))
                self._set_cap(k, c, cap)
            elif kind == "warm":
                warm = round((self.base_warm[c] + 1) * 2.0 ** x[i] - 1)
                k["warm_slabs"][c] = int(min(max(warm, 0), ctx.warm_max[c]))
            elif kind == "rest":
                m = 2.0 ** x[i]
                for c2 in self.rest_classes():
                    a = self.anchor["tcache_cap"][c2]
                    if a > 0:
                        self._set_cap(k, c2, int(min(max(round(a * m), 1), ctx.cap_max[c2])))
            else:
                top = min(DRAIN_MAX_MS, ctx.drain_ms_max)
                k["drain_ms"] = int(min(max(round(1000 * 2.0 ** x[i]), DRAIN_MIN_MS), top))
        return ctx.clamp(k)

    def _set_cap(self, k: dict, c: int, cap: int) -> None:
        if cap != self.anchor["tcache_cap"][c]:
            k["tcache_cap"][c] = cap
            k["tcache_batch"][c] = batch_for(cap, self.ctx.batch_max)

    def describe(self, knobs: dict, before: dict) -> list[str]:
        """What differs between two policies, dimension by dimension."""
        out = []
        for kind, c in self.dims:
            if kind == "cap" and knobs["tcache_cap"][c] != before["tcache_cap"][c]:
                out.append(f"cap@{self.ctx.class_size[c]}B {before['tcache_cap'][c]}->{knobs['tcache_cap'][c]}")
            elif kind == "warm" and knobs["warm_slabs"][c] != before["warm_slabs"][c]:
                out.append(f"warm@{self.ctx.class_size[c]}B {before['warm_slabs'][c]}->{knobs['warm_slabs'][c]}")
            elif kind == "rest":
                r = [knobs["tcache_cap"][c2] / before["tcache_cap"][c2] for c2 in self.rest_classes()
                     if before["tcache_cap"][c2] > 0 and knobs["tcache_cap"][c2] != before["tcache_cap"][c2]]
                if r:
                    out.append(f"cap@rest x{float(np.median(r)):.3g}")
            elif kind == "drain" and knobs["drain_ms"] != before["drain_ms"]:
                out.append(f"drain {before['drain_ms']}->{knobs['drain_ms']} ms")
        return out


# ---- the Bayesian-optimisation learner ---------------------------------------------------
@dataclasses.dataclass
class _Cand:
    x: np.ndarray
    knobs: dict
    evidence: float = 0.0
    why: str = ""


class _Reports:
    """Evaluations a learner has closed, handed over without disturbing it."""
    _pending: list

    def pending(self) -> list[Evaluation]:
        out, self._pending = self._pending, []
        return out


class GPLearner(_Reports):
    """Gaussian-process Bayesian optimisation in a trust region, with rollback."""

    name = "gp"

    def __init__(self, *, seed: int = 0, radius: float = 1.0, radius_min: float = 0.25,
                 radius_max: float = 2.0, shrink: float = 0.5, grow: float = 1.5, warmup_windows: int = 3,
                 trial_windows: int = 3, remeasure_every: int = 4, remeasure_windows: int = 3,
                 settle_after: int = 3, report_every: int = 10, mix_threshold: float = 0.5,
                 trial_windows_max: int = 8, flat_after: int = 6, stall_windows: int = 10,
                 mix_windows: int = 3, max_hot: int = 3, n_random: int = 64, min_margin: float = 0.005,
                 prior_sd: float = 0.01, max_points: int = 150, evidence_weight: float = 0.01,
                 random_dims: float = 1.0):
        self.seed = seed
        self.radius0, self.radius_min, self.radius_max = radius, radius_min, radius_max
        self.shrink, self.grow = shrink, grow
        self.warmup_windows = max(2, warmup_windows)
        self.trial_windows = max(2, trial_windows)
        self.trial_windows_max = max(self.trial_windows, trial_windows_max)
        self.flat_after = flat_after
        self.stall_windows = stall_windows
        self.remeasure_every, self.remeasure_windows = remeasure_every, remeasure_windows
        self.settle_after, self.report_every = settle_after, report_every
        self.mix_threshold, self.mix_windows = mix_threshold, mix_windows
        self.max_hot, self.n_random = max_hot, n_random
        self.min_margin, self.prior_sd, self.max_points = min_margin, prior_sd, max_points
        self.evidence_weight, self.random_dims = evidence_weight, random_dims
        self.ctx: Context | None = None

    # -- protocol ------------------------------------------------------------------
    def start(self, ctx: Context, incumbent: dict, history: list[Prior]) -> Decision | None:
        self.ctx = ctx
        self._rng = np.random.default_rng(self.seed)
        self._inc, first = _start_decision(ctx, incumbent, history)
        self._history = list(history)
        self._seeded = False
        # Starting from a stored best: the optimum is likely near, small steps.
        warm = bool(history) and first is not None
        self._radius0 = self.radius0 / 2 if warm else self.radius0
        self._pending: list[Evaluation] = []
        # Every window measured under a known policy, and the ones among
        # them that carry allocation counts (a record was written in them).
        self._recent: collections.deque[Window] = collections.deque(maxlen=max(8, self.warmup_windows))
        self._counted: collections.deque[Window] = collections.deque(maxlen=max(8, self.warmup_windows))
        self._work: collections.deque[float] = collections.deque(maxlen=30)   # allocations/s of counted windows
        self._meter = _Meter(self.report_every)    # explore=False only
        self._idle = False
        self._reset_search()
        return first

    def observe(self, w: Window) -> Decision | None:
        if self.ctx is None:
            raise RuntimeError("observe() before start()")
        if w.knobs is None:
            # A transition: evidence for neither policy. A candidate that stays
            # unconfirmed was never applied: the allocator looks at a new
            # policy when a thread allocates (a slow path or a check-in), and
            # this program's threads stopped allocating.
            t = self._trial
            if t is not None and t.n == 0:
                self._stall += 1
                if self._stall >= self.stall_windows:
                    self._trial = None
                    self._stall = 0
                    self._settle()
                    return Decision(self._inc, "rollback",
                                    f"the program did not apply the candidate in {self.stall_windows} windows "
                                    f"(its processes allocate but none took it up): back to the "
                                    f"incumbent, settled", self._take())
            return None
        self._stall = 0
        # Every window is evidence of what its policy costs: a busy one without
        # a record is a policy that served every call from the caches, a quiet
        # one is a program whose memory is the whole cost (caches parked in
        # sleeping threads). Only counted windows say anything about the size
        # mix and the hot classes.
        self._idle = not w.busy
        counted = _active(w)
        if counted:
            self._work.append(float(np.sum(w.allocs)))
            w = self._per_work(w)
        self._recent.append(w)
        if counted:
            self._counted.append(w)
        if not self.ctx.explore:
            _push(self._pending, self._meter.add(w))
            if same(w.knobs, self._inc):
                self._inc_costs.append(float(w.cost))
            return None
        d = self._check_mix() if counted else None
        if d is not None:
            return d
        if self._trial is not None:
            if not same(w.knobs, self._trial.knobs):
                return None
            self._trial.add(w)
            return self._judge()
        if not same(w.knobs, self._inc):
            return None
        self._inc_add(w)
        if self._phase == "warmup":
            if len(self._inc_costs) < self.warmup_windows:
                return None
            self._begin()
            return self._propose()
        if self._phase == "settled":
            if self._inc_run.n >= self.report_every:
                _push(self._pending, [self._inc_run.evaluation("measured")])
                self._inc_run = _Run(self._inc)
                self._close_segment(self._inc_seg)
                self._inc_seg = _Run(self._inc)
            return None
        self._since += 1
        if self._since < self._need:
            return None
        return self._propose()

    def incumbent(self) -> tuple[dict, float | None]:
        if self.ctx is None:
            raise RuntimeError("incumbent() before start()")
        return self._inc, self._inc_mean()

    def _per_work(self, w: Window) -> Window:
        """The window with its time cost per unit of the program's usual work.
        How much a program allocates in one window is its own business (a
        1 s window over a 400 ms cycle holds two cycles or three); what a
        policy decides is the allocator time each allocation costs, so the
        time is scaled to the program's mean allocation rate."""
        ref = float(np.mean(self._work))
        t = float(w.time_cost) * ref / float(np.sum(w.allocs))
        return dataclasses.replace(w, time_cost=t, cost=t + float(w.mem_cost))

    def state(self) -> str:
        if self.ctx is None or self._idle:
            return "idle"
        if not self.ctx.explore:
            return "measuring" if len(self._inc_costs) < self.warmup_windows else "settled"
        if self._phase == "warmup":
            return "measuring"
        return "settled" if self._phase == "settled" else "exploring"

    def flush(self) -> list[Evaluation]:
        if self.ctx is None:
            return []
        out, self._pending = self._pending, []
        if not self.ctx.explore:
            return out + self._meter.flush()
        if self._inc_run.n:
            out.append(self._inc_run.evaluation("measured"))
            self._inc_run = _Run(self._inc)
        # A trial cut short still measured something; its verdict, if it
        # gets one later, covers these windows again.
        if self._trial is not None and self._trial.n:
            out.append(self._trial.evaluation("measured", self._inc, self._inc_mean()))
        return out

    # -- introspection ----------------------------------------------------------------
    @property
    def space(self) -> PolicySpace | None:
        return self._space

    @property
    def radius(self) -> float:
        return self._radius

    # -- state -----------------------------------------------------------------------
    def _reset_search(self) -> None:
        self._phase = "warmup"
        self._space: PolicySpace | None = None
        self._ref_mix: np.ndarray | None = None
        self._mix_over = 0
        self._trial: _Run | None = None
        self._inc_x: np.ndarray | None = None
        self._inc_costs: collections.deque[float] = collections.deque(maxlen=10)
        self._inc_run = _Run(self._inc)       # incumbent windows not reported yet
        self._inc_seg = _Run(self._inc)       # the incumbent's current unbroken stretch, for the noise
        self._segments: collections.deque[tuple[float, int]] = collections.deque(maxlen=12)
        self._X: list[np.ndarray] = []
        self._y: list[float] = []
        # The GP models log(cost / the first incumbent's cost): costs are
        # positive, knobs act on them by factors, and the noise is relative.
        self._scale = 0.0                     # the incumbent's cost in those units
        self._radius = self._radius0
        self._fails_at_min = 0
        self._flat = 0            # inconclusive trials in a row
        self._stall = 0           # windows since the candidate was written, none confirmed
        self._trials = 0
        self._tabu: set[str] = set()
        self._since = 0
        self._need = 1

    def _inc_add(self, w: Window) -> None:
        self._inc_costs.append(float(w.cost))
        self._inc_run.add(w)
        self._inc_seg.add(w)

    def _inc_mean(self) -> float | None:
        return float(np.mean(self._inc_costs)) if self._inc_costs else None

    def _close_segment(self, run: _Run) -> None:
        ss, df = run.rel_ss()
        if df:
            self._segments.append((ss, df))

    def _rel_sd(self) -> float:
        """Window-to-window noise relative to the cost, pooled over recent runs
        with a weak prior (2 degrees of freedom) so three windows cannot claim
        the noise is nil."""
        ss = 2 * self.prior_sd ** 2
        df = 2
        for s, d in [*self._segments, self._inc_seg.rel_ss()]:
            ss, df = ss + s, df + d
        return max(math.sqrt(ss / df), 1e-3)

    def _add_point(self, x: np.ndarray, y: float) -> None:
        self._X.append(np.asarray(x, dtype=float))
        self._y.append(float(y))
        if len(self._X) > self.max_points:
            del self._X[0], self._y[0]

    # -- warm-up done: the space, the reference mix, the priors ------------------------------
    def _begin(self) -> None:
        counted = list(self._counted)[-self.warmup_windows:]
        self._space = PolicySpace(self.ctx, self._inc, counted or list(self._recent)[-self.warmup_windows:],
                                  self.max_hot)
        self._ref_mix = np.mean([w.mix() for w in counted], axis=0) if counted else None
        self._mix_over = 0
        self._inc_x = self._space.from_knobs(self._inc)
        self._add_point(self._inc_x, self._scale)
        if not self._seeded:
            self._seeded = True
            # Stored costs were measured under other loads; only their ratio
            # to the incumbent's own stored cost carries over.
            ref = next((p.cost_mean for p in self._history if same(p.knobs, self._inc)), None)
            ref = ref or self._inc_mean()
            for p in self._history:
                if ref and ref > 0 and p.cost_mean > 0 and not same(p.knobs, self._inc):
                    self._add_point(self._space.from_knobs(self.ctx.clamp(p.knobs)), math.log(p.cost_mean / ref))
        self._phase = "search"

    # -- mix change ------------------------------------------------------------------
    def _check_mix(self) -> Decision | None:
        if len(self._counted) < self.mix_windows:
            return None
        m = np.mean([w.mix() for w in list(self._counted)[-self.mix_windows:]], axis=0)
        if self._ref_mix is None:   # the search began before any window had counts
            self._ref_mix = m
            return None
        dist = float(np.abs(m - self._ref_mix).sum())
        self._mix_over = self._mix_over + 1 if dist > self.mix_threshold else 0
        if self._mix_over < self.mix_windows:
            return None
        evs = []
        if self._trial is not None and self._trial.n:
            evs.append(self._trial.evaluation("measured", self._inc, self._inc_mean()))
        if self._inc_run.n:
            evs.append(self._inc_run.evaluation("measured"))
        hot = PolicySpace.hot_classes(list(self._counted)[-self.mix_windows:], self.max_hot)
        top = ", ".join(f"{self.ctx.class_size[c]}B {m[c] * 100:.0f}%" for c in hot) or "nothing hot"
        self._reset_search()
        _push(self._pending, evs)
        return Decision(self._inc, "relearn",
                        f"relearn: size mix moved {dist:.2f} (L1) for {self.mix_windows} windows; now {top}",
                        self._take())

    def _take(self) -> list[Evaluation]:
        out, self._pending = self._pending, []
        return out

    # -- a trial's verdict -------------------------------------------------------------
    def _judge(self) -> Decision | None:
        t = self._trial
        inc = max(self._inc_mean(), 1e-300)     # a budget objective can price a window at 0
        rel = self._rel_sd()
        n_inc = max(len(self._inc_costs), 1)
        se = rel * inc * math.sqrt(1 / t.n + 1 / n_inc)
        diff = t.mean - inc
        margin = max(2 * se, self.min_margin * inc)
        if t.n < self.trial_windows:
            # Clearly worse after two windows: no third window of a bad policy.
            if not (t.n >= 2 and diff > max(3 * se, 4 * self.min_margin * inc)):
                return None
        elif diff < 0 and -diff <= margin and t.n < self.trial_windows_max:
            # Better, but not yet beyond the noise: a noisy program (phases
            # aliasing with the window) needs more windows, not a verdict.
            return None
        if -diff > margin:
            verdict = "accepted"
        else:
            verdict = "rolled_back" if diff > margin else "rejected"
        ev = t.evaluation(verdict, self._inc, inc)
        self._close_segment(t)
        self._add_point(t.x, self._scale + math.log(max(t.mean, 1e-300) / inc))
        self._trial = None
        self._trials += 1
        self._since = 0
        self._need = self.remeasure_windows if self._trials % self.remeasure_every == 0 else 1
        _push(self._pending, [ev])
        change = f"cost {_pct(diff / inc)} vs incumbent (noise {rel * 100:.1f}%)"
        if verdict == "accepted":
            self._scale += math.log(max(t.mean, 1e-300) / inc)
            self._inc, self._inc_x = t.knobs, t.x
            self._inc_costs = collections.deque(t.cost, maxlen=10)
            self._inc_run, self._inc_seg = _Run(t.knobs), _Run(t.knobs)
            self._radius = min(self._radius * self.grow, self.radius_max)
            self._fails_at_min = 0
            self._flat = 0
            self._tabu.clear()
            return Decision(t.knobs, "accept", f"accept: {change}", self._take())
        self._tabu.add(digest(t.knobs))
        at_min = t.radius <= self.radius_min + 1e-9
        self._fails_at_min = self._fails_at_min + 1 if at_min else 0
        # Clearly worse: look closer. Within the noise: a smaller step would
        # be harder still to tell from noise, so the region keeps its size.
        self._flat = self._flat + 1 if verdict == "rejected" else 0
        if verdict == "rolled_back":
            self._radius = max(self._radius * self.shrink, self.radius_min)
        self._inc_seg = _Run(self._inc)
        word = "roll back" if verdict == "rolled_back" else "reject (within noise), back to incumbent"
        reason = f"{word}: {change}" + ("" if t.n >= self.trial_windows else f" after {t.n} windows")
        if self._fails_at_min >= self.settle_after:
            self._settle()
            reason += f"; settled after {self._fails_at_min} failures at the smallest step"
        elif self._flat >= self.flat_after:
            self._settle()
            reason += f"; settled after {self._flat} trials in a row within the noise"
        return Decision(self._inc, "rollback", reason, self._take())

    def _settle(self) -> None:
        self._phase = "settled"

    # -- the next proposal -----------------------------------------------------------
    def _propose(self) -> Decision | None:
        if self._inc_run.n >= self.remeasure_windows:
            _push(self._pending, [self._inc_run.evaluation("measured")])
            self._inc_run = _Run(self._inc)
        cands = self._candidates()
        while not cands and self._radius > self.radius_min + 1e-9:
            self._radius = max(self._radius * self.shrink, self.radius_min)
            cands = self._candidates()
        if not cands:
            self._settle()
            return None
        c, how = self._choose(cands)
        self._close_segment(self._inc_seg)
        self._inc_seg = _Run(self._inc)
        self._trial = _Run(c.knobs, c.x, self._radius)
        self._phase = "search"
        parts = self._space.describe(c.knobs, self._inc) or ["a nearby policy"]
        if c.why:
            parts[0] += f" ({c.why})"
        return Decision(c.knobs, "explore", f"explore {', '.join(parts)} [{how}]", self._take())

    def _evidence(self) -> dict[tuple[int, int], tuple[float, str]]:
        """What the incumbent's counters say about each coordinate step:
        (dim, +1/-1) -> (score, why). Positive: the counters argue for it."""
        sp = self._space
        ws = [w for w in self._recent if same(w.knobs, self._inc)][-self.warmup_windows:] or list(self._recent)[-1:]
        a, r = _mean_windows(ws, "allocs"), _mean_windows(ws, "refills")
        cached = _mean_windows(ws, "cached_bytes")
        # The share of the allocator's time each class's slow path takes:
        # refills are cheap or dear depending on the batch, this is not.
        slow = _mean_windows(ws, "slow_ns") * 1e-9 / max(float(np.mean([w.time_cost for w in ws])), 1e-12)
        os_churn = _mean_windows(ws, "slabs_from_os") + _mean_windows(ws, "slabs_to_os")
        rss = max(float(np.mean([w.rss_bytes for w in ws])), 1.0)
        cost = max(float(np.mean([w.cost for w in ws])), 1e-300)
        # What parked blocks cost under the objective (nothing under a memory
        # budget not yet reached), as a share of the cost: not their bytes.
        mem_share = self.ctx.objective.mem_cost(rss) / rss * cached / cost
        out: dict[tuple[int, int], tuple[float, str]] = {}
        for i, (kind, c) in enumerate(sp.dims):
            if kind == "cap":
                ratio = r[c] / a[c] if a[c] > 0 else 0.0
                if r[c] > 50 and (ratio > 1e-3 or slow[c] > 0.1):
                    s = 1 + (min(2.0, math.log10(ratio / 1e-3)) if ratio > 1e-3 else min(1.0, slow[c]))
                    out[(i, 1)] = (s, f"refills {_rate(r[c])}/s, {ratio * 100:.2g}% of allocs, "
                                      f"{slow[c] * 100:.0f}% of the time")
                    out[(i, -1)] = (-s, "")
                elif (r[c] < 50 or ratio < 1e-4) and slow[c] < 0.1 and mem_share[c] > 0.02:
                    s = 0.5 + min(1.0, 10 * mem_share[c])
                    out[(i, -1)] = (s, f"{format_size(cached[c])} cached, refills {_rate(r[c])}/s")
            elif kind == "warm":
                if os_churn[c] > 1:
                    s = 1 + min(2.0, math.log10(os_churn[c]))
                    out[(i, 1)] = (s, f"slabs to/from the OS {_rate(os_churn[c])}/s")
                    out[(i, -1)] = (-s, "")
            elif kind == "rest":
                rest = sp.rest_classes()
                ra, rr = a[rest].sum(), r[rest].sum()
                if rr > 50 and ra > 0 and rr / ra > 1e-2:
                    out[(i, 1)] = (1.0, f"other classes refill {_rate(rr)}/s")
                elif rr < 50 and mem_share[rest].sum() > 0.05:
                    out[(i, -1)] = (0.5, f"other classes hold {format_size(cached[rest].sum())}")
        return out

    def _candidates(self) -> list[_Cand]:
        sp, x0, r = self._space, self._inc_x, self._radius
        seen = set(self._tabu) | {digest(self._inc)}
        ev = self._evidence()
        out: list[_Cand] = []

        def add(x: np.ndarray, score: float = 0.0, why: str = "") -> None:
            k = sp.to_knobs(x)
            dg = digest(k)
            if dg in seen:
                return
            seen.add(dg)
            out.append(_Cand(sp.from_knobs(k), k, score, why))

        # Coordinate steps first, in a seeded order so ties do not always
        # favour the first class.
        for i in self._rng.permutation(sp.ndim):
            for sgn in (1, -1):
                x = x0.copy()
                x[i] = np.clip(x0[i] + sgn * r, sp.lo[i], sp.hi[i])
                if abs(x[i] - x0[i]) > 1e-6:
                    add(x, *ev.get((int(i), sgn), (0.0, "")))
        # Steps the counters argue for as a whole: no single cache parks
        # enough memory to show above the noise when a program spreads it over
        # many classes, and every warm pool that churns with the OS wants the
        # same thing.
        for sgn, kinds in ((-1, ("cap", "rest")), (1, ("warm",))):
            idx = [i for i, (kind, _) in enumerate(sp.dims) if kind in kinds and ev.get((i, sgn), (0.0, ""))[0] > 0]
            if len(idx) >= 2:
                x = x0.copy()
                x[idx] = np.clip(x0[idx] + sgn * r, sp.lo[idx], sp.hi[idx])
                whys = [ev[(i, sgn)][1] for i in idx if ev[(i, sgn)][1]]
                add(x, sum(ev[(i, sgn)][0] for i in idx), f"together: {'; '.join(whys)}" if whys else "together")
        # A warm pool sized by what it gives back: a second's worth of the
        # slabs the class returns to the OS, where a step would be too small
        # to see (each slab given back is a page fault or more to take again).
        ws = [w for w in self._recent if same(w.knobs, self._inc)][-self.warmup_windows:]
        to_os = _mean_windows(ws, "slabs_to_os") if ws else None
        for i, (kind, c) in enumerate(sp.dims):
            if kind != "warm" or to_os is None or ev.get((i, 1), (0.0, ""))[0] <= 0:
                continue
            target = self._inc["warm_slabs"][c] + math.ceil(float(to_os[c]))
            xt = min(math.log2((target + 1) / (sp.base_warm[c] + 1)), float(sp.hi[i]))
            if xt > x0[i] + r + 1e-6:
                x = x0.copy()
                x[i] = xt
                add(x, ev[(i, 1)][0] + 1.0, f"{_rate(float(to_os[c]))} slabs/s returned to the OS")
        # Random points in the region, moving a few dimensions at once.
        p = min(1.0, self.random_dims / sp.ndim)
        for _ in range(self.n_random):
            mask = self._rng.random(sp.ndim) < p
            if not mask.any():
                mask[self._rng.integers(sp.ndim)] = True
            x = x0 + mask * self._rng.uniform(-r, r, sp.ndim)
            add(np.clip(x, sp.lo, sp.hi))
        return out

    def _choose(self, cands: list[_Cand]) -> tuple[_Cand, str]:
        # Too few distinct points for a surface: the counters decide.
        distinct = {tuple(np.round(x, 6)) for x in self._X}
        ei = self._expected_improvement(np.array([c.x for c in cands])) if len(distinct) >= 3 else None
        if ei is None:
            coord = [i for i, c in enumerate(cands) if c.evidence > 0] or list(range(len(cands)))
            best = max(coord, key=lambda i: (cands[i].evidence, -i))
            return cands[best], "counters" if cands[best].evidence > 0 else "first step"
        # EI is a share of the incumbent's cost (log units); the counters tip
        # the balance by evidence_weight per unit, a hint the GP can outvote.
        key = ei + self.evidence_weight * np.array([c.evidence for c in cands])
        best = int(np.argmax(key))
        pct = ei[best] * 100     # log units: a share of the cost
        return cands[best], f"EI {pct:.0f}%" if pct >= 10 else f"EI {pct:.2g}%"

    def _expected_improvement(self, Xc: np.ndarray) -> np.ndarray | None:
        from scipy.special import ndtr
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

        sp = self._space
        span = np.where(sp.hi > sp.lo, sp.hi - sp.lo, 1.0)
        X = (np.array(self._X) - sp.lo) / span
        y = np.array(self._y)
        kernel = (ConstantKernel(1.0, (1e-2, 1e2))
                  * Matern(length_scale=np.full(sp.ndim, 0.3), length_scale_bounds=(0.02, 20.0), nu=2.5)
                  + WhiteKernel(1e-2, (1e-6, 1.0)))
        gp = GaussianProcessRegressor(kernel, normalize_y=True, n_restarts_optimizer=1,
                                      random_state=self.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                gp.fit(X, y)
                mu, sd = gp.predict((Xc - sp.lo) / span, return_std=True)
            except (ValueError, np.linalg.LinAlgError):
                return None
        imp = self._scale - mu - 0.001
        sd = np.maximum(sd, 1e-12)
        z = imp / sd
        return imp * ndtr(z) + sd * np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


# ---- the baseline: a cache-miss controller -------------------------------------------
class MissDrivenLearner(_Reports):
    """Doubles a class's capacity while its thread caches miss often; halves
    it once the class has sat idle for a few windows still holding cached
    blocks. Warm pools and the drain interval are left alone, and the cost is
    never looked at: this is the heuristic a learner has to beat."""

    name = "missdriven"

    def __init__(self, *, seed: int = 0, miss_ratio: float = 0.05, miss_rate: float = 50.0,
                 idle_windows: int = 3, min_cap: int = 4, report_every: int = 10):
        self.seed = seed      # deterministic anyway; kept so every learner takes it
        self.miss_ratio, self.miss_rate = miss_ratio, miss_rate
        self.idle_windows, self.min_cap, self.report_every = idle_windows, min_cap, report_every
        self.ctx: Context | None = None

    def start(self, ctx: Context, incumbent: dict, history: list[Prior]) -> Decision | None:
        self.ctx = ctx
        self._knobs, first = _start_decision(ctx, incumbent, history)
        self._idle = np.zeros(L.NUM_CLASSES, dtype=int)
        self._meter = _Meter(self.report_every)
        self._pending: list[Evaluation] = []
        self._quiet = 0
        self._inactive = False
        return first

    def observe(self, w: Window) -> Decision | None:
        if self.ctx is None:
            raise RuntimeError("observe() before start()")
        # Counters from a transition or from the policy before ours would
        # double what was already doubled.
        if w.knobs is None or not same(w.knobs, self._knobs):
            return None
        if not _active(w):
            self._inactive = True
            return None
        self._inactive = False
        _push(self._pending, self._meter.add(w))
        k = canonical(self._knobs)
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
        k["tcache_batch"][c] = batch_for(cap, self.ctx.batch_max)

    def _take(self) -> list[Evaluation]:
        out, self._pending = self._pending, []
        return out

    def incumbent(self) -> tuple[dict, float | None]:
        run = self._meter.run
        return self._knobs, (run.mean if run is not None and run.n and same(run.knobs, self._knobs) else None)

    def state(self) -> str:
        if self.ctx is None or self._inactive:
            return "idle"
        return "exploring" if self._quiet < self.idle_windows else "settled"

    def flush(self) -> list[Evaluation]:
        if self.ctx is None:
            return []
        return self._take() + self._meter.flush()


# ---- measure only -----------------------------------------------------------------
class StaticLearner(_Reports):
    """Keeps the policy it starts with and measures it."""

    name = "static"

    def __init__(self, *, seed: int = 0, report_every: int = 10):
        self.seed, self.report_every = seed, report_every
        self.ctx: Context | None = None

    def start(self, ctx: Context, incumbent: dict, history: list[Prior]) -> Decision | None:
        self.ctx = ctx
        self._knobs, first = _start_decision(ctx, incumbent, history)
        self._meter = _Meter(self.report_every)
        self._pending: list[Evaluation] = []
        self._inactive = False
        if first is not None:
            first.reason = "apply the given policy and keep it"
        return first

    def observe(self, w: Window) -> Decision | None:
        if self.ctx is None:
            raise RuntimeError("observe() before start()")
        if w.knobs is None:
            return None
        self._inactive = not w.busy
        _push(self._pending, self._meter.add(w))
        return None

    def incumbent(self) -> tuple[dict, float | None]:
        run = self._meter.run
        return self._knobs, (run.mean if run is not None and run.n and same(run.knobs, self._knobs) else None)

    def state(self) -> str:
        return "idle" if self.ctx is None or self._inactive else "measuring"

    def flush(self) -> list[Evaluation]:
        if self.ctx is None:
            return []
        out, self._pending = self._pending, []
        return out + self._meter.flush()


LEARNERS: dict[str, type] = {"gp": GPLearner, "missdriven": MissDrivenLearner, "static": StaticLearner}
