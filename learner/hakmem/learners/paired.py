"""A/B trials: a candidate confirmed against the incumbent in alternating blocks.

A trial judged against the incumbent's windows from before it compares two
stretches of time, and a service's load drifts between them (pgbench warming
its buffers, redis filling its keyspace): a candidate measured while the load
rose is refused, one measured while it fell is taken. Alternating blocks of
candidate (C) and incumbent (I) windows make every comparison between
neighbours in time, and the decision rests on the pairs' differences.

THE TEST
  - Blocks run in ABBA order, I C C I I C ... (first="I", the learner's
    screened trials) or C I I C C I ...: a drift linear in time cancels
    over two pairs, and one switch serves two blocks (a switch costs the
    window it happens in, which counts for neither policy). Starting with
    the incumbent's block, the first pair runs with the incumbent still in
    force and one switch, to the candidate; a trial decided there never
    switches back (see the end).
  - A block is `block` windows. Most programs' windows are independent and
    one window is a block; a program whose cost comes in bursts slower than
    a window (a spike every two windows) would make every block's mean a
    matter of which window the burst fell in. `choose_block` picks the block
    from the incumbent's own consecutive windows: the shortest whose means
    vary least per window spent on them.
  - A block's cost (block_cost) prices its allocator time per allocation
    over the whole block, at the program's usual rate: the learner's
    per-window pricing (time per allocation of that window) would, for a
    program whose bursts span two windows, price the page faults of writing
    a burst by the handful of allocations in the window they fall in.
  - A policy's effect on memory lags its switch: what a policy gives back
    goes back at its drain interval, and what it keeps is faulted in again
    as the program reuses it. On bench-learn's phases (drain 1 s, 1-s
    windows) switched between the default and cap=4 every 4 s: under cap=4
    the resident memory fell from 163 to 135 MiB over 2-3 s, the CPU per
    operation up 20-60% from 1 to 2.5 s after the switch, then back to the
    default's; switched back, 2.5 times the CPU per operation 0.5-1 s
    after. With one-window blocks every block was such a transition: the
    candidate's first window had the incumbent's memory, and cap=4, the
    grid's best (-15%), was rolled back in 2 of 3 full runs (+1.6% and
    +10.9% on one pair). So the first `settle` windows of every block that
    follows a switch are run and left out (the learner sets it from the
    drain intervals of both policies and the window's length); a window
    among them whose cost is past 1 + `abort` times the incumbent's last
    block (judged a block of them at a time) ends the trial as a pair would.
  - Each pair gives d = log(C cost / I cost): costs are positive and a
    policy changes them by a factor.
  - After each pair (at most `max_pairs` looks), a one-sided t-test on the
    d's: accept when the mean is below -log(1 + margin) and below zero with
    95% confidence; roll back when above zero with 95% confidence. The 5% is
    split over the six looks at most (Bonferroni), so the chance of taking a
    candidate that is no better is at most 5% over the whole trial, not per
    look. The d's variance pools the pairs' own spread with what the
    incumbent's blocks before the trial say (twice their relative variance),
    degrees of freedom added; it is floored at `sd_floor`: pairs that agree
    by chance claim no certainty. The first pair alone is judged only from
    that prior (at least `MIN_PRIOR_DF` degrees of freedom of it), only in
    an I-first trial (in C-first order its incumbent block is the switch
    back, which leans towards the incumbent), and takes a candidate only
    `FIRST_PAIR_GAIN` cheaper or more (one pair does not cancel a drift).
  - One pair whose candidate costs more than 1 + `abort` times the incumbent
    ends the trial at once: the program does not pay a second block of it.
  - From `futile_after` pairs on, a candidate whose pairs so far make it
    no cheaper at all (mean d >= 0) is rejected there: the remaining looks
    would need it to gain more than its pairs have lost to reach the
    acceptance bound, and each costs the program a pair of switches. In
    bench-learn (full runs at 2b48959) near neighbours of an accepted
    policy ran all six pairs at +5.1%, +3.3% and 0.0% (t +1.5, +2.4, 0.0),
    the last ones through the seconds the run is judged on.
  - No verdict after `max_pairs`: rejected, within the noise.

THE PROGRAM'S OWN CPU
The cost above is the allocator's: its slow paths timed, its page faults and
OS calls at prices calibrated on a quiet page. A policy can cost a program
more than that: on sqlite3 (bench/learn_real.py, 2-minute rounds at 8ae5090)
drain=100 ran 53,000 faults a second where the default ran 3,000, which the
allocator's cost priced at 0.08 of a core and set against 170 MiB given back,
-10.6% in all; the program itself did 11% fewer allocations a second on the
same core (17% less throughput from outside) for the 30 seconds its six pairs
took. A fault taken in the middle of a program's work costs it more than one
taken in a loop that only faults (cache lines zeroed, evicted, refetched).
So each window also brings the program's CPU time (cores, /proc), and each
block is also priced as the objective would price it from outside: the
program's whole CPU per allocation at its usual allocation rate, in place of
the allocator's estimate of its own time, plus the memory's price. Allocations
per unit of the program's work do not depend on the allocator's policy, so
CPU per allocation is CPU per unit of work, saturated or not (on one full
core a slower program makes fewer allocations; under a fixed load it spends
more CPU on them). For sqlite3's drain=100 that is +12% CPU per allocation
and, at lambda 0.5/GiB, +3.4% in all, where the allocator's cost said -10.6%.
  - A trial stops at once (rolled back) when the candidate's measured cost
    is above the incumbent's by more than `cpu_tolerance` (1%) with 95%
    confidence, one-sided, after any pair: the variance pooled, as the
    allocator cost's is, with what the incumbent's own blocks before the
    trial say (`measured_prior`).
  - A candidate the allocator's cost accepts is held back while its measured
    cost is above the incumbent's by more than the tolerance, by more than
    one standard error (`VETO_T`; on the first pair, or without a noise
    estimate, by the pair's own figure): the trial goes on, and with no
    pair left it is rejected.
The measured cost is the noisier (the program's own work varies from block
to block, the allocator's share of it little), so it guards and the
allocator's cost decides. A trade of CPU for memory that the objective's price
of memory pays for passes the guard; one it does not pay for does not.
Without CPU readings (windows that give none, a program that allocates
nothing) the trial is judged on the allocator's cost alone.

What a switch back costs is not the candidate's: the incumbent's block after
a candidate that released memory starts with less resident (its caches refill
within the block), so the test leans towards the incumbent, never away. The
program pays it too: in bench-learn's spikes, the incumbent's first window
after a candidate that kept nothing cost 1.2-1.4x the default's usual window
(the spike faulted in again, then kept). A clear winner decided on the first
pair of an I-first trial costs the program no such window."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .base import _pct

MAX_LOOKS = 6
MIN_PRIOR_DF = 3
# The first pair alone takes a candidate only this much cheaper: one pair
# cannot cancel a drift of the load (ABBA needs two), and a load that moves
# 10% between neighbouring blocks is rarer than one that moves 3%.
FIRST_PAIR_GAIN = 0.10
# One-sided Student t quantiles at 1 - 0.05/6 (six looks: pairs 1..6), by
# degrees of freedom (scipy.stats.t.ppf(1 - 0.05/6, df)); between two
# entries the smaller df's, which is the larger quantile.
_TQ = {1: 38.19, 2: 7.649, 3: 4.857, 4: 3.961, 5: 3.534, 6: 3.287, 7: 3.128, 8: 3.016, 9: 2.933,
       10: 2.870, 12: 2.779, 14: 2.718, 16: 2.673, 18: 2.639, 20: 2.613, 25: 2.566, 30: 2.536,
       40: 2.499, 60: 2.463, 120: 2.428}


# One-sided Student t quantiles at 95% (scipy.stats.t.ppf(0.95, df)): the
# CPU guard's stop, which may only end a trial early, never take a candidate.
_TQ95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833,
         10: 1.812, 12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697, 60: 1.671, 120: 1.658}


# The measured cost holds back a candidate the allocator's cost accepts when
# it is over the tolerance by more than this many standard errors.
VETO_T = 1.0


def t_crit(df: int) -> float:
    """The one-sided critical t for df degrees of freedom at 1 - 0.05/6:
    95% over the trial's six looks at most (Bonferroni)."""
    return _TQ[max(k for k in _TQ if k <= max(df, 1))]


