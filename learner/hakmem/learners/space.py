"""The search space of the GP learner: a few log2 dimensions standing for
the full knobs (per hot class its capacity and warm pool, one multiplier
for every other class's capacity, the drain interval)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .. import layout as L
from ..knobs import Knobs, default_batch
from ..learning import Context, Window, canonical
from .base import _churn

DRAIN_MIN_MS = 10            # the drain intervals the search tries
DRAIN_MAX_MS = 60000
RETAIN_MAX_MIB = 1024        # the most freed memory kept that the search tries (0 is its least)


def batch_for(cap: int, batch_max: int) -> int:
    """The batch the allocator's default pairs with a capacity (knobs.default_batch)."""
    return default_batch(cap, batch_max)


class PolicySpace:
    """A few log2 dimensions standing for the full knobs (61 classes x 3, drain, retain).

    Per hot class: log2(cap/base_cap) and log2((warm+1)/(base_warm+1)), bases
    being the allocator's defaults, so 0 is the default and 1 doubles it. Then
    one log2 multiplier on the anchor's caps of every other class,
    log2(drain_ms/1000), and log2((retain_mib+1)/(its default+1)). Values a dimension does not move stay exactly the
    anchor's (the incumbent the space was built around), so to_knobs of
    from_knobs(anchor) is the anchor itself, custom batches and all."""

    def __init__(self, ctx: Context, incumbent, windows: Sequence[Window], max_hot: int = 3,
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
        self.base_retain = int(d["retain_mib"])
        self.dims += [("rest", None), ("drain", None), ("retain", None)]
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
            elif k == "retain":
                b = self.base_retain + 1
                lo.append(math.log2(1.0 / b))
                hi.append(math.log2((min(RETAIN_MAX_MIB, max(ctx.retain_mib_max, 0)) + 1) / b))
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
        return {"rest": "cap@rest", "drain": "drain", "retain": "retain"}[kind]

    @property
    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return self.lo.copy(), self.hi.copy()

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def rest_classes(self) -> list[int]:
        return [c for c in range(1, L.NUM_CLASSES) if c not in self.hot]

    def from_knobs(self, knobs) -> np.ndarray:
        k = Knobs.of(knobs)
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
            elif kind == "retain":
                x.append(math.log2((k["retain_mib"] + 1) / (self.base_retain + 1)))
            else:
                # 0 (never) is longer than any interval in the space: its top.
                x.append(math.log2(k["drain_ms"] / 1000) if k["drain_ms"] > 0 else math.inf)
        return np.clip(np.array(x), self.lo, self.hi)

    def to_knobs(self, x: Sequence[float]) -> Knobs:
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
            elif kind == "retain":
                r = round((self.base_retain + 1) * 2.0 ** x[i] - 1)
                k["retain_mib"] = int(min(max(r, 0), ctx.retain_mib_max))
            else:
                top = min(DRAIN_MAX_MS, ctx.drain_ms_max)
                k["drain_ms"] = int(min(max(round(1000 * 2.0 ** x[i]), DRAIN_MIN_MS), top))
        return ctx.clamp(k)

    def _set_cap(self, k: dict, c: int, cap: int) -> None:
        """k: the dict form being built (to_knobs)."""
        if cap != self.anchor["tcache_cap"][c]:
            k["tcache_cap"][c] = cap
            k["tcache_batch"][c] = default_batch(cap, self.ctx.batch_max)

    def describe(self, knobs, before) -> list[str]:
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
            elif kind == "retain" and knobs["retain_mib"] != before["retain_mib"]:
                out.append(f"retain {before['retain_mib']}->{knobs['retain_mib']} MiB")
        return out

