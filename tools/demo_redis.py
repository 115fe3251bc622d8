#!/usr/bin/env python3
"""make demo: a real service on hakmem, tuned by hakmem-learnd, end to end.

Debian's redis-server, preloaded with hakmem, under redis-benchmark load;
hakmem-learnd started on a fresh state directory tunes it for about a
minute while this prints what it does; then the learned policy
(`hakmem policy show redis-server`), the SQLite file, the metrics endpoint,
and redis's throughput and resident memory under the default policy and
under the learned one, with what the rounds allow saying of the difference
(nothing is compared when learnd kept the default: that would compare a
policy with itself). Everything it starts runs in private places (a
temporary directory, a unix socket there, no TCP for redis, a telemetry
directory of its own under /dev/shm) and is stopped at the end, on an error
or on Ctrl-C.

    tools/demo_redis.py [--build build] [--seconds 60] [--rounds 3] [--keep]
"""
import argparse
import json
import math
import os
import pathlib
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "learner"))
from hakmem.progress import progress, write  # noqa: E402
from hakmem.ring import Ring, RingError  # noqa: E402

REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"
BENCH = shutil.which("redis-benchmark") or "/usr/bin/redis-benchmark"
PROGRAM = os.path.basename(os.path.realpath(REDIS))     # Debian: redis-server links to redis-check-rdb
TESTS = "set,get,lpush,lpop,hset"
BENCH_ARGS = ["-c", "16", "-d", "256", "-r", "100000"]
VENV_BIN = ROOT / ".venv" / "bin"


class DemoError(Exception):
    pass


def verdict(default, learned):
    """What the rounds of one measure allow saying, from their ranges: a
    difference only where every learned round is beyond every default round.
    With 3 rounds a side, two runs of the same policy separate that way by
    chance 1 time in 10 (2 / C(6, 3)); overlapping ranges say nothing. Returns (word,
    change of medians or None): a change is shown only beside a difference,
    so noise is never printed as a gain."""
    if not default or not learned:
        return "not measured", None
    if min(len(default), len(learned)) < 3:
        # 2 rounds a side separate by chance 1 time in 3, 1 round always.
        return "too few rounds to tell (3 a side at least)", None
    m0, m1 = statistics.median(default), statistics.median(learned)
    change = (m1 / m0 - 1) if m0 else None
    if min(learned) > max(default):
        return "higher", change
    if max(learned) < min(default):
        return "lower", change
    return "no difference beyond noise", None


def comparison(runs):
    """The closing table's lines: runs = {"default"|"learned": [(rows, rss
    KiB)]}, rows = {test: (req/s, ...)}, one entry a round."""
    def shown(word, change):
        return word if change is None else f"{word} {change * 100:+.1f}%"

    def line(name, a, b, fmt):
        rng = f"{fmt(min(a))}-{fmt(max(a))}; {fmt(min(b))}-{fmt(max(b))}"
        return (f"{name:<14} {fmt(statistics.median(a)):>12} {fmt(statistics.median(b)):>12}  {rng:<36} "
                f"{shown(*verdict(a, b))}")
    n = len(runs["default"])
    out = [f"{'median of ' + str(n):<14} {'default':>12} {'learned':>12}  {'rounds (default; learned)':<36} verdict"]
    for t in runs["default"][0][0]:
        out.append(line(f"{t} req/s", [rows.get(t, (0.0,))[0] for rows, _ in runs["default"]],
                        [rows.get(t, (0.0,))[0] for rows, _ in runs["learned"]], lambda v: f"{v:,.0f}"))
    out.append(line("resident MiB", [r / 1024 for _, r in runs["default"]],
                    [r / 1024 for _, r in runs["learned"]], lambda v: f"{v:.0f}"))
    chance = 2 / math.comb(2 * n, n) if n == len(runs["learned"]) else None
    out.append("verdict: higher or lower only where every learned round lies beyond every default round"
               + (f" (two runs of one policy separate so by chance {chance:.0%} of the time)" if chance else "")
               + "; otherwise no difference beyond noise.")
    return out


def say(msg=""):
    print(msg, flush=True)


