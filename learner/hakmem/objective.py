"""The objective hakmem-learnd minimises (the /proc readings it needs: procfs.py).

Units. Time is allocator overhead in core-seconds per second of wall time
(0.02 = two hundredths of a core spent in the allocator's slow paths, page
faults and OS calls). Memory is resident bytes. The operator either prices
memory, lambda core-seconds per second per GiB resident ("a GiB is worth an
eighth of a core", the default, about what clouds charge), or gives a budget
in bytes: then the cost is the time alone while resident memory stays under
the budget, and grows steeply past it.

    cost = time + lambda * rss / GiB                      (priced)
    cost = time + OVER_BUDGET * max(0, rss / budget - 1)  (budget)

The same formula scores the proof's external measurement (bench/learn.py),
with time taken from the workload's own throughput instead.
"""
from __future__ import annotations

import dataclasses
import mmap
import re
import time

from . import procfs
from .procfs import PAGE

GIB = float(1 << 30)
DEFAULT_LAMBDA = 0.125
OVER_BUDGET = 10.0          # cores per 100% over budget: past the budget, memory dominates

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.I)


class ObjectiveError(ValueError):
    """An objective or size that cannot be read, with the reason in one line."""


def parse_size(text) -> int:
    """Bytes from '512MiB', '2G', '1.5 GiB', '4096' (powers of 1024)."""
    if isinstance(text, (int, float)):
        return int(text)
    m = _SIZE.match(str(text))
    if not m:
        raise ObjectiveError(f"{text!r} is not a size (examples: 4096, 512MiB, 2GiB)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def format_size(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= k:
            return f"{n / k:.4g} {unit}"
    return f"{n:.0f} B"


@dataclasses.dataclass(frozen=True)
class Objective:
    """time + lam * GiB, or time under budget_bytes (when set, lam is ignored)."""
    lam: float = DEFAULT_LAMBDA
    budget_bytes: int | None = None

    def __post_init__(self):
        if not (self.lam >= 0):
            raise ObjectiveError(f"lambda must be >= 0, got {self.lam}")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ObjectiveError(f"a memory budget must be positive, got {self.budget_bytes}")

    def mem_cost(self, rss_bytes: float) -> float:
        if self.budget_bytes:
            return OVER_BUDGET * max(0.0, rss_bytes / self.budget_bytes - 1.0)
        return self.lam * rss_bytes / GIB

    def cost(self, time_cost: float, rss_bytes: float) -> float:
        return time_cost + self.mem_cost(rss_bytes)

    def describe(self) -> str:
        if self.budget_bytes:
            return f"time under {format_size(self.budget_bytes)}"
        return f"time + {self.lam:g}/GiB"

    @classmethod
    def parse(cls, text: str) -> "Objective":
        """'lambda=0.125' (or a bare number), 'budget=512MiB'."""
        t = str(text).strip()
        key, _, val = t.partition("=")
        if not _:
            key, val = "lambda", t
        key = key.strip().lower()
        try:
            if key in ("lambda", "lam", "price"):
                return cls(lam=float(val))
            if key == "budget":
                return cls(budget_bytes=parse_size(val))
        except ValueError as e:
            raise ObjectiveError(f"objective {text!r}: {e}") from None
        raise ObjectiveError(f"objective {text!r}: expected lambda=N or budget=SIZE")


# ---- a program's default: its cgroup's memory limit ------------------------
def default_objective(pid: int, fallback: Objective, budget_share: float = 0.8) -> Objective:
    """A program in a cgroup with a memory limit is tuned for time under a
    share of that limit; any other for the fallback."""
    limit = procfs.cgroup_memory_limit(pid)
    if limit:
        return Objective(budget_bytes=int(limit * budget_share))
    return fallback


# ---- what a page fault and an OS call cost on this machine -------------------
@dataclasses.dataclass(frozen=True)
class Prices:
    fault_s: float = 0.7e-6      # one minor fault on fresh anonymous memory, zeroing included
    syscall_s: float = 2.0e-6    # one mmap/munmap/madvise
    # One resident page given back (madvise, munmap) by the program's own
    # thread, beyond the call's own price: freeing it and flushing its
    # mapping. A 64 MiB burst given back as its slabs empty (warm=0) is
    # 16,384 of them on the thread that frees; priced by the call alone,
    # that cost nothing more than giving the same pages back from the decay
    # thread (drain=100), and the replay ranked the two alike where the
    # program ran 18% dearer under the first (bench-learn spikes' grid).
    zap_s: float = 0.1e-6

    @classmethod
    def calibrate(cls, mib: int = 16) -> "Prices":
        """Measures the three on this machine (about 30 ms): touches fresh
        pages, gives some back with madvise page by page, then the rest in
        one call."""
        n = (mib << 20) // PAGE
        best_f = best_s = best_z = float("inf")
        for _ in range(3):
            m = mmap.mmap(-1, n * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                t0 = time.perf_counter()
                for i in range(0, n * PAGE, PAGE):
                    m[i] = 1
                t1 = time.perf_counter()
                k = min(n, 512)
                for i in range(k):
                    m.madvise(mmap.MADV_DONTNEED, i * PAGE, PAGE)
                t2 = time.perf_counter()
                m.madvise(mmap.MADV_DONTNEED, k * PAGE, (n - k) * PAGE)
                t3 = time.perf_counter()
            finally:
                m.close()
            best_f = min(best_f, (t1 - t0) / n)
            best_s = min(best_s, (t2 - t1) / k)
            best_z = min(best_z, (t3 - t2) / max(1, n - k))
        # The Python loop's own cost per page (~50 ns) stays in: a small overestimate.
        return cls(fault_s=best_f, syscall_s=best_s, zap_s=best_z)


def time_cost(slow_ns_per_s: float, minflt_per_s: float, os_calls_per_s: float, prices: Prices,
              returned_pages_per_s: float = 0.0) -> float:
    """Allocator overhead in core-seconds per second: os_calls are the
    program's threads' (the decay thread's left out: the program waits on
    none of them), returned_pages the pages those threads gave back."""
    return (slow_ns_per_s * 1e-9 + minflt_per_s * prices.fault_s + os_calls_per_s * prices.syscall_s
            + returned_pages_per_s * prices.zap_s)


def window_time_cost(w, prices: Prices) -> float:
    """A window's allocator overhead in core-seconds per second. Its kernel
    side comes from hakmem-bpf when that measured every process of the window
    (w.kernel_source == "bpf": the time measured handling its faults, or
    where that cannot be measured their count priced as above, and the time
    measured inside mmap/munmap/madvise/mremap/brk, calls made by anything
    in the process included); otherwise it is the /proc estimate:
    minflt from /proc/<pid>/stat and the allocator's own OS calls at the
    calibrated prices, less the decay thread's calls, plus the pages the
    program's threads gave back."""
    slow = float(w.slow_ns.sum())
    if getattr(w, "kernel_source", "proc") == "bpf":
        # Faults: their measured time where the kernel has kprobes (k_fault_ns),
        # else the count at the calibrated price.
        faults = w.k_fault_ns * 1e-9 if w.k_fault_ns > 0 else w.k_faults * prices.fault_s
        return slow * 1e-9 + faults + w.k_os_ns * 1e-9
    return time_cost(slow, w.minflt, max(0.0, w.os_calls - w.decay_syscalls), prices, w.returned_bytes / PAGE)
