#!/usr/bin/env python3
"""make demo: a real program on hakmem under a memory budget, tuned by hakmem-learnd.

Debian's sqlite3 shell, preloaded with hakmem, doing what a batch job on a
database does, over and over: a large transaction, an index, aggregates,
half the rows deleted, VACUUM (bench/learn_real.py's sqlite3 workload, a
256 MiB page cache). hakmem-learnd, on a fresh state directory, is given a
memory budget (--objective budget=SIZE: the least CPU while the mean
resident memory stays under SIZE) and tunes sqlite3 for --seconds while this
prints what it does; then the learned policy (`hakmem policy show sqlite3`),
the SQLite file, the metrics endpoint, and sqlite3 under the default policy
against sqlite3 under the learned one, measured from outside (rows per
second, CPU time, proportional set size from /proc), round by round, with
what the rounds allow saying of each difference. Nothing is compared when
learnd kept the default: that would compare a policy with itself.

Under the default policy this workload holds about 250 MiB; the budget
(160 MiB unless told) is below that, so there is room to take, at a price
in speed the closing table shows. Everything runs in private places (a
temporary directory, a telemetry directory of its own under /dev/shm) and is
stopped at the end, on an error or on Ctrl-C.

    tools/demo_sqlite.py [--build build] [--seconds 120] [--rounds 3] [--run-seconds 30]
                         [--budget 160MiB] [--small] [--keep]
"""
import pathlib
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "learner"))
import demo_redis  # noqa: E402  the demo's frame: learnd, policy show, the SQLite file, the metrics, the verdict
import learn_real  # noqa: E402  the sqlite3 workload and its measurement from outside, as the real-program study's
from demo_redis import DemoError, header, say, verdict  # noqa: E402
from hakmem.objective import Objective, ObjectiveError, format_size  # noqa: E402
from hakmem.progress import progress, write  # noqa: E402
from hakmem.ring import Ring, RingError  # noqa: E402


class Watched(learn_real.Ctx):
    """A run whose first process's applied policy version is read from its
    telemetry file after each cycle, until one is applied: a learned run
    must run the learned policy, or it is the default under another name."""

    def __init__(self, *a, shm, **kw):
        super().__init__(*a, shm=shm, **kw)
        self.shm_dir = pathlib.Path(shm)
        self.applied = 0
        self.applied_cycle = None

    def done_cycle(self, units, answer=None):
        super().done_cycle(units, answer)
        if self.applied or not self.procs:
            return
        for p in self.shm_dir.glob(f"{self.procs[0].pid}-*"):
            try:
                with Ring(str(p)) as r:
                    v = r.status()["applied_version"]
            except RingError:
                continue
            if v:
                self.applied, self.applied_cycle = v, self.cycles
                return