def header(msg):
    say()
    say(f"== {msg}")


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith("HAKMEM_") and k != "LD_PRELOAD"}
    e.update({k: str(v) for k, v in extra.items()})
    return e


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for ln in f:
                if ln.startswith("VmRSS:"):
                    return int(ln.split()[1])
    except OSError:
        pass
    return 0


class Demo:
    program = PROGRAM       # the name learnd groups the service's processes by
    kept = "learn.db, learnd.log, redis.log"     # what --keep leaves
    learnd_args = ()        # more flags for every learnd the demo starts (its objective)

    def __init__(self, build, seconds, keep, rounds=3):
        self.lib = (build / "libhakmem.so").resolve()
        if not self.lib.exists():
            raise DemoError(f"{self.lib} missing: run `make lib`")
        self.check_tools()
        self.seconds, self.keep, self.rounds = seconds, keep, rounds
        self.work = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-demo-", dir="/tmp"))
        self.shm = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-demo-", dir="/dev/shm"))
        self.state = self.work / "state"
        self.run = self.work / "run"
        self.db = self.state / "learn.db"
        self.procs = []          # everything started, stopped in reverse
        self.learnd = self.redis = None
        self.url = None

    def check_tools(self):
        for tool in (REDIS, BENCH):
            if not os.path.exists(tool):
                raise DemoError(f"{tool} missing: run `tools/install-deps.sh redis`")

    # ---- starting and stopping ------------------------------------------------
    def spawn(self, argv, **kw):
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.DEVNULL)
        # A session of its own: Ctrl-C reaches the demo alone, which stops
        # each child in order (learnd stores what it measured).
        p = subprocess.Popen([str(a) for a in argv], start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def stop(self, p, sig=signal.SIGTERM, timeout=20):
        if p is None or p.poll() is not None:
            return p.returncode if p is not None else None
        try:
            os.killpg(p.pid, sig)
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        except ProcessLookupError:
            pass
        return p.returncode

    def start_learnd(self, *extra):
        extra = (*self.learnd_args, *extra)
        self.state.mkdir(mode=0o700, exist_ok=True)
        log = open(self.work / "learnd.log", "a")
        argv = [VENV_BIN / "hakmem-learnd", "--foreground", "--db", self.db, "--shm-dir", self.shm,
                "--run-dir", self.run, "--sample-period", "0.5", "--metrics", "127.0.0.1:0", *extra]
        say("$ " + " ".join(str(a).replace(str(self.work), "$DEMO") for a in argv))
        self.learnd = self.spawn(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        end = time.monotonic() + 60
        while time.monotonic() < end:
            m = re.findall(r"metrics (http://\S+/metrics)", self.log_text())
            if m and len(m) == self.log_text().count("ready:"):
                self.url = m[-1]
                return
            if self.learnd.poll() is not None:
                raise DemoError(f"hakmem-learnd exited ({self.learnd.returncode}):\n{self.log_text()[-2000:]}")
            time.sleep(0.1)
        raise DemoError("hakmem-learnd did not get ready in 60 s")

    def stop_learnd(self):
        rc = self.stop(self.learnd, signal.SIGTERM, 30)
        self.learnd = None
        return rc

    def log_text(self):
        try:
            return (self.work / "learnd.log").read_text(errors="replace")
        except OSError:
            return ""

    def start_redis(self, shm=None):
        sock = self.work / "redis.sock"
        self.redis = self.spawn([REDIS, "--port", "0", "--unixsocket", sock, "--unixsocketperm", "700",
                                 "--save", "", "--appendonly", "no", "--dir", self.work,
                                 "--logfile", self.work / "redis.log"],
                                env=env(LD_PRELOAD=self.lib, HAKMEM_SHM_DIR=shm or self.shm))
        end = time.monotonic() + 15
        while time.monotonic() < end:
            if self.redis.poll() is not None:
                raise DemoError(f"redis-server exited ({self.redis.returncode}): "
                                f"{(self.work / 'redis.log').read_text(errors='replace')[-1500:]}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(sock))
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return sock
            except OSError:
                pass
            time.sleep(0.05)
        raise DemoError("redis-server did not answer in 15 s")

    def stop_redis(self):
        if self.redis is not None and self.redis.poll() is None:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.work / "redis.sock"))
                    s.sendall(b"SHUTDOWN NOSAVE\r\n")
            except OSError:
                pass
            try:
                self.redis.wait(15)
            except subprocess.TimeoutExpired:
                pass
        rc = self.stop(self.redis, signal.SIGKILL)
        self.redis = None
        return rc

    def cleanup(self):
        """Load first, then redis (SHUTDOWN NOSAVE: it removes its telemetry
        file as it exits), then learnd (SIGTERM: it stores what it measured)."""
        for p in self.procs:
            if p is not self.redis and p is not self.learnd and p.poll() is None:
                self.stop(p, signal.SIGKILL)
        self.stop_redis()
        self.stop_learnd()
        for p in self.procs:
            if p.poll() is None:
                self.stop(p, signal.SIGKILL)
        left = [n for n in os.listdir(self.shm) if n != "learnd.lock"] if self.shm.exists() else []
        shutil.rmtree(self.shm, ignore_errors=True)
        if self.keep:
            say(f"kept {self.work} ({self.kept})")
        else:
            shutil.rmtree(self.work, ignore_errors=True)
        return left

    # ---- measuring ---------------------------------------------------------
    def benchmark(self, sock, n):
        r = subprocess.run([BENCH, "-s", sock, "-t", "set", "-n", "100000", *BENCH_ARGS, "-q"], env=env(),
                           capture_output=True, text=True, timeout=300)          # the data set, then the run
        r = subprocess.run([BENCH, "-s", sock, "-t", TESTS, "-n", str(n), *BENCH_ARGS, "--csv"], env=env(),
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise DemoError(f"redis-benchmark failed ({r.returncode}): {r.stderr.strip()[-500:]}")
        rows = {}
        for ln in r.stdout.splitlines()[1:]:
            cells = [c.strip('"') for c in ln.split(",")]
            if len(cells) > 2:
                rows[cells[0]] = (float(cells[1]), float(cells[4]))       # rps, p50 ms
        return rows, rss_kib(self.redis.pid)

    def scrape(self):
        from prometheus_client.parser import text_string_to_metric_families
        with urllib.request.urlopen(self.url, timeout=5) as r:
            text = r.read().decode()
        return text, {f.name: f for f in text_string_to_metric_families(text)}

    def status_line(self):
        try:
            _, fams = self.scrape()
        except Exception:
            return "metrics: not answering"

        def val(fam, **lab):
            for s in fams[fam].samples:
                if all(s.labels.get(k) == v for k, v in lab.items()) and not s.name.endswith("_created"):
                    return s.value
            return None
        prog = self.program
        allocs = val("hakmem_process_counter_rate", program=prog, counter="allocs")
        cost = val("hakmem_program_cost", program=prog)
        ver = val("hakmem_process_policy_applied_version", program=prog)
        acc = val("hakmem_program_trials", program=prog, verdict="accepted") or 0
        rb = val("hakmem_program_trials", program=prog, verdict="rolled_back") or 0
        rss = val("hakmem_program_resident_bytes", program=prog)
        if allocs is None:
            return f"waiting for {prog}'s first window"
        return (f"{allocs / 1e3:.0f}k allocs/s, cost {cost:.2e}, rss {rss / 2**20:.0f} MiB, "
                f"policy v{int(ver or 0)}, accepted {int(acc)}, rolled back {int(rb)}")

    # ---- the demo ------------------------------------------------------------
    def main(self):
        n = 200_000
        header(f"hakmem-learnd on a fresh state directory, tuning redis-server under load for {self.seconds} s")
        self.start_learnd()
        say(f"learnd ready; metrics at {self.url}")
        say(f"$ LD_PRELOAD={self.lib} redis-server --port 0 --unixsocket $DEMO/redis.sock --save ''   "
            f"# {REDIS} -> {os.path.realpath(REDIS)}")
        sock = self.start_redis()
        say(f"$ redis-benchmark -s $DEMO/redis.sock -t {TESTS} -l -q {' '.join(BENCH_ARGS)}   # until the end")
        load = self.spawn([BENCH, "-s", sock, "-t", TESTS, "-n", "100000000", "-l", "-q", *BENCH_ARGS])
        seen = len(self.log_text())
        last_plain = 0.0
        with progress(total=self.seconds, desc="learnd tuning redis", unit="s") as bar:
            t0 = time.monotonic()
            for i in range(self.seconds):
                time.sleep(max(0.0, t0 + i + 1 - time.monotonic()))
                text = self.log_text()
                for ln in text[seen:].splitlines():
                    if self.program in ln and any(k in ln for k in ("policy_", "process_", "relearn")):
                        bar.write("  " + ln.split("hakmem-learnd: ", 1)[-1][:160])
                seen = len(text)
                line = self.status_line()
                bar.set_postfix_str(line)
                bar.update(1)
                if not hasattr(bar, "format_dict") and time.monotonic() - last_plain >= 10:
                    write(f"  [{i + 1:3d} s] {line}")          # no terminal: a line every 10 s
                    last_plain = time.monotonic()
                if load.poll() is not None or self.redis.poll() is not None or self.learnd.poll() is not None:
                    raise DemoError("redis-benchmark, redis-server or learnd stopped during the run")
        self.stop(load, signal.SIGINT)
        say(f"status: {self.status_line()}")

        best_is_default = self.show_learned()

        if best_is_default:
            header("redis under redis-benchmark: what learnd changed")
            say("Nothing: learnd's best stored policy for redis-server is the default (see `policy show`")
            say("above), so a learned run would run the default again. A comparison of a policy with itself")
            say("shows only the machine's noise, so none is made. On this workload the knobs learnd tunes")
            say("leave no room it could measure beyond noise in the time given.")
            return

        header("redis under redis-benchmark: the default policy vs the learned one")
        say("learnd restarted with --no-explore: a new redis-server gets the best stored policy at once.")
        say("Default: a redis-server whose telemetry directory has no learnd (hakmem keeps its default policy).")
        say(f"A fresh redis-server per run, alternating (who goes first alternates too), {self.rounds} rounds: "
            "the machine's noise shows in the rounds.")
        self.stop_redis()
        self.stop_learnd()
        self.start_learnd("--no-explore")
        nolearnd = self.work / "no-learnd"
        nolearnd.mkdir()
        runs = {"default": [], "learned": []}
        for rnd in range(1, self.rounds + 1):
            # Who goes first alternates (ABBA): a slow stretch of a shared
            # machine, or what one run leaves behind, falls on both.
            for which in (("default", "learned") if rnd % 2 else ("learned", "default")):
                sock = self.start_redis(nolearnd if which == "default" else None)
                note = ""
                if which == "learned":
                    applied = self.wait_applied()
                    note = f" (policy snapshot v{applied} applied)" if applied else " (NO policy applied)"
                rows, rss = self.benchmark(sock, n)
                self.stop_redis()
                runs[which].append((rows, rss))
                say(f"round {rnd} {which:<8} {', '.join(f'{t} {r:,.0f}/s' for t, (r, _) in rows.items())}; "
                    f"resident {rss / 1024:.0f} MiB{note}")
        self.stop_learnd()

        say()
        for line in comparison(runs):
            say(line)

    def show_learned(self):
        """What learnd stored and shows: `policy show`, the SQLite file, the
        metrics endpoint's lines. Returns whether its best is the default."""
        header(f"the learned policy: hakmem policy show {self.program}")
        where = ["--db", self.db, "--run-dir", self.run]
        r = subprocess.run([str(a) for a in [VENV_BIN / "hakmem", "policy", "show", self.program, *where]],
                           env=env(), capture_output=True, text=True, timeout=60)
        say(r.stdout.rstrip() or r.stderr.rstrip())

        header(f"the SQLite file: {str(self.db).replace(str(self.work), '$DEMO')}")
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5)
        try:
            counts = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                      for t in ("programs", "processes", "windows", "policies", "evaluations")}
            size = sum(p.stat().st_size for p in self.state.glob("learn.db*"))      # with its -wal
            say(f"{size / 1024:.0f} KiB with its WAL: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
            say("$ sqlite3 learn.db 'SELECT version, origin, objective, evaluations FROM policies'")
            for row in con.execute("SELECT version, origin, printf('%.3e', objective), evaluations FROM policies "
                                   "ORDER BY version"):
                say("  " + "|".join("" if c is None else str(c) for c in row))
            best = con.execute("SELECT p.origin FROM programs g JOIN policies p ON p.id = g.best_policy").fetchone()
            # With the default as its best there is nothing learned to run:
            # the comparison below would set the default against itself.
            best_is_default = best is not None and best[0] == "default"
        finally:
            con.close()

        header(f"the metrics endpoint: curl {self.url}  ({self.program}'s lines)")
        text, _ = self.scrape()
        keep = [ln for ln in text.splitlines() if ln.startswith(("hakmem_program_", "hakmem_learnd_processes"))
                and "_created" not in ln]
        keep += [ln for ln in text.splitlines() if re.match(r"hakmem_process_(resident|cost|policy)", ln)]
        keep += [ln for ln in text.splitlines() if ln.startswith("hakmem_process_counter_rate")
                 and re.search(r'counter="(allocs|frees|refills|drains|slabs_from_os)"', ln)]
        say("\n".join(re.sub(r'key="[^"]*",?', "", ln).replace("{}", "") for ln in keep))
        return best_is_default

    def wait_applied(self, timeout=60):
        """The snapshot version redis applied, once learnd has found it and
        written it its policy (0 after timeout). A process looks for learnd's
        lease, and takes a policy up, on its allocator's slow paths: redis
        gets a little load meanwhile (an idle one would wait for ever)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for p in self.shm.glob(f"{self.redis.pid}-*"):
                try:
                    with Ring(str(p)) as r:
                        v = r.status()["applied_version"]
                    if v:
                        return v
                except RingError:
                    pass
            subprocess.run([BENCH, "-s", self.work / "redis.sock", "-t", "set", "-n", "2000", "-q"], env=env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
            time.sleep(0.2)
        return 0


def run(demo, started):
    """Runs a demo to its end; Ctrl-C, and a SIGTERM or hang-up too, stop
    everything it started (also when started where SIGINT is ignored: a
    background job). started: what that is, in words. Its exit status."""
    def interrupted(signum, frame):
        raise KeyboardInterrupt
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    rc = 0
    try:
        demo.main()
    except KeyboardInterrupt:
        say("\ninterrupted: stopping everything")
        rc = 130
    except DemoError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        rc = 1
    finally:
        left = demo.cleanup()
        alive = [p.pid for p in demo.procs if p.poll() is None]
        say(f"stopped: {started}{'' if not alive else f' (still running: {alive})'}; "
            f"telemetry files left: {len(left)}")
    return rc


def arguments(prog, doc, what, seconds, more=None, argv=None):
    """The demos' command line: --build, --seconds (how long learnd tunes
    `what`), --rounds, --keep, and what more(ap) adds. Returns (ap, args)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build", help="the build directory holding libhakmem.so (default build)")
    ap.add_argument("--seconds", type=int, default=seconds, help=f"how long learnd tunes {what} (default {seconds})")
    ap.add_argument("--rounds", type=int, default=3, help="default/learned rounds compared at the end (default 3)")
    ap.add_argument("--keep", action="store_true", help="keep the demo's directory (database, logs)")
    if more:
        more(ap)
    args = ap.parse_args(argv)
    if args.seconds < 5:
        ap.error("--seconds must be at least 5")
    if not 1 <= args.rounds <= 50:
        ap.error("--rounds must be between 1 and 50")
    return ap, args


def main(argv=None):
    ap, args = arguments("demo_redis", __doc__, "redis", 60, argv=argv)
    try:
        demo = Demo(pathlib.Path(args.build), args.seconds, args.keep, args.rounds)
    except DemoError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 1
    return run(demo, "redis-server, redis-benchmark, hakmem-learnd")


if __name__ == "__main__":
    sys.exit(main())
