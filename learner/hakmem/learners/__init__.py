"""The learners hakmem-learnd can run, found by name in `LEARNERS`.

    base.py       the Learner interface and what learners share (runs, meters, reports)
    space.py      PolicySpace: the GP's search space
    gp.py         GPLearner and its parameters (GPParams), phases (Phase)
    baselines.py  MissDrivenLearner, StaticLearner

A new learner: a module here, its class registered in LEARNERS below.

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

from ..knobs import default_batch
from .base import MAX_PENDING, Learner, Reporting
from .baselines import MissDrivenLearner, StaticLearner
from .gp import GPLearner, GPParams, Phase
from .space import DRAIN_MAX_MS, DRAIN_MIN_MS, PolicySpace, batch_for

BATCH_DEFAULT_MAX = default_batch(1 << 30)     # the allocator's default batch never exceeds this

LEARNERS: dict[str, type] = {"gp": GPLearner, "missdriven": MissDrivenLearner, "static": StaticLearner}

__all__ = ["BATCH_DEFAULT_MAX", "DRAIN_MAX_MS", "DRAIN_MIN_MS", "GPLearner", "GPParams", "LEARNERS", "Learner",
           "MAX_PENDING", "MissDrivenLearner", "Phase", "PolicySpace", "Reporting", "StaticLearner", "batch_for"]
