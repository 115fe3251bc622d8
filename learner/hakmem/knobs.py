"""The policy's knobs: one immutable type, every name, bound and rule taken
from the layout (schemas/shm_layout.json "knobs", generated into _layout.py).

A `Knobs` is what the allocator runs: per-process knobs (drain_ms,
retain_mib) as ints,
per-class knobs (tcache_cap, tcache_batch, warm_slabs) as tuples of
NUM_CLASSES ints, class 0 (huge objects) always 0. It reads like the dict the
rest of hakmem passes around (k["tcache_cap"][c], also k.tcache_cap), is
immutable and hashable, and converts to and from every form a policy takes:

    the dict form      to_dict() / Knobs(d)    ring writer, SQLite JSON, CLI
    protobuf           to_pb() / from_pb(m)    control socket, .hkpolicy files
    the policy slot    ring.encode_slot / Ring.slot_to_policy (via the dict form)

`Bounds` are a process's published bounds (its ring header: cap_max,
warm_max, batch_max, drain_ms_max, retain_mib_max), with which `clamp` brings any policy
into bounds and `check` names the first value out of them, the allocator's
own rule (options.c: policy_valid): a policy with any value out of bounds is
rejected whole.

A new knob is a layout change (schemas/shm_layout.json), nothing here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from . import _layout
from . import layout as L

SPEC: dict[str, dict] = {k["name"]: k for k in _layout.KNOBS}
NAMES: tuple[str, ...] = tuple(SPEC)                                     # slot order
PER_CLASS: tuple[str, ...] = tuple(n for n in NAMES if SPEC[n]["per_class"])
PER_PROCESS: tuple[str, ...] = tuple(n for n in NAMES if not SPEC[n]["per_class"])
ORDER: tuple[str, ...] = PER_PROCESS + PER_CLASS    # the dict form's (and the store's JSON) key order
VERSION: str = _layout.VERSION
# Knobs a later layout added (since_layout): a policy written before one
# (a store row, an exported file, a fleet row) lacks it and means its
# default, and its default is left out of the digest so that such a policy
# keeps the identity it was stored under.
LATER: dict[str, int] = {n: int(SPEC[n]["default"]) for n in NAMES if SPEC[n].get("since_layout")}


def _rule_of(name: str) -> dict | None:
    """The default rule {"of": KNOB, "div": D, "lo": L, "hi": H} of a knob
    derived from another (tcache_batch: cap/2, at most 256)."""
    d = SPEC[name]["default"]
    return d if isinstance(d, dict) and "of" in d else None


_BATCH = next(n for n in NAMES if _rule_of(n))                 # tcache_batch
_BATCH_RULE = _rule_of(_BATCH)


def default_batch(cap: int, batch_max: int | None = None) -> int:
    """The batch the allocator's default pairs with a capacity: cap/2, at
    least 1, at most 256 and at most batch_max (the layout's rule)."""
    top = _BATCH_RULE["hi"] if batch_max is None else min(_BATCH_RULE["hi"], batch_max)
    return max(_BATCH_RULE["lo"], min(int(cap) // _BATCH_RULE["div"], top))


# The allocator's slab geometry (allocator/src/types.h HK_PAGE_SHIFT and
# HK_SLAB_MAX_PAGES, classes.c _hk_classes_init): a warm pool's bound is a
# number of slabs, so it depends on each class's slab size. test_layout.py
# checks the bounds computed from these against every class's bound a live
# process publishes in its header.
PAGE_BYTES = 1 << 16
SLAB_MAX_PAGES = 16


def slab_bytes(size: int) -> int:
    """The slab size of a class of `size`-byte blocks: the fewest pages
    holding at least 8 blocks up to 64 KiB (4 up to 128 KiB, else 1) with
    at most 1/8 of the slab wasted at its end."""
    size = int(size)
    want = 8 if size <= 65536 else 4 if size <= 131072 else 1
    for k in range(1, SLAB_MAX_PAGES + 1):
        b = k * PAGE_BYTES
        if b // size >= want and (b % size) * 8 <= b:
            return b
    return -(-size // PAGE_BYTES) * PAGE_BYTES


def _max_of(rule, size: int, slab: int) -> int:
    """A knob's "max" rule (schemas/shm_layout.json knobs_about) for one class."""
    if not isinstance(rule, dict):
        return int(rule)
    per = size if rule["per"] == "block" else slab
    return max(int(rule["lo"]), min(int(rule["worth"]) // max(per, 1), int(rule["hi"])))


class KnobsError(ValueError):
    """Knobs of the wrong shape, or a value out of bounds, in one line."""


def _as_int(name: str, v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise KnobsError(f"{name}: {v!r} is not a whole number") from None


class Knobs(Mapping):
    """One policy, immutable. Knobs(mapping) takes any dict-like form with
    every knob (other keys, such as a slot's "version", are ignored)."""

    __slots__ = ("_v", "_hash")

    def __init__(self, values: Mapping | None = None, /, **kw):
        src = dict(values or {}, **kw)
        v: dict[str, int | tuple[int, ...]] = {}
        for name in ORDER:
            if name not in src and name in LATER:
                src[name] = LATER[name]
            if name not in src:
                raise KnobsError(f"knobs: {name} is missing")
            if name in PER_CLASS:
                t = tuple(_as_int(name, x) for x in src[name])
                if len(t) != L.NUM_CLASSES:
                    raise KnobsError(f"{name} has {len(t)} classes, the layout has {L.NUM_CLASSES}")
                v[name] = t
            else:
                v[name] = _as_int(name, src[name])
        object.__setattr__(self, "_v", v)
        object.__setattr__(self, "_hash", None)

    @classmethod
    def of(cls, knobs: Mapping) -> "Knobs":
        """knobs as Knobs (itself when it is one already)."""
        return knobs if isinstance(knobs, Knobs) else cls(knobs)

    # ---- read-only mapping ----------------------------------------------------
    def __getitem__(self, name: str):
        return self._v[name]

    def __iter__(self):
        return iter(ORDER)

    def __len__(self) -> int:
        return len(NAMES)

    def __getattr__(self, name: str):
        try:
            return object.__getattribute__(self, "_v")[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("Knobs are immutable: use replace()")

    def __delattr__(self, name):
        raise AttributeError("Knobs are immutable")

    def __eq__(self, other) -> bool:
        if isinstance(other, Knobs):
            return self._v == other._v
        if isinstance(other, Mapping):
            try:
                return self._v == Knobs(other)._v
            except (KnobsError, TypeError):
                return False
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(tuple(self._v[n] for n in ORDER)))
        return self._hash

    def __repr__(self) -> str:
        return f"Knobs(drain_ms={self._v.get('drain_ms')}, digest={self.digest()[:12]})"

    def __reduce__(self):
        return (Knobs, (self.to_dict(),))

    # ---- new policies from this one ------------------------------------------------
    def replace(self, **changes) -> "Knobs":
        """A copy with some knobs changed: a per-process knob by value, a
        per-class one by a whole sequence or by {class: value}."""
        d = self.to_dict()
        for name, val in changes.items():
            if name not in SPEC:
                raise KnobsError(f"unknown knob {name!r} (knobs: {', '.join(NAMES)})")
            if name in PER_CLASS and isinstance(val, Mapping):
                for c, x in val.items():
                    d[name][int(c)] = x
            else:
                d[name] = val
        return Knobs(d)

    def clamp(self, bounds: "Bounds") -> "Knobs":
        """The nearest policy inside bounds: each value fitted into its
        class's min..max, then under the knob it may not exceed (batch <=
        cap, or 1 when cap is 0), class 0 zero."""
        d = self.to_dict()
        for name in NAMES:
            lo, hi, at_most = bounds.lo[name], bounds.hi[name], SPEC[name].get("at_most")
            if name in PER_PROCESS:
                d[name] = min(max(d[name], lo), hi)
                continue
            d[name][0] = 0
            for c in range(1, L.NUM_CLASSES):
                v = min(max(d[name][c], lo), hi[c])
                if at_most:
                    v = min(v, max(d[at_most][c], lo))
                d[name][c] = v
        return Knobs(d)

    def check(self, bounds: "Bounds", class_size=None) -> None:
        """Raises KnobsError naming the first value out of bounds (the
        allocator rejects such a policy whole)."""
        for name in PER_PROCESS:
            lo, hi = bounds.lo[name], bounds.hi[name]
            if not lo <= self._v[name] <= hi:
                raise KnobsError(f"{name}={self._v[name]} is outside {lo}..{hi}")
        for c in range(1, L.NUM_CLASSES):
            where = f" (class {class_size[c]} B)" if class_size is not None else ""
            for name in PER_CLASS:
                v, lo, hi, at_most = self._v[name][c], bounds.lo[name], bounds.hi[name][c], SPEC[name].get("at_most")
                note = ""
                if at_most:
                    hi, note = min(hi, max(self._v[at_most][c], lo)), " (at most the capacity)"
                if not lo <= v <= hi:
                    raise KnobsError(f"{name}[{c}]={v}{where} is outside {lo}..{hi}{note}")
        for name in PER_CLASS:
            if self._v[name][0] != 0:
                raise KnobsError(f"{name}[0] must be 0 (class 0 is huge objects, which have no knobs)")

    # ---- forms ----------------------------------------------------------------
    def to_dict(self) -> dict:
        """The dict form (plain ints, lists, ORDER): what the ring writer
        takes, the store keeps as JSON, and a caller may change freely."""
        return {n: (list(v) if isinstance(v, tuple) else v) for n, v in self._v.items()}   # _v is in ORDER

    def identity(self) -> dict:
        """The dict form less any later knob (LATER) at its default: what a
        policy was before that knob existed, so the same policy from hosts
        and stores of either age is one value (digest, the fleet's rows)."""
        return {n: v for n, v in self.to_dict().items() if LATER.get(n, -1) != v}

    def digest(self) -> str:
        """sha256 of the canonical JSON of identity(): the store's identity
        of a policy, the one it had before a later knob existed."""
        return hashlib.sha256(json.dumps(self.identity(), separators=(",", ":")).encode()).hexdigest()

    def to_pb(self):
        from ._pb import hakmem_pb2 as pb
        return pb.Knobs(**self.to_dict(), **{f"has_{n}": True for n in LATER})

    @classmethod
    def from_pb(cls, msg) -> "Knobs":
        """A message from before a later knob has no value for it (has_<knob>
        false): the knob's default, as in a stored row."""
        return cls({n: (list(getattr(msg, n)) if n in PER_CLASS else getattr(msg, n)) for n in ORDER
                    if n not in LATER or getattr(msg, f"has_{n}")})


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Per knob, its least value and its greatest (per class for a
    per-class knob), as a process publishes them in its ring header."""
    lo: Mapping[str, int]
    hi: Mapping[str, Any]              # int, or a tuple per class

    @classmethod
    def for_class_sizes(cls, class_size) -> "Bounds":
        """The bounds this hakmem's allocator applies to a program with this
        class table, from each knob's one definition (the layout's "max"
        rules) and the slab geometry: what a policy must fit to be taken up,
        known without a live process (import, pin)."""
        lo, hi = {}, {}
        for name in NAMES:
            lo[name] = int(SPEC[name]["min"])
            rule = SPEC[name]["max"]
            if name in PER_CLASS and not isinstance(rule, dict):      # one bound for every class
                hi[name] = (int(rule),) * L.NUM_CLASSES
            elif name in PER_CLASS:
                hi[name] = (0,) + tuple(_max_of(rule, int(sz), slab_bytes(sz)) if int(sz) > 0 else 0
                                        for sz in list(class_size)[1:])
            else:
                hi[name] = _max_of(rule, 16, PAGE_BYTES)
        return cls(lo=lo, hi=hi)

    @classmethod
    def from_header(cls, header: Mapping) -> "Bounds":
        """From a ring header (or anything with its <bounds>_max fields)."""
        lo, hi = {}, {}
        for name in NAMES:
            lo[name] = int(SPEC[name]["min"])
            top = header[f"{SPEC[name]['bounds']}_max"]
            if name in PER_CLASS:
                hi[name] = (tuple(int(x) for x in top) if not isinstance(top, (int, float))
                            else (int(top),) * L.NUM_CLASSES)
            else:
                hi[name] = int(top)
        return cls(lo=lo, hi=hi)