@dataclasses.dataclass(frozen=True)
class Block:
    """A block length and what the incumbent's own windows say of it: the
    variance of its block means relative to their mean, with its degrees
    of freedom (0: nothing measured)."""
    windows: int = 1
    rel_var: float = 0.0
    df: int = 0


def block_cost(ws, ref: float | None = None) -> float:
    """One block's cost from its windows, each (time, mem, allocs) or a
    plain cost. With ref (the program's usual allocations per second) the
    time is priced per allocation over the whole block, at that rate, as the
    learner prices a window's: a burst's allocations and the page faults of
    writing them may fall in neighbouring windows, and per window the second
    would be priced per the handful of allocations beside it."""
    t = [w if isinstance(w, (int, float)) else w[0] for w in ws]
    m = [0.0 if isinstance(w, (int, float)) else w[1] for w in ws]
    a = [0.0 if isinstance(w, (int, float)) else w[2] for w in ws]
    n = max(len(ws), 1)
    time = sum(t) / n
    if ref and sum(a) > 0:
        time = sum(t) / sum(a) * ref
    return max(time + sum(m) / n, 1e-300)


def cpu_per_alloc(ws) -> float | None:
    """A block's program CPU per allocation from its windows (time, mem,
    allocs, cpu); None where they carry no CPU reading or no allocation."""
    ws = [w for w in ws if not isinstance(w, (int, float)) and len(w) > 3]
    cpu, allocs = sum(w[3] for w in ws), sum(w[2] for w in ws)
    return cpu / allocs if cpu > 0 and allocs > 0 else None


