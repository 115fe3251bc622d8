"""A/B trials (learners/paired.py): the block length, the test's error rates,
and the GP learner confirming screened candidates under a drifting load,
where a comparison with the incumbent's earlier windows is fooled."""
import math
import re

import numpy as np

from hakmem.learners import GPLearner
from hakmem.learners.paired import Block, Paired, choose_block, measured_prior
from hakmem.learning import same
from hakmem.screen import Ranked
from test_learners import Sim, drive, make_ctx, with_hot

VERDICTS = ("accepted", "rolled_back", "rejected")


def run(p: Paired, cost_of, rng=None, limit=200):
    """Feeds p windows until its verdict; cost_of(side, window index)."""
    for i in range(limit):
        v = p.add(cost_of(p.side, i))
        if v in VERDICTS:
            return v, i + 1
    raise AssertionError("no verdict")


def test_block_is_one_window_for_independent_windows_and_spans_a_slow_burst():
    rng = np.random.default_rng(0)
    wrong = sum(choose_block(1.0 + 0.05 * rng.standard_normal(10)).windows != 1 for _ in range(1000))
    assert wrong <= 20, wrong
    b = choose_block(1.0 + 0.05 * rng.standard_normal(10))
    assert b.df == 9 and 0.0005 < b.rel_var < 0.006
    # A spike every other window (bench-learn's spikes under 1 s windows):
    # any two neighbours hold one spike between them.
    spiky = [3.0 if i % 2 else 0.4 for i in range(10)] * (1 + 0.02 * rng.standard_normal(10))
    b = choose_block(spiky)
    assert b.windows == 2 and b.df == 4 and b.rel_var < 0.01
    assert choose_block([1.0, 2.0]).df == 0, "too few windows to say"


def test_a_candidate_no_better_is_taken_in_at_most_5_percent_of_trials():
    rng = np.random.default_rng(1)
    taken = 0
    n = 3000
    for _ in range(n):
        # The block and its noise from ten windows of the incumbent before.
        p = Paired("C", "I", choose_block(np.exp(0.10 * rng.standard_normal(10))))
        v, _ = run(p, lambda side, i: math.exp(0.10 * rng.standard_normal()))
        taken += v == "accepted"
    assert taken / n <= 0.05, taken / n


def test_ABBA_cancels_a_drift_that_fools_a_stale_baseline():
    # The load falls 3% a window; the candidate is 2% dearer. Against the
    # incumbent's windows from before the trial it looks 5-10% cheaper.
    rng = np.random.default_rng(2)
    taken = 0
    for _ in range(500):
        p = Paired("C", "I", 1)
        v, _ = run(p, lambda side, i: (1.02 if side == "C" else 1.0) * 0.97 ** i
                   * math.exp(0.01 * rng.standard_normal()))
        taken += v == "accepted"
    assert taken == 0


def test_a_better_candidate_is_confirmed_within_three_pairs_and_a_bad_one_ends_after_one():
    rng = np.random.default_rng(3)
    p = Paired("C", "I", choose_block(np.exp(0.02 * rng.standard_normal(10))))
    v, n = run(p, lambda side, i: (0.9 if side == "C" else 1.0) * math.exp(0.02 * rng.standard_normal()))
    assert v == "accepted" and len(p.pairs) <= 3 and -0.12 < p.relative < -0.08, (v, p.pairs)
    p = Paired("C", "I", 2)
    v, n = run(p, lambda side, i: 2.0 if side == "C" else 1.0)
    assert v == "rolled_back" and len(p.pairs) == 1 and n == 4
    assert "over 1 A/B pair of 2 windows" in p.describe()


def test_a_candidate_that_is_no_cheaper_after_two_pairs_ends_there_and_a_better_one_is_still_found():
    """The futility stop: a near neighbour no better than the incumbent used
    to run all six pairs (bench-learn's phases: through the seconds judged);
    it now ends, mostly after two. A candidate 6% cheaper under 3% noise is
    confirmed about as often as without the stop."""
    rng = np.random.default_rng(11)
    n = 400

    def trials(gain, futile_after):
        taken, pairs = 0, []
        for _ in range(n):
            prior = choose_block(np.exp(0.03 * rng.standard_normal(10)))
            p = Paired("C", "I", prior, first="I", futile_after=futile_after)
            v, _ = run(p, lambda side, i: (1 - gain if side == "C" else 1.0) * math.exp(0.03 * rng.standard_normal()))
            taken += v == "accepted"
            pairs.append(len(p.pairs))
        return taken / n, float(np.mean(pairs))
    _, without = trials(0.0, None)
    taken, pairs = trials(0.0, 2)
    assert without > 5.5 and pairs < 4.0 and taken <= 0.05, (without, pairs, taken)
    found_without, _ = trials(0.06, None)
    found, _ = trials(0.06, 2)
    assert found_without > 0.8 and found > found_without - 0.05, (found_without, found)


