#!/usr/bin/env python3
"""PostgreSQL 15 under pgbench, tuned by hakmem-learnd from a cold start, then
measured from outside: the default policy against the learned one.

A cluster made by initdb in a temporary directory (listening only on a unix
socket there), run as the `postgres` account with hakmem preloaded; learnd on
a fresh state directory tunes it for --seconds under `pgbench -c 4`; then
learnd is restarted with --no-explore and fresh postmasters alternate: one
whose telemetry directory has no learnd (hakmem's default policy), one
under learnd (the stored best at once), --rounds times, who goes first
alternating from round to round. Each round is
`pgbench -c 4 -T --run-seconds` (TPS) while the server's proportional set
size (Pss, /proc/PID/smaps_rollup, summed over the postmaster and its
children: shared buffers are counted once) is sampled every 0.5 s.
Everything it starts is stopped at the end, on an error or on Ctrl-C.
Needs root; installs Debian's postgresql when missing.

    tools/tune_pg.py [--build build] [--seconds 300] [--rounds 5] [--run-seconds 15] [--json] [--keep]
"""
import argparse
import json
import os
import pathlib
import pwd
import re
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "learner"))
from hakmem.procfs import proc_children  # noqa: E402  one reader of /proc for learnd and the tools
PG_BIN = pathlib.Path("/usr/lib/postgresql/15/bin")
# The project's venv; a copy of the tree without one (tools/mutate.py's) runs
# under a venv's python, whose bin holds the same commands.
VENV_BIN = ROOT / ".venv" / "bin" if (ROOT / ".venv" / "bin").is_dir() else pathlib.Path(sys.executable).parent
CLIENTS = 4


class TuneError(Exception):
    pass


def say(msg=""):
    print(msg, file=sys.stderr, flush=True)


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith("HAKMEM_") and k != "LD_PRELOAD"}
    e.update({k: str(v) for k, v in extra.items()})
    return e