def measured_cost(ws, ref: float | None) -> float | None:
    """A block's cost with the program's own CPU in place of the allocator's
    time: CPU per allocation at the usual rate ref, plus the mean memory
    cost (without ref: CPU per allocation alone); None without readings."""
    c = cpu_per_alloc(ws)
    if c is None:
        return None
    if not ref:
        return c
    return c * ref + sum(w[1] for w in ws) / len(ws)


def _blocks(ws: list, k: int) -> list[list]:
    """The newest whole blocks of k consecutive windows, oldest first."""
    n = len(ws) // k
    tail = ws[len(ws) - n * k:]
    return [tail[i * k:(i + 1) * k] for i in range(n)]


def measured_prior(windows, k: int, ref: float | None) -> Block:
    """What the incumbent's own blocks of k windows say of the noise of the
    measured cost: its relative variance between blocks, with degrees of
    freedom (0: fewer than three blocks with readings)."""
    k = max(1, int(k))
    v = np.asarray([x for x in (measured_cost(b, ref) for b in _blocks(list(windows), k)) if x is not None])
    if len(v) < 3:
        return Block(k)
    return Block(k, float(np.var(np.log(v), ddof=1)), len(v) - 1)


def choose_block(windows, ref: float | None = None, choices=(1, 2, 3), gain=0.1, min_blocks=4) -> Block:
    """The block length (windows) whose costs vary least per window spent,
    from consecutive windows of one policy (block_cost's forms). A block of
    k windows costs k + 1/2 windows (a switch every other block, ABBA). A
    longer block is taken only when it beats the shortest tenfold (a spike
    every other window does it a hundredfold; independent windows'
    estimates from a few blocks stray by less than that but by more than
    twofold), from `min_blocks` of it."""
    ws = list(windows)
    best, best_score = Block(), None
    for k in choices:
        blocks = _blocks(ws, k)
        if len(blocks) < min_blocks:
            break
        costs = np.asarray([block_cost(b, ref) for b in blocks])
        v = float(np.var(costs, ddof=1)) / float(np.mean(costs)) ** 2
        score = (k + 0.5) * v
        if best_score is None or score < gain * best_score:
            best, best_score = Block(k, v, len(blocks) - 1), score
    return best


def _logs(pairs) -> np.ndarray:
    return np.asarray([math.log(c / i) for c, i in pairs])


def pooled_se(d: np.ndarray, prior_var: float, prior_df: int, floor: float) -> tuple[float, int]:
    """The standard error of the mean of d (logs of pairs' ratios) and its
    degrees of freedom: the pairs' own spread pooled with what the
    incumbent's blocks said before the trial (their degrees of freedom
    added: two pairs alone say little of the noise), floored at `floor`:
    pairs that agree by chance claim no certainty. df 0: nothing to go on."""
    n = len(d)
    df = n - 1 + prior_df
    if n == 0 or df < 1:
        return math.inf, max(df, 0)
    own = (n - 1) * float(d.var(ddof=1)) if n > 1 else 0.0
    var = (own + prior_df * prior_var) / df
    return max(math.sqrt(var), floor) / math.sqrt(n), df