def test_blocks_run_ABBA():
    p = Paired("C", "I", 1, max_pairs=6)
    sides, steps = [], []
    for _ in range(6):
        sides.append(p.side)
        steps.append(p.add(1.0 + 0.3 * (len(sides) % 3)))
    assert sides == ["C", "I", "I", "C", "C", "I"]
    assert steps[:3] == ["switch", "same", "switch"]


def test_an_incumbent_first_trial_runs_IC_CI():
    p = Paired("C", "I", 1, max_pairs=6, first="I")
    sides = []
    for _ in range(6):
        sides.append(p.side)
        p.add(1.0 + 0.3 * (len(sides) % 3))
    assert sides == ["I", "C", "C", "I", "I", "C"]


def test_a_clear_winner_is_taken_on_the_first_pair_with_no_switch_back():
    """Incumbent first, with the incumbent's own blocks as the noise: a
    candidate 30% cheaper is taken after one block of each, so the program
    never goes back to the incumbent after the candidate (bench-learn's
    spikes paid 1.2-1.4x for that window). In C-first order, or with no
    noise measured before, the first pair decides nothing."""
    rng = np.random.default_rng(4)
    for _ in range(200):
        prior = choose_block(np.exp(0.03 * rng.standard_normal(10)))
        p = Paired("C", "I", prior, first="I")
        sides = []

        def cost(side, i):
            sides.append(side)
            return (0.7 if side == "C" else 1.0) * math.exp(0.03 * rng.standard_normal())
        v, n = run(p, cost)
        k = p.block
        assert v == "accepted" and len(p.pairs) == 1 and sides == ["I"] * k + ["C"] * k, (v, p.pairs, sides)
    p = Paired("C", "I", choose_block(np.exp(0.03 * rng.standard_normal(10))))
    v, n = run(p, lambda side, i: 0.7 if side == "C" else 1.0)
    assert v == "accepted" and len(p.pairs) == 2, "C-first: decided from the second pair"
    p = Paired("C", "I", 1, first="I")
    v, n = run(p, lambda side, i: 0.7 if side == "C" else 1.0)
    assert v == "accepted" and len(p.pairs) == 2, "no prior noise: decided from the second pair"


def test_an_incumbent_first_trial_takes_a_candidate_no_better_in_at_most_5_percent_of_trials():
    rng = np.random.default_rng(5)
    taken = 0
    n = 3000
    for _ in range(n):
        p = Paired("C", "I", choose_block(np.exp(0.10 * rng.standard_normal(10))), first="I")
        v, _ = run(p, lambda side, i: math.exp(0.10 * rng.standard_normal()))
        taken += v == "accepted"
    assert taken / n <= 0.05, taken / n


def test_the_first_pair_alone_is_not_fooled_by_a_drifting_load():
    """The load falls 5% a window and the candidate is 2% dearer: its
    first block, after the incumbent's, looks 3% cheaper, beyond the noise
    the incumbent's quiet windows show. One pair cannot cancel the drift,
    so it takes only a candidate 10% cheaper or more; ABBA then refuses it."""
    rng = np.random.default_rng(6)
    taken = 0
    for _ in range(500):
        p = Paired("C", "I", choose_block(np.exp(0.003 * rng.standard_normal(10))), first="I")
        v, _ = run(p, lambda side, i: (1.02 if side == "C" else 1.0) * 0.95 ** i
                   * math.exp(0.003 * rng.standard_normal()))
        taken += v == "accepted"
    assert taken == 0


def under_drift(ctx, sim, rate, cand, replay_cost=0.8):
    """The GP learner on the simulated program under a load that scales
    every window's cost by rate per window (the learner sees the cost, not
    the load); at the seventh window the replay ranks cand first."""
    level = [1.0]
    sim.penalty = lambda k: level[0]
    lrn = GPLearner(seed=0)

    def step(i):
        level[0] = rate ** i
        if i == 0:
            lrn.screening()
        if i == 6:
            lrn.screened([Ranked("cand", cand, replay_cost, 0.01, 0, 0),
                          Ranked("default", ctx.clamp(ctx.default), 1.0, 0.01, 0, 0)])
    return drive(lrn, sim, ctx, 40, before_window=step)