def pss_kib(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            m = re.search(r"^Pss:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


class Cluster:
    def __init__(self, lib, ids):
        self.lib, self.ids = lib, ids
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-pg-"))
        os.chown(self.dir, *ids)
        self.data = self.dir / "data"
        self.pm = None

    def as_pg(self, argv, **kw):
        uid, gid = self.ids
        return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
                                 *map(str, argv)], cwd="/", **kw)

    def run_pg(self, argv, timeout=300):
        p = self.as_pg(argv, env=env(LC_ALL="C"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise TuneError(f"{' '.join(map(str, argv))} failed ({p.returncode}): {out.strip()[-300:]}")
        return out

    def initdb(self):
        self.run_pg([PG_BIN / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8",
                     "--locale=C", "--no-sync"])

    def start(self, shm):
        e = env(LC_ALL="C", LD_PRELOAD=self.lib, HAKMEM_SHM_DIR=shm)
        log = self._open_log()
        self.pm = self.as_pg([PG_BIN / "postgres", "-D", self.data, "-c", "listen_addresses=",
                              "-c", f"unix_socket_directories={self.dir}", "-c", "fsync=off",
                              "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                              "-c", "logging_collector=off"],
                             env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        t_end = time.monotonic() + 60
        while time.monotonic() < t_end:
            if self.pm.poll() is not None:
                raise TuneError(f"postgres exited at start ({self.pm.returncode}): {self.log_tail()}")
            try:
                lines = (self.data / "postmaster.pid").read_text().splitlines()
                if len(lines) >= 8 and lines[7].strip() == "ready":
                    self._check_preloaded()
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TuneError(f"postgres did not become ready within 60 s: {self.log_tail()}")

    # The server's own words, so that a start that fails says why: one file
    # per start, truncated, so the tail is this start's. The directory is
    # the postgres account's, so what is there is opened without following
    # a link or waiting on a FIFO, and must be a regular file.
    LOG_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

    def _open_log(self):
        try:
            fd = os.open(self.dir / "server.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self.LOG_FLAGS, 0o600)
        except OSError as e:
            raise TuneError(f"cannot open the server's log {self.dir / 'server.log'}: {e.strerror}")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise TuneError(f"{self.dir / 'server.log'} is not a regular file")
        return os.fdopen(fd, "wb")

    def log_tail(self):
        try:
            fd = os.open(self.dir / "server.log", os.O_RDONLY | self.LOG_FLAGS)
        except OSError as e:
            return f"(no log: {e.strerror})"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "(no log: not a regular file)"
            data = os.pread(fd, 600, max(0, st.st_size - 600))
        finally:
            os.close(fd)
        return data.decode(errors="replace").strip() or "(it said nothing)"

    def _check_preloaded(self):
        """ld.so skips a preload it cannot open (a library the postgres
        account cannot read) with a warning on a stderr nobody reads, and
        everything after would measure glibc under hakmem's name."""
        if not self.lib:
            return
        try:
            maps = pathlib.Path(f"/proc/{self.pm.pid}/maps").read_text()
        except OSError as e:
            raise TuneError(f"cannot read the postmaster's mappings: {e}")
        if os.path.realpath(self.lib) not in maps:
            raise TuneError(f"postgres did not load {self.lib} (can the postgres account read it?)")

    def client_env(self):
        return env(LC_ALL="C", PGHOST=str(self.dir), PGUSER="postgres", PGDATABASE="postgres")

    def pgbench(self, *args):
        return subprocess.Popen([PG_BIN / "pgbench", *map(str, args)], env=self.client_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def pss_kib(self):
        if self.pm is None or self.pm.poll() is not None:
            return 0
        return pss_kib(self.pm.pid) + sum(pss_kib(c) for c in proc_children(self.pm.pid))

    def stop(self):
        if self.pm is None:
            return
        if self.pm.poll() is None:
            p = self.as_pg([PG_BIN / "pg_ctl", "stop", "-D", self.data, "-m", "fast", "-w", "-t", "30"],
                           env=env(LC_ALL="C"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                p.wait(40)
                self.pm.wait(10)
            except subprocess.TimeoutExpired:
                for pgid in [self.pm.pid, *proc_children(self.pm.pid)]:
                    try:
                        os.killpg(pgid, signal.SIGKILL)
                    except OSError:
                        pass
                self.pm.wait()
        self.pm = None

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Learnd:
    def __init__(self, work, shm, *extra):
        self.logpath = work / f"learnd-{time.monotonic_ns()}.log"
        self.log = open(self.logpath, "w")
        self.p = subprocess.Popen([str(VENV_BIN / "hakmem-learnd"), "--foreground", "--db", str(work / "learn.db"),
                                   "--shm-dir", str(shm), "--run-dir", str(work / "run"), *extra],
                                  stdout=self.log, stderr=subprocess.STDOUT, env=env())
        t_end = time.monotonic() + 60
        while "ready:" not in self.logpath.read_text():
            if self.p.poll() is not None or time.monotonic() > t_end:
                raise TuneError(f"learnd did not start: {self.logpath.read_text()[-500:]}")
            time.sleep(0.1)

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def measure(cl, seconds):
    """TPS of one pgbench run and the server's median Pss during it."""
    b = cl.pgbench("-c", CLIENTS, "-j", 2, "-T", seconds, "-n")
    samples = []
    while b.poll() is None:
        time.sleep(0.5)
        samples.append(cl.pss_kib())
    out, err = b.communicate()
    if b.returncode != 0:
        raise TuneError(f"pgbench failed ({b.returncode}): {err.strip()[-300:]}")
    m = re.search(r"tps = ([\d.]+)", out)
    if not m:
        raise TuneError(f"pgbench printed no tps: {out[-300:]}")
    return float(m.group(1)), statistics.median(samples[len(samples) // 4:] or [0])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="tune_pg", description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.environ.get("BUILD", "build"), help="where libhakmem.so is (default build)")
    ap.add_argument("--seconds", type=int, default=300, help="how long learnd tunes postgres (default 300)")
    ap.add_argument("--rounds", type=int, default=5, help="default/learned rounds (default 5)")
    ap.add_argument("--run-seconds", type=int, default=15, help="pgbench seconds per measured run (default 15)")
    ap.add_argument("--json", action="store_true", help="print the measurements as JSON on stdout")
    ap.add_argument("--keep", action="store_true", help="keep learnd's database and logs (the directory is printed)")
    a = ap.parse_args(argv)
    if min(a.seconds, a.rounds, a.run_seconds) < 1:
        ap.error("--seconds, --rounds and --run-seconds must be positive")
    if os.geteuid() != 0:
        print("tune_pg: error: needs root (runs PostgreSQL as the postgres account)", file=sys.stderr)
        return 1
    lib = (ROOT / a.build / "libhakmem.so").resolve()
    if not lib.exists():
        print(f"tune_pg: error: {lib} missing: run `make lib`", file=sys.stderr)
        return 1
    if not (PG_BIN / "pgbench").exists():
        subprocess.run([str(ROOT / "tools" / "install-deps.sh"), "postgresql"], check=True)
    pw = pwd.getpwnam("postgres")
    work = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-tune-pg-"))
    shm = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-tune-pg-", dir="/dev/shm"))
    shutil.rmtree(shm)
    nolearnd = work / "no-learnd"
    nolearnd.mkdir(mode=0o1777)
    os.chmod(nolearnd, 0o1777)
    cl = Cluster(str(lib), (pw.pw_uid, pw.pw_gid))
    learnd = None
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        cl.initdb()
        learnd = Learnd(work, shm)
        cl.start(shm)
        b = cl.pgbench("-i", "-s", 10, "-q")
        if b.wait(300) != 0:
            raise TuneError(f"pgbench -i failed: {b.stderr.read()[-300:]}")
        say(f"learnd tuning postgres under pgbench -c {CLIENTS} for {a.seconds} s (log {learnd.logpath})")
        load = cl.pgbench("-c", CLIENTS, "-j", 2, "-T", a.seconds, "-n")
        t0 = time.monotonic()
        while load.poll() is None:
            time.sleep(10)
            say(f"  [{time.monotonic() - t0:5.0f} s] server Pss {cl.pss_kib() / 1024:.0f} MiB")
        load.communicate()
        cl.stop()
        learnd.stop()
        log = learnd.logpath.read_text()
        events = [ln.split("hakmem-learnd: ", 1)[-1] for ln in log.splitlines()
                  if any(k in ln for k in ("screened", "screen_failed", "policy_accepted", "policy_rolled_back",
                                           "policy_settled"))]
        learnd = Learnd(work, shm, "--no-explore")
        runs = {"default": [], "learned": []}
        for rnd in range(1, a.rounds + 1):
            # ABBA: each pgbench run grows the tables and the WAL it leaves
            # (checkpoints come due), so the second run of a pair is not the
            # first's equal; alternating who goes first spreads that over both.
            for which in (("default", "learned") if rnd % 2 else ("learned", "default")):
                cl.start(nolearnd if which == "default" else shm)
                tps, pss = measure(cl, a.run_seconds)
                cl.stop()
                runs[which].append({"tps": tps, "pss_kib": pss})
                say(f"round {rnd} {which:<8} {tps:10.1f} tps, server Pss {pss / 1024:.0f} MiB")
        learnd.stop()
        learnd = None
        r = subprocess.run([str(VENV_BIN / "hakmem"), "policy", "explain", "postgres", "--db", str(work / "learn.db"),
                            "--run-dir", str(work / "run")], capture_output=True, text=True, env=env())
        res = {"seconds": a.seconds, "rounds": a.rounds, "run_seconds": a.run_seconds, "events": events,
               "runs": runs, "explain": r.stdout.strip().splitlines()
               or [f"hakmem policy explain postgres failed ({r.returncode}): {r.stderr.strip()[-300:]}"]}
        for which in runs:
            t = [x["tps"] for x in runs[which]]
            res[which] = {"tps_median": statistics.median(t), "tps_spread": (max(t) - min(t)) / statistics.median(t),
                          "pss_mib_median": statistics.median(x["pss_kib"] for x in runs[which]) / 1024}
        if a.json:
            print(json.dumps(res, indent=1))
        else:
            print("\n".join(["learnd's verdicts while tuning:", *("  " + e[:200] for e in events), "",
                             *res["explain"], "",
                             f"median of {a.rounds}   default        learned   change",
                             f"TPS         {res['default']['tps_median']:9.1f}  {res['learned']['tps_median']:9.1f}  "
                             f"{(res['learned']['tps_median'] / res['default']['tps_median'] - 1) * 100:+6.1f}%  "
                             f"(spread {res['default']['tps_spread'] * 100:.0f}%, {res['learned']['tps_spread'] * 100:.0f}%)",
                             f"Pss MiB     {res['default']['pss_mib_median']:9.1f}  {res['learned']['pss_mib_median']:9.1f}  "
                             f"{(res['learned']['pss_mib_median'] / res['default']['pss_mib_median'] - 1) * 100:+6.1f}%"]))
        return 0
    except TuneError as e:
        print(f"tune_pg: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        say("interrupted: stopping everything")
        return 130
    finally:
        if learnd is not None:
            learnd.stop()
        cl.cleanup()
        shutil.rmtree(shm, ignore_errors=True)
        if a.keep:
            shutil.rmtree(nolearnd, ignore_errors=True)
            say(f"kept {work} (learnd's database learn.db and its logs)")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