class Paired:
    """One A/B trial. want() is the policy for the current block; add(window)
    takes one window measured under it and says what follows: None (more of
    this block), "switch" (the next block runs the other policy), "same" (the
    next block runs the same one) or a verdict: "accepted", "rolled_back",
    "rejected"."""

    def __init__(self, cand, inc, block: Block | int = 1, *, ref: float | None = None, max_pairs: int = 6,
                 margin: float = 0.005, abort: float = 0.5, sd_floor: float = 0.01, first: str = "C",
                 futile_after: int | None = 2, measured_prior: Block | None = None,
                 cpu_tolerance: float = 0.01, settle: int = 0):
        self.cand, self.inc, self.ref = cand, inc, ref
        if first not in ("C", "I"):
            raise ValueError(f"first: 'C' or 'I', not {first!r}")
        self.first = first
        b = block if isinstance(block, Block) else Block(int(block))
        self.block = max(1, b.windows)
        # The pairs' noise before any pair: two block means' difference,
        # each as noisy as the incumbent's own blocks were.
        self.prior_var, self.prior_df = 2 * b.rel_var, b.df
        self.max_pairs = min(max(2, int(max_pairs)), MAX_LOOKS)
        self.margin, self.abort, self.sd_floor = margin, abort, sd_floor
        self.futile_after = futile_after
        self.pairs: list[tuple[float, float]] = []     # (C cost, I cost), block_cost of each side
        # Of the same blocks where both have CPU readings: (C, I) program CPU
        # per allocation, and (C, I) measured cost (measured_cost)
        self.cpu_pairs: list[tuple[float, float]] = []
        self.measured_pairs: list[tuple[float, float]] = []
        mp = measured_prior or Block()
        self.m_prior_var, self.m_prior_df = mp.rel_var, mp.df
        self.cpu_tolerance = cpu_tolerance
        self.m_t: float | None = None
        self.why = ""               # what decided, when the program's CPU did
        self._cur: dict[str, list] = {"C": [], "I": []}
        self._blocks = 0            # blocks finished
        self._n = 0                 # windows in the current block
        self.t = 0.0
        self.settle = max(0, int(settle))
        # A C-first trial's first block follows the switch to the candidate.
        self._skip = self.settle if first == "C" else 0
        self.settled = 0            # windows run and left out, after switches
        self._last_i: float | None = None   # the incumbent's last block's cost
        self.cut_short: tuple[float, float] | None = None   # (C, I) costs where settle windows ended it
        self._settling: list = []   # settle windows not yet a whole block

    def _side(self, b: int) -> str:
        # ABBA: C I | I C | C I ... (or I C | C I | I C ... from first="I")
        other = "I" if self.first == "C" else "C"
        return self.first if (b % 4) in (0, 3) else other

    @property
    def side(self) -> str:
        return self._side(self._blocks)

    @property
    def settling(self) -> bool:
        """The next window is one left out after a switch."""
        return self._skip > 0

    def want(self):
        return self.cand if self.side == "C" else self.inc

    @property
    def diffs(self) -> list[float]:
        return list(_logs(self.pairs))

    @property
    def relative(self) -> float:
        """The candidate's cost relative to the incumbent's, from the pairs."""
        d = self.diffs
        if not d and self.cut_short:
            return self.cut_short[0] / self.cut_short[1] - 1
        return math.expm1(float(np.mean(d))) if d else 0.0

    def add(self, window) -> str | None:
        """window: (time, mem, allocs) of one window, or its cost."""
        if self._skip:
            self._skip -= 1
            self.settled += 1
            # Judged a block at a time, as the pairs are: one window of a
            # program that bursts every other window is not a block's cost.
            self._settling.append(window)
            whole = len(self._settling) == self.block
            c = block_cost(self._settling, self.ref) if whole and self.side == "C" and self._last_i is not None else None
            if whole or not self._skip:
                self._settling = []
            if c is not None and c > (1 + self.abort) * self._last_i:
                self.cut_short = (c, self._last_i)
                self.why = f"its first block after the switch cost {_pct(c / self._last_i - 1)} vs the incumbent's last"
                return "rolled_back"
            return None
        self._cur[self.side].append(window)
        self._n += 1
        if self._n < self.block:
            return None
        self._n = 0
        was = self.side
        if was == "I":
            self._last_i = block_cost(self._cur["I"], self.ref)
        self._blocks += 1
        if self._blocks % 2 == 0:
            c, i = block_cost(self._cur["C"], self.ref), block_cost(self._cur["I"], self.ref)
            cc, ci = cpu_per_alloc(self._cur["C"]), cpu_per_alloc(self._cur["I"])
            if cc is not None and ci is not None:
                self.cpu_pairs.append((cc, ci))
                self.measured_pairs.append((measured_cost(self._cur["C"], self.ref),
                                            measured_cost(self._cur["I"], self.ref)))
            self._cur = {"C": [], "I": []}
            self.pairs.append((c, i))
            v = self._measured_stop() or self._verdict()
            if v:
                return v
        if self.side == was:
            return "same"
        self._skip = self.settle
        return "switch"

    def _verdict(self) -> str | None:
        d = np.asarray(self.diffs)
        n = len(d)
        if n == 1:
            if d[0] > math.log1p(self.abort):
                return "rolled_back"
            if self.first != "I" or self.prior_df < MIN_PRIOR_DF:
                return None
        m = float(d.mean())
        se, df = pooled_se(d, self.prior_var, self.prior_df, self.sd_floor)
        self.t = m / se
        crit = t_crit(df)
        if n == 1 and m > -math.log1p(FIRST_PAIR_GAIN):
            return "rolled_back" if self.t > crit else None
        if self.t < -crit and m < -math.log1p(self.margin):
            if not self._measured_allows():
                return "rejected" if n >= self.max_pairs else None
            return "accepted"
        if self.t > crit:
            return "rolled_back"
        if n >= self.max_pairs or (self.futile_after is not None and n >= self.futile_after and m >= 0):
            return "rejected"
        return None

    @staticmethod
    def _rel(pairs) -> float | None:
        return math.expm1(float(np.mean(_logs(pairs)))) if pairs else None

    @property
    def cpu_relative(self) -> float | None:
        """The candidate's program CPU per allocation relative to the
        incumbent's, from the pairs with readings; None without any."""
        return self._rel(self.cpu_pairs)

    @property
    def measured_relative(self) -> float | None:
        """The candidate's measured cost relative to the incumbent's."""
        return self._rel(self.measured_pairs)

    def _measured(self) -> str:
        return (f"the program's own CPU per allocation {_pct(self.cpu_relative)}, "
                f"its cost so measured {_pct(self.measured_relative)} vs incumbent")

    def _measured_stop(self) -> str | None:
        """Rolled back when the measured cost is above the incumbent's by
        more than the tolerance, with 95% confidence."""
        d = _logs(self.measured_pairs)
        se, df = pooled_se(d, self.m_prior_var, self.m_prior_df, self.sd_floor)
        self.m_t = None
        if df < 1 or not len(d):
            return None
        over = float(d.mean()) - math.log1p(self.cpu_tolerance)
        self.m_t = over / se
        if over > 0 and self.m_t > _TQ95[max(k for k in _TQ95 if k <= df)]:
            self.why = f"{self._measured()} (more than {self.cpu_tolerance:.0%} beyond its noise, t {self.m_t:+.1f})"
            return "rolled_back"
        return None

    def _measured_allows(self) -> bool:
        r = self.measured_relative
        # Over the tolerance by more than one standard error (where the
        # noise is known): a program whose CPU readings are coarse (a few
        # clock ticks a window) leaves the decision to the allocator's cost.
        # A clear winner on the first pair must be clear here too.
        lenient = self.m_t is not None and self.m_t <= VETO_T and len(self.measured_pairs) > 1
        if r is None or r <= self.cpu_tolerance or lenient:
            self.why = ""
            return True
        self.why = f"{self._measured()}, above the {self.cpu_tolerance:.0%} allowed"
        return False

    def describe(self) -> str:
        n = len(self.pairs)
        s = (f"cost {_pct(self.relative)} vs incumbent over {n} A/B pair{'s' if n != 1 else ''} "
             f"of {self.block} window{'s' if self.block != 1 else ''}"
             f"{f', {self.settled} after switches left out' if self.settled else ''} (t {self.t:+.1f})")
        if self.why:
            return f"{s}; {self.why}"
        return s if not self.measured_pairs else f"{s}; {self._measured()}"