def test_gp_refuses_a_dearer_candidate_that_a_falling_load_makes_look_cheaper():
    ctx = make_ctx()
    sim = Sim(ctx, noise=0.01)
    dear = ctx.clamp(with_hot(ctx.default, 512, 64))
    assert sim.truth(dear)["cost"] > 1.01 * sim.truth(ctx.default)["cost"]
    # The replay is wrong: it ranks the dearer policy 20% cheaper.
    decisions, in_force, incumbents = under_drift(ctx, sim, 0.97, dear)
    assert all(same(k, ctx.default) for k in incumbents), decisions
    verdicts = [d for _, d in decisions if d.kind not in ("ab", "explore")]
    assert verdicts and verdicts[0].kind == "rollback" and "A/B pair" in verdicts[0].reason, decisions


def test_gp_confirms_a_cheaper_candidate_while_a_rising_load_makes_it_look_dearer():
    ctx = make_ctx()
    sim = Sim(ctx, noise=0.01)
    good = ctx.clamp(with_hot(ctx.default, 512, 1024))
    assert sim.truth(good)["cost"] < 0.95 * sim.truth(ctx.default)["cost"]
    decisions, in_force, incumbents = under_drift(ctx, sim, 1.04, good)
    assert same(incumbents[-1], good), decisions
    acc = next(d for _, d in decisions if d.kind == "accept")
    assert "A/B pair" in acc.reason and acc.evaluations[-1].verdict == "accepted"


def test_gp_ends_an_ab_trial_whose_next_block_is_never_taken_up():
    """The program stops allocating while the candidate is in force: the
    switch back never applies, and the trial must not leave the candidate
    in force, unjudged, for ever."""
    ctx = make_ctx()
    sim = Sim(ctx, noise=0.01)
    good = ctx.clamp(with_hot(ctx.default, 512, 1024))
    lrn = GPLearner(seed=0)
    lrn.start(ctx, ctx.default, [])
    lrn.screening()
    lrn.screened([Ranked("good", good, 0.8, 0.01, 0, 0), Ranked("default", ctx.clamp(ctx.default), 1.0, 0.01, 0, 0)])
    in_force, reported, i = ctx.default, ctx.default, 0
    decisions = []
    for i in range(60):
        d = lrn.observe(sim.window(i, in_force, reported))
        if d is None:
            continue
        decisions.append(d)
        if d.kind == "explore" or (d.kind == "ab" and same(d.knobs, good)):
            in_force = reported = d.knobs       # taken up: the incumbent's block, then the candidate's
        # An "ab" switch back is written but never taken up.
        if d.kind == "rollback":
            break
    kinds = [d.kind for d in decisions]
    assert kinds[:3] == ["explore", "ab", "ab"] and kinds[-1] == "rollback", decisions
    assert same(decisions[1].knobs, good) and same(decisions[2].knobs, ctx.default)
    assert same(decisions[-1].knobs, ctx.default) and "did not take up" in decisions[-1].reason
    assert lrn.state() == "settled" and same(lrn.incumbent()[0], ctx.default)


def lagging(rng, gain=0.85, lag=(1.05, 1.0), back=(1.3,), noise=0.02):
    """Costs of a program whose policy's effect lags its switch (phases
    switched between the default and cap=4, 1-s windows): the candidate's
    first windows still hold the incumbent's memory and pay its refaults
    (lag), then it costs `gain`; back under the incumbent, the first windows
    fault the memory in again (back). cost(side, i) for run(), which tells
    the switches from the sides."""
    state = {"side": None, "since": 0}

    def cost(side, i):
        state["since"] = state["since"] + 1 if side == state["side"] else 0
        state["side"] = side
        k = state["since"]
        if side == "C":
            c = lag[k] if k < len(lag) else gain
        else:
            c = back[k] if state["seen_c"] and k < len(back) else 1.0
        state["seen_c"] = state.get("seen_c") or side == "C"
        return c * math.exp(noise * rng.standard_normal())
    state["seen_c"] = False
    return cost