class SqliteDemo(demo_redis.Demo):
    program = "sqlite3"
    kept = "learn.db, learnd.log, sqlite3's database"

    def __init__(self, build, seconds, keep, rounds, run_seconds, budget, small):
        self.budget = budget
        self.objective = Objective(budget_bytes=budget)
        self.learnd_args = ("--objective", f"budget={budget}")
        self.run_seconds, self.small = run_seconds, small
        super().__init__(build, seconds, keep, rounds)
        self.sqlite = learn_real.Sqlite(self.work, small)
        self.ctxs = []          # every run's processes, stopped first at the end

    def cleanup(self):
        for ctx in self.ctxs:
            for p in ctx.procs:
                if p.poll() is None:
                    p.kill()
        return super().cleanup()

    def check_tools(self):
        if not pathlib.Path(learn_real.Sqlite.exe).exists():
            raise DemoError(f"{learn_real.Sqlite.exe} missing: run `tools/install-deps.sh`")

    def one(self, shm, seconds):
        """sqlite3 doing the workload for `seconds` (whole cycles), preloaded,
        its telemetry in `shm`; what was measured from outside."""
        ctx = Watched(self.sqlite.work, str(self.lib), shm=shm, policy_env={}, seconds=seconds, small=self.small)
        self.ctxs.append(ctx)
        err = None
        try:
            self.sqlite.workload(ctx)
        except (learn_real.RunError, OSError) as e:
            err = str(e)
        r = ctx.close()
        if not err and r["not_preloaded"]:
            err = f"sqlite3 ran without {self.lib}"
        if err:
            raise DemoError(err)
        r["applied"], r["applied_cycle"] = ctx.applied, ctx.applied_cycle
        return r

    def learn(self):
        """sqlite3 under the workload beside a cold learnd, in a thread,
        while the main thread shows learnd's lines and its metrics."""
        done = {}

        def work():
            try:
                done["run"] = self.one(self.shm, self.seconds)
            except DemoError as e:
                done["error"] = str(e)
        t = threading.Thread(target=work, daemon=True)
        t.start()
        seen = len(self.log_text())
        last_plain = 0.0
        with progress(total=self.seconds, desc="learnd tuning sqlite3", unit="s") as bar:
            t0 = time.monotonic()
            i = 0
            while t.is_alive():
                t.join(timeout=max(0.0, t0 + i + 1 - time.monotonic()))
                i += 1
                text = self.log_text()
                for ln in text[seen:].splitlines():
                    if self.program in ln and any(k in ln for k in ("policy_", "screen", "relearn", "settled")):
                        bar.write("  " + ln.split("hakmem-learnd: ", 1)[-1][:160])
                seen = len(text)
                line = self.status_line()
                bar.set_postfix_str(line)
                if i <= self.seconds:
                    bar.update(1)
                if not hasattr(bar, "format_dict") and time.monotonic() - last_plain >= 10:
                    write(f"  [{i:3d} s] {line}")          # no terminal: a line every 10 s
                    last_plain = time.monotonic()
                if self.learnd.poll() is not None:
                    raise DemoError(f"hakmem-learnd exited ({self.learnd.returncode}):\n{self.log_text()[-1500:]}")
        if "error" in done:
            raise DemoError(done["error"])
        r = done["run"]
        say(f"status: {self.status_line()}")
        say(f"sqlite3 beside learnd: {r['cycles']} cycles, {r['throughput']:,.0f} rows/s, "
            f"mean PSS {r['pss_mean_mib']:.0f} MiB, peak {r['pss_peak_mib']:.0f} MiB")
        return r

    def main(self):
        header(f"hakmem-learnd on a fresh state directory, a budget of {format_size(self.budget)}, "
               f"tuning sqlite3 for {self.seconds} s")
        self.start_learnd()
        say(f"learnd ready; metrics at {self.url}")
        say(f"$ LD_PRELOAD={self.lib} sqlite3 -batch $DEMO/sqlite3/t.db   # fed one batch job a cycle "
            f"on its stdin (bench/learn_real.py)")
        self.learn()

        best_is_default = self.show_learned()
        if best_is_default:
            header("sqlite3: what learnd changed")
            say("Nothing: learnd's best stored policy for sqlite3 is the default (see `policy show` above),")
            say("so a learned run would run the default again. A comparison of a policy with itself shows")
            say("only the machine's noise, so none is made.")
            return

        header("sqlite3: the default policy vs the learned one, measured from outside")
        say("learnd restarted with --no-explore on the database it left: a new sqlite3 gets the best")
        say("stored policy at once. Default: a sqlite3 whose telemetry directory has no learnd.")
        say(f"A fresh sqlite3 and database per run, {self.run_seconds:g} s each, alternating (who goes first "
            f"alternates too), {self.rounds} rounds: the machine's noise shows in the rounds.")
        self.stop_learnd()
        self.start_learnd("--no-explore")
        nolearnd = self.work / "no-learnd"
        nolearnd.mkdir()
        runs = {"default": [], "learned": []}
        for rnd in range(1, self.rounds + 1):
            for which in (("default", "learned") if rnd % 2 else ("learned", "default")):
                r = self.one(nolearnd if which == "default" else self.shm, self.run_seconds)
                note = ""
                if which == "learned":
                    note = (f"; policy snapshot v{r['applied']} applied by cycle {r['applied_cycle']}" if r["applied"]
                            else "; NO policy applied")
                runs[which].append(r)
                say(f"round {rnd} {which:<8} {r['cycles']} cycles, {r['throughput']:,.0f} rows/s, "
                    f"CPU {r['cpu_s']:.1f} s, mean PSS {r['pss_mean_mib']:.0f} MiB, "
                    f"peak {r['pss_peak_mib']:.0f} MiB{note}")
        self.stop_learnd()
        say()
        for line in comparison(runs, self.objective):
            say(line)