def test_windows_after_a_switch_are_left_out_so_a_policy_is_judged_on_its_settled_effect():
    """A candidate 15% cheaper once settled, whose first two windows after
    the switch cost the incumbent's and more, and whose switch back costs
    the incumbent 30% for a window: judged on every window it is taken in
    fewer than a third of trials (bench-learn's phases lost cap=4 so, in 2
    full runs of 3); with the two
    windows after each switch left out it is taken, and those windows count
    for neither side."""
    rng = np.random.default_rng(11)
    plain = settled = 0
    for _ in range(200):
        prior = choose_block(np.exp(0.02 * rng.standard_normal(10)))
        v, _ = run(Paired("C", "I", prior, first="I"), lagging(rng))
        plain += v == "accepted"
        p = Paired("C", "I", prior, first="I", settle=2)
        v, n = run(p, lagging(rng))
        settled += v == "accepted"
        assert p.settled == n - 2 * len(p.pairs) * p.block
    assert plain <= 60 and settled >= 190, (plain, settled)
    assert "2 after switches left out" in p.describe(), p.describe()


def test_a_candidate_far_dearer_right_after_its_switch_ends_the_trial_there():
    """Left out of the pairs, a window after the switch still ends the
    trial when it costs past 1 + abort times the incumbent's block before:
    the program does not pay the rest of the settling for it."""
    p = Paired("C", "I", 1, first="I", settle=2)
    v, n = run(p, lambda side, i: 3.0 if side == "C" else 1.0)
    assert v == "rolled_back" and n == 2 and p.pairs == [], (v, n, p.pairs)
    assert abs(p.relative - 2.0) < 1e-9 and "after the switch cost +200.0%" in p.describe(), p.describe()
    # Judged a block at a time: a program whose burst falls in every other
    # window (blocks of 2) is not cut short on its burst's window alone.
    burst = lambda side, i: (5.0 if i % 2 else 0.1) * (0.8 if side == "C" else 1.0)
    p = Paired("C", "I", 2, first="I", settle=2, max_pairs=3)
    v, n = run(p, burst)
    assert v == "accepted" and p.cut_short is None and len(p.pairs) >= 2, (v, p.pairs, p.describe())
    # Under the bound, it settles and is judged on its pairs.
    p = Paired("C", "I", 1, first="I", settle=2)
    v, n = run(p, lambda side, i: 1.4 if side == "C" else 1.0)
    assert v == "rolled_back" and p.pairs and p.settled >= 2, (v, p.pairs)


def test_gp_leaves_out_the_drain_interval_and_half_a_second_after_each_switch():
    ctx = make_ctx()
    lrn = GPLearner(seed=0)
    lrn.start(ctx, ctx.default, [])
    sim = Sim(ctx, noise=0.01)
    for i in range(4):
        lrn.observe(sim.window(i, ctx.default, ctx.default))
    drain = lambda ms: ctx.clamp({**ctx.default.to_dict(), "drain_ms": ms})
    assert ctx.default.drain_ms == 1000
    assert lrn._settle_windows(ctx.default) == 2           # 1.5 s of 1-s windows
    assert lrn._settle_windows(drain(100)) == 2            # the incumbent's 1 s drain still
    lrn._inc = drain(100)
    assert lrn._settle_windows(drain(100)) == 1
    assert lrn._settle_windows(drain(10000)) == 3          # at most settle_max
    # ... and a screened candidate's trial runs so.
    lrn = GPLearner(seed=0)
    lrn.start(ctx, ctx.default, [])
    lrn.screening()
    good = ctx.clamp(with_hot(ctx.default, 512, 1024))
    lrn.screened([Ranked("good", good, 0.8, 0.01, 0, 0), Ranked("default", ctx.clamp(ctx.default), 1.0, 0.01, 0, 0)])
    d = next(d for d in (lrn.observe(sim.window(i, ctx.default, ctx.default)) for i in range(40)) if d is not None)
    assert d.kind == "explore" and "the first 2 after each switch left out" in d.reason, d.reason
    assert lrn._ab.settle == 2


def test_a_trial_in_progress_is_flushed_once_per_new_window():
    """learnd flushes a program's learner when its last process exits and
    again when learnd stops: a trial under way was stored twice, and the
    second copy, stored after the fleet's worker stopped, never reached the
    fleet (test_fleet's 'nothing lost, nothing doubled' at 7039b3b, whose
    longer trials were still under way at the program's exit)."""
    ctx = make_ctx()
    sim = Sim(ctx, noise=0.01)
    lrn = GPLearner(seed=0)
    lrn.start(ctx, ctx.default, [])
    lrn.screening()
    good = ctx.clamp(with_hot(ctx.default, 512, 1024))
    lrn.screened([Ranked("good", good, 0.8, 0.01, 0, 0), Ranked("default", ctx.clamp(ctx.default), 1.0, 0.01, 0, 0)])
    in_force, i = ctx.default, 0
    while lrn._trial is None or lrn._trial.n < 2:
        d = lrn.observe(sim.window(i, in_force, in_force))
        if d is not None:
            in_force = d.knobs
        i += 1
        assert i < 60, "no trial under way"
    first = [e for e in lrn.flush() if same(e.knobs, good)]
    assert len(first) == 1 and first[0].verdict == "measured" and first[0].windows == lrn._trial.n
    assert lrn.flush() == [], "nothing new since"
    n = lrn._trial.n
    lrn._trial.add(sim.window(i, in_force, in_force))      # one more window of it
    again = [e for e in lrn.flush() if same(e.knobs, good)]
    assert len(again) == 1 and again[0].windows == n + 1


def test_a_burst_spanning_two_windows_is_priced_per_block_not_per_window():
    """bench-learn's spikes under 1 s windows: a window with the spike's
    allocations, then one with the page faults of writing them and a
    handful of allocations. Priced per window at the program's usual rate,
    the second window's faults look 100 times dearer than they are, and a
    policy that keeps the spike's memory to spare them looks cheaper; per
    block of both windows it is dearer, as it is."""
    rng = np.random.default_rng(4)
    ref = 7000.0

    def windows(keep):
        # (time, mem, allocs): keeping the memory spares the faults, costs RSS.
        spike = (0.004 if not keep else 0.0013, 0.036 if keep else 0.026, 14000.0)
        after = (0.010 if not keep else 0.0005, 0.036 if keep else 0.026, float(rng.integers(40, 800)))
        return [spike, after]
    inc = [w for _ in range(5) for w in windows(False)]
    b = choose_block(inc, ref)
    assert b.windows == 2, b
    p = Paired("keep", "default", b, ref=ref)
    for i in range(100):
        side = p.side
        w = windows(side == "C")[i % 2]
        v = p.add(w)
        if v in VERDICTS:
            break
    assert v in ("rolled_back", "rejected") and p.relative > 0.05, (v, p.pairs)
    # The per-window pricing this replaces points the other way (and
    # between the windows' phases, it cannot tell at all).
    per_window = Paired("keep", "default", 1)
    for i in range(100):
        t, m, a = windows(per_window.side == "C")[i % 2]
        v = per_window.add(t * ref / a + m)
        if v in VERDICTS:
            break
    assert per_window.relative < -0.3, per_window.pairs


def saturated(rng, cand_rate, cand_mem=0.05, n=16, noise=0.005):
    """Windows (time, mem, allocs, cpu) of a program on one full core, as
    sqlite3 ran in learn_real at lambda 0.5/GiB: the incumbent at 258,000
    allocations a second (0.5% noise a window, as its steady windows), 275
    MiB; a candidate whose faults slow the program to cand_rate of that while
    the allocator's own cost calls it cheaper (time 0.07 against 0.012
    cores, memory cand_mem against 0.135: drain=100 kept 100 MiB; -10% in
    all, as learnd's trial said). Returns
    the incumbent's windows before the trial and a function of (side) for
    the trial's."""
    def window(side):
        if side == "C":
            return (0.07, cand_mem, 258e3 * cand_rate * math.exp(noise * rng.standard_normal()), 1.0)
        return (0.012, 0.135, 258e3 * math.exp(noise * rng.standard_normal()), 1.0)
    return [window("I") for _ in range(n)], window


def judge(before, window, cpu=True, **kw):
    strip = (lambda w: w) if cpu else (lambda w: w[:3])
    ref = float(np.mean([w[2] for w in before]))
    block = choose_block([strip(w) for w in before], ref)
    p = Paired("C", "I", block, ref=ref, first="I",
               measured_prior=measured_prior(before, block.windows, ref) if cpu else None, **kw)
    for _ in range(100):
        v = p.add(strip(window(p.side)))
        if v in VERDICTS:
            return p, v
    raise AssertionError("no verdict")