def costs(runs, objective):
    """The objective per run, as learnd counts it but from outside: the
    cores the default's work needs at the run's speed (the default runs'
    median rows per busy second over the run's rows per CPU second) while
    the mean PSS is under the budget, growing steeply past it."""
    d_ref = statistics.median(r["throughput"] for r in runs["default"])
    return {k: [objective.cost(d_ref / r["units_per_cpu_s"], r["pss_mean_mib"] * (1 << 20)) for r in rs]
            for k, rs in runs.items()}


def comparison(runs, objective):
    """The closing table: per measure the medians, the rounds' ranges and
    the verdict (a change only beside a difference); then whether the
    answers were the same."""
    def shown(word, change):
        return word if change is None else f"{word} {change * 100:+.1f}%"

    def line(name, a, b, fmt):
        rng = f"{fmt(min(a))}-{fmt(max(a))}; {fmt(min(b))}-{fmt(max(b))}"
        return (f"{name:<18} {fmt(statistics.median(a)):>10} {fmt(statistics.median(b)):>10}  {rng:<30} "
                f"{shown(*verdict(a, b))}")

    def mib(v):
        return f"{v:.0f}" if v >= 100 else f"{v:.1f}"       # small data: the rounds' spread shows

    def of(key):
        return [r[key] for r in runs["default"]], [r[key] for r in runs["learned"]]
    n = len(runs["default"])
    j = costs(runs, objective)
    out = [f"{'median of ' + str(n):<18} {'default':>10} {'learned':>10}  {'rounds (default; learned)':<30} verdict",
           line("rows/s", *of("throughput"), lambda v: f"{v:,.0f}"),
           line("rows per CPU s", *of("units_per_cpu_s"), lambda v: f"{v:,.0f}"),
           line("mean PSS MiB", *of("pss_mean_mib"), mib),
           line("peak PSS MiB", *of("pss_peak_mib"), mib),
           line("objective (cores)", j["default"], j["learned"], lambda v: f"{v:.3f}")]
    budget = objective.budget_bytes / (1 << 20)
    over = {k: sum(r["pss_mean_mib"] > budget for r in rs) for k, rs in runs.items()}
    out.append(f"mean PSS over the {budget:.0f} MiB budget: default {over['default']} of {n} runs, "
               f"learned {over['learned']} of {len(runs['learned'])}")
    ref = max((r["answers"] for rs in runs.values() for r in rs), key=len, default=[])
    same = all(r["answers"] == ref[:len(r["answers"])] for rs in runs.values() for r in rs)
    out.append("same answers in every run (each cycle's query results hashed): " + ("yes" if same else "NO"))
    chance = 2 / demo_redis.math.comb(2 * n, n) if n == len(runs["learned"]) else None
    out.append("verdict: higher or lower only where every learned round lies beyond every default round"
               + (f" (two runs of one policy separate so by chance {chance:.0%} of the time)" if chance else "")
               + "; otherwise no difference beyond noise. The objective: "
               + objective.describe() + ".")
    return out


def main(argv=None):
    def more(ap):
        ap.add_argument("--run-seconds", type=float, default=30.0,
                        help="seconds of each compared run, whole cycles (default 30)")
        ap.add_argument("--budget", default="160MiB", help="learnd's memory budget for sqlite3 (default 160MiB)")
        ap.add_argument("--small", action="store_true", help="small data and short idles (the check CI runs)")
    ap, args = demo_redis.arguments("demo_sqlite", __doc__, "sqlite3", 120, more, argv)
    if args.run_seconds <= 0:
        ap.error("--run-seconds must be positive")
    try:
        budget = Objective.parse(f"budget={args.budget}").budget_bytes
    except ObjectiveError as e:
        ap.error(f"--budget: {e}")
    try:
        demo = SqliteDemo(pathlib.Path(args.build), args.seconds, args.keep, args.rounds, args.run_seconds,
                          budget, args.small)
    except DemoError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 1

    return demo_redis.run(demo, "sqlite3, hakmem-learnd")


if __name__ == "__main__":
    sys.exit(main())