def test_a_candidate_that_slows_the_program_is_rolled_back_on_its_cpu_though_the_allocator_calls_it_cheaper():
    """sqlite3 under drain=100 (learn_real at 8ae5090): the allocator's cost
    said 10.6% cheaper for six pairs, 30 seconds in which the program ran
    11% fewer allocations a second on the same core. Measured from its CPU,
    with the memory it gave back priced in, it costs 3.4% more."""
    rng = np.random.default_rng(7)
    before, window = saturated(rng, 0.89)
    p, v = judge(before, window, cpu=False)
    assert v == "accepted" and p.relative < -0.05, "the allocator's cost alone takes it"
    seen = []
    for _ in range(50):
        before, window = saturated(rng, 0.89)
        p, v = judge(before, window)
        assert v == "rolled_back" and len(p.pairs) <= 2, (v, p.pairs, p.measured_pairs)
        assert "own CPU per allocation +1" in p.describe() and "beyond its noise" in p.describe(), p.describe()
        seen.append(p.measured_relative)
    assert 0.025 < np.median(seen) < 0.045, seen     # (1/0.89 + 0.05) / (1 + 0.135) - 1 = +3.4%


def test_the_cpu_guard_passes_a_trade_of_cpu_for_memory_that_the_price_of_memory_pays_for():
    """The guard is the objective, measured: at 1% noise a window, giving
    back 85% of the memory is taken when it costs no CPU, and when it costs
    6% (the memory's price pays for that: -1.8% in all); seldom when it
    costs 12% (+4.5% in all), never 3% for no memory. (At 10%, +2.3% in
    all, about two trials in five take it: held back only beyond a standard
    error over the 1% allowed; at 0.5% noise one in twelve; at 2% noise,
    one in two, and 12% one in seven.)"""
    rng = np.random.default_rng(8)
    taken = {}
    for rate, mem in ((1.0, 0.05), (0.94, 0.05), (0.88, 0.05), (0.97, 0.135)):
        n = 0
        for _ in range(200):
            before, window = saturated(rng, rate, cand_mem=mem, noise=0.01)
            n += judge(before, window)[1] == "accepted"
        taken[(rate, mem)] = n / 200
    assert taken[(1.0, 0.05)] >= 0.95 and taken[(0.94, 0.05)] >= 0.8, taken
    assert taken[(0.88, 0.05)] <= 0.05 and taken[(0.97, 0.135)] == 0, taken


def test_gp_rolls_back_a_screened_candidate_that_costs_the_program_cpu():
    """The learner hands each window's CPU (cores, /proc) to the A/B trial."""
    ctx = make_ctx()

    class Slowed(Sim):
        def window(self, t, in_force, knobs):
            w = super().window(t, in_force, knobs)
            # The program's CPU per allocation: 15% more under the candidate.
            slow = 1.15 if same(in_force, good) else 1.0
            return w.replace(cpu=float(np.sum(w.allocs)) * 2e-7 * slow * (1 + 0.01 * self.rng.standard_normal()))

    sim = Slowed(ctx, noise=0.01)
    good = ctx.clamp(with_hot(ctx.default, 512, 1024))
    assert sim.truth(good)["cost"] < 0.95 * sim.truth(ctx.default)["cost"]
    decisions, in_force, incumbents = under_drift(ctx, sim, 1.0, good)
    assert all(same(k, ctx.default) for k in incumbents), decisions
    verdict = next(d for _, d in decisions if d.kind not in ("ab", "explore"))
    assert verdict.kind == "rollback" and re.search(r"own CPU per allocation \+1[2-8]\.\d%, its cost so measured "
                                                    r"\+1\d\.\d% vs incumbent \(more than 1% beyond", verdict.reason), verdict.reason


def test_learnd_logs_a_verdict_that_leaves_the_incumbent_in_force(tmp_path, monkeypatch, capsys):
    """An A/B trial may end on one of the incumbent's blocks: its rollback
    changes nothing in force, and is news all the same (policy explain and
    the event stream show every verdict)."""
    from hakmem.daemon import Program
    from hakmem.learning import Decision
    from test_objective import daemon
    d = daemon(tmp_path, monkeypatch, None)
    ctx = make_ctx()
    prog = Program(key="/usr/bin/x", exe="/usr/bin/x", build_id="b", users="0", header={})
    prog.ctx, prog.default, prog.target = ctx, ctx.default, ctx.clamp(ctx.default)
    d._decide(prog, Decision(ctx.default, "rollback", "reject (within noise): cost +0.3% over 6 A/B pairs"))
    d._decide(prog, Decision(ctx.default, "ab", "A/B: the incumbent for 1 window"))
    err = capsys.readouterr().err
    assert "policy_rolled_back x: reject (within noise)" in err, err
    assert "A/B: the incumbent" not in err, "a switch to what is already in force is not an event"
