"""PostgreSQL 15 under pgbench, preloaded with hakmem, with hakmem-learnd
tuning it: every backend serving pgbench takes up learnd's candidate within
a second of it being written, and learnd never settles postgres for "did not
apply the candidate" (issue 12, "Every thread checks in").

A backend serves each transaction from memory contexts whose blocks its
thread cache holds; before the check-in countdown it never reached a slow
path, so it never looked at the snapshot learnd wrote into its telemetry
file, and learnd rolled the candidate back after `stall_windows` windows.

Everything runs in private places: a cluster made by initdb in a temporary
directory, listening only on a unix socket there (listen_addresses=''), a
telemetry directory of its own (root's, 1777, as learnd makes
/dev/shm/hakmem), and learnd's database, sockets and log under tmp_path.
Needs root: postgres runs as the `postgres` account, learnd as root reads
the files postgres makes. Debian's `postgresql` package is installed when
missing (tools/install-deps.sh postgresql)."""
import os
import pathlib
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from conftest import LIB, ROOT, as_user, clean_env, need_root, proc_start_time, scaled, wait_for
from test_learnd import Learnd, db_rows, telemetry_files
from hakmem.ring import Ring, RingError

PG_BIN = pathlib.Path("/usr/lib/postgresql/15/bin")
CLIENTS = 4          # pgbench clients, each served by one backend
RUN_S = 30           # pgbench's run: learnd's candidates from 2-3 s in; it also covers the background
                     # writer's first telemetry file (15 s after start: its standby snapshot), and a
                     # stall (10 windows) after it
PERIOD = 0.5         # learnd's window: its warm-up (3 windows) and a stall (10) both fit in the run
APPLY_S = 1.0        # the bound under test: a backend takes up a snapshot within this of its writing
UNMEASURED_MAX = 4   # windows in a row learnd may count for no policy (a change costs one or two)
POLL_S = 0.01        # how often the backends' files are read while pgbench runs (a measuring interval)


# ---- PostgreSQL -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def pg_user():
    """The `postgres` account's (uid, gid), PostgreSQL 15 installed."""
    missing = not (PG_BIN / "pgbench").exists()
    need_root("runs PostgreSQL as the postgres account and reads its telemetry as root"
              + (", and installs Debian's postgresql (tools/install-deps.sh postgresql)" if missing else ""))
    r = subprocess.run([str(ROOT / "tools" / "install-deps.sh"), "postgresql"], capture_output=True, text=True,
                       timeout=scaled(900))
    assert r.returncode == 0, f"tools/install-deps.sh postgresql failed ({r.returncode}):\n{r.stdout}{r.stderr}"
    for tool in ("initdb", "postgres", "pg_ctl", "pgbench", "psql"):
        assert (PG_BIN / tool).exists(), f"{PG_BIN / tool} missing after tools/install-deps.sh postgresql"
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        pytest.fail("Debian's postgresql package made no `postgres` account")
    return pw.pw_uid, pw.pw_gid


def children(pid):
    """Pids whose parent is pid (postgres's processes are children of the postmaster)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if int(data[data.rindex(b")") + 2:].split()[1]) == pid:
                out.append(int(d))
    return out


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class Postgres:
    """A cluster in a temporary directory, hakmem preloaded, telemetry in shm_dir."""

    def __init__(self, ids, lib, shm_dir):
        self.ids, self.lib, self.shm = ids, lib, shm_dir
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-pg-"))   # the socket's too: a short path
        os.chown(self.dir, *ids)
        self.data = self.dir / "data"
        self.logpath = self.dir / "server.log"
        self.pm = None
        self.log = None

    def as_postgres(self, *argv, timeout=60, env=None):
        p = as_user(self.ids, argv, env=env or clean_env(LC_ALL="C"), stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True)
        out, _ = p.communicate(timeout=scaled(timeout))
        assert p.returncode == 0, f"{' '.join(map(str, argv))} failed ({p.returncode}):\n{out}"
        return out

    def initdb(self):
        self.as_postgres(PG_BIN / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8",
                         "--locale=C", "--no-sync")

    def start(self):
        """The postmaster, preloaded, its own process group; returns once it accepts connections."""
        env = clean_env(LC_ALL="C", LD_PRELOAD=self.lib, HAKMEM_SHM_DIR=self.shm)
        self.log = open(self.logpath, "w")
        self.pm = as_user(self.ids, [PG_BIN / "postgres", "-D", self.data,
                                     "-c", "listen_addresses=", "-c", f"unix_socket_directories={self.dir}",
                                     "-c", "fsync=off", "-c", "synchronous_commit=off",
                                     "-c", "full_page_writes=off", "-c", "autovacuum=off",
                                     "-c", "update_process_title=on", "-c", "logging_collector=off"],
                          env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

        def ready():
            if self.pm.poll() is not None:
                return True
            try:   # what pg_ctl -w waits for: line 8 of postmaster.pid
                lines = (self.data / "postmaster.pid").read_text().splitlines()
            except OSError:
                return False
            return len(lines) >= 8 and lines[7].strip() == "ready"
        wait_for(ready, 30, f"postgres ready:\n{self.text()}")
        assert self.pm.poll() is None, f"postgres exited at start ({self.pm.returncode}):\n{self.text()}"

    def text(self):
        try:
            return self.logpath.read_text(errors="replace")
        except OSError:
            return ""

    def client_env(self):
        return clean_env(LC_ALL="C", PGHOST=str(self.dir), PGUSER="postgres", PGDATABASE="postgres")

    def psql(self, sql):
        r = subprocess.run([PG_BIN / "psql", "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql],
                           env=self.client_env(), capture_output=True, text=True, timeout=scaled(30))
        assert r.returncode == 0, f"psql {sql!r} failed ({r.returncode}): {r.stderr}"
        return r.stdout.strip()

    def pgbench(self, *args):
        return subprocess.Popen([PG_BIN / "pgbench", *map(str, args)], env=self.client_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def backends(self):
        """The client backends serving connections (process titles of the
        postmaster's children: "postgres: USER DB [local] STATE")."""
        return sorted(p for p in children(self.pm.pid) if cmdline(p).startswith("postgres: postgres postgres [local]"))

    def stop(self):
        """pg_ctl stop (fast: backends end, every process exits normally);
        whatever is still alive after it is killed. Safe to call twice."""
        if self.pm is None:
            return
        if self.pm.poll() is None:
            try:
                p = as_user(self.ids, [PG_BIN / "pg_ctl", "stop", "-D", self.data, "-m", "fast", "-w", "-t",
                                       int(scaled(30))], env=clean_env(LC_ALL="C"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
                p.wait(scaled(40))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            try:
                self.pm.wait(scaled(10))
            except subprocess.TimeoutExpired:
                pass
        if self.pm.poll() is None:
            # Each child of the postmaster leads a process group of its own
            # (setsid in InitPostmasterChild): the postmaster's group and each of theirs.
            left = children(self.pm.pid)
            for pgid in [self.pm.pid, *left]:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except OSError:
                    pass
            self.pm.wait()
        if self.log is not None:
            self.log.close()
            self.log = None

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- the backends' telemetry files ---------------------------------------------------
class Backend:
    """One backend's telemetry file, read while pgbench runs: when each
    snapshot version appeared in it (learnd wrote it), and when the header's
    applied version reached it, with the policy then in force."""

    def __init__(self, pid, shm):
        self.pid, self.shm = pid, shm
        self.start = proc_start_time(pid)
        self.ring = None
        self.file_at = None
        self.published = {}      # snapshot version -> (when first seen written, its knobs)
        self.applied = []        # (when, applied snapshot version, policy in force), at each change
        self.status = None
        self.error = None

    def poll(self, now):
        if self.ring is None:
            path = self.shm / f"{self.pid}-{self.start}"
            try:
                with open(path, "rb") as f:
                    if f.read(8) != b"HKRING01":
                        return
                self.ring = Ring(str(path))
            except (OSError, RingError):
                return
            self.file_at = now
        try:
            v = self.ring.published_version()
            if v and v not in self.published:
                # The slot learnd filled for v (it fills slot v % 2, then the word).
                snap = Ring.slot_to_policy(self.ring._slot_bytes(v % 2)[1])
                self.published[v] = (now, snap if snap["version"] == v else None)
            self.status = self.ring.status()
            applied = self.status["applied_version"]
            if not self.applied or self.applied[-1][1] != applied:
                self.applied.append((now, applied, self.ring.policy_in_force(timeout=0.05)))
        except RingError as e:   # the backend ended and removed its file
            self.error = str(e)

    def late(self, deadline, t0, t_end):
        """What was not taken up within `deadline` of being written, in words.
        Snapshots written less than that before t_end are not judged."""
        out = []
        if self.file_at is None:
            return [f"backend {self.pid} never made a telemetry file"]
        for v, (t, snap) in sorted(self.published.items()):
            if t > t_end - deadline:
                continue
            got = next(((at, a, pol) for at, a, pol in self.applied if a >= v), None)
            if got is None:
                out.append(f"backend {self.pid}: snapshot v{v} written at {t - t0:.2f}s, never applied")
            elif got[0] - t > deadline:
                out.append(f"backend {self.pid}: snapshot v{v} written at {t - t0:.2f}s, applied "
                           f"{got[0] - t:.2f} s later")
            elif got[1] == v and snap is not None and {**got[2], "version": 0} != {**snap, "version": 0}:
                out.append(f"backend {self.pid}: snapshot v{v} applied, but the policy in force differs from it")
        return out

    def judged(self, deadline, t_end):
        return sum(1 for t, _ in self.published.values() if t <= t_end - deadline)

    def close(self):
        if self.ring is not None:
            self.ring.close()

    def describe(self, t0):
        def rel(t):
            return f"{t - t0:.2f}s"
        pub = ", ".join(f"v{v}@{rel(t)}" for v, (t, _) in sorted(self.published.items())) or "none"
        app = ", ".join(f"v{a}@{rel(t)}" for t, a, _ in self.applied) or "never read"
        return (f"backend {self.pid}: telemetry file {'at ' + rel(self.file_at) if self.file_at else 'never made'}; "
                f"snapshots written {pub}; applied {app}; header {self.status}"
                + (f"; {self.error}" if self.error else ""))


def others_line(shm, name, t, title, t0):
    """A telemetry file of a postgres process that serves no pgbench client, in words."""
    try:
        with Ring(str(shm / name)) as r:
            st = f"snapshot v{r.published_version()} written, header {r.status()}"
    except RingError as e:
        st = str(e)
    return f"{name} ({title or 'gone'}): file at {t - t0:.2f}s, {st}"


def postgres_events(log):
    """learnd's log lines about postgres."""
    return [ln for ln in log.splitlines() if re.search(r"\bpostgres\b", ln)]


@pytest.fixture
def stack(pg_user, request, shared_shm, tmp_path):
    """learnd over a private telemetry directory, and a preloaded cluster
    publishing there; both stopped at teardown whatever happened."""
    bindir = request.getfixturevalue("public_bin")
    # --no-screen: under test is how fast every backend takes up a candidate;
    # screening would put the first one late, or none if the replay ranks
    # nothing above the default (test_learnd.py covers screening).
    d = Learnd(tmp_path / "learnd", "--learner", "gp", "--no-screen", shm=shared_shm, period=PERIOD,
               wait_ready=False)
    pg = None
    try:
        pg = Postgres(pg_user, str(bindir / LIB.name), shared_shm)
        pg.initdb()        # while learnd loads
        wait_for(lambda: "ready:" in d.text() or d.proc.poll() is not None, 30, "learnd ready")
        assert d.proc.poll() is None, f"learnd exited at start:\n{d.text()}"
        # learnd first: the processes make their files only under its lease.
        pg.start()
        yield d, pg
    finally:
        if pg is not None:
            pg.cleanup()
        if d.proc.poll() is None:
            d.stop()
        else:
            d.log.close()


def test_every_backend_takes_up_learnds_candidate_within_a_second(stack):
    d, pg = stack
    shm = pathlib.Path(d.shm)

    # (a) pgbench's tables, then its run, checked below.
    init = subprocess.run([PG_BIN / "pgbench", "-i", "-s", "1", "-q"], env=pg.client_env(),
                          capture_output=True, text=True, timeout=scaled(60))
    assert init.returncode == 0, f"pgbench -i failed:\n{init.stderr}\n{pg.text()}"
    bench = pg.pgbench("-c", CLIENTS, "-j", 2, "-T", RUN_S, "-n")
    t0 = time.monotonic()
    backends, seen = {}, {}      # seen: every telemetry file -> (when it appeared, its process's title)
    try:
        try:
            pids = wait_for(lambda: (lambda b: len(b) == CLIENTS and b)(pg.backends()), 15,
                            f"{CLIENTS} backends serving pgbench")
        except AssertionError as e:
            raise AssertionError(f"{e}; the postmaster's children: {[cmdline(p) for p in children(pg.pm.pid)]}"
                                 f"\n{pg.text()[-3000:]}") from None
        backends = {pid: Backend(pid, shm) for pid in pids}
        # (b) Every backend's file, read until pgbench ends: each snapshot
        # version learnd writes, and when the policy in force reaches it.
        while bench.poll() is None:
            now = time.monotonic()
            for b in backends.values():
                b.poll(now)
            for name in telemetry_files(shm):
                if name not in seen and re.fullmatch(r"\d+-\d+", name):
                    seen[name] = (now, cmdline(int(name.split("-")[0])))
            time.sleep(POLL_S)
        t_end = time.monotonic()
        others = [others_line(shm, name, t, title, t0) for name, (t, title) in sorted(seen.items())
                  if int(name.split("-")[0]) not in backends]
        out, err = bench.communicate(timeout=scaled(30))
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for b in backends.values():
            b.close()

    # (a) pgbench succeeded, and its TPC-B ledger balances: every
    # transaction's delta is in the account, its teller, its branch and
    # the history, once.
    assert bench.returncode == 0, f"pgbench failed ({bench.returncode}):\n{out}\n{err}\n{pg.text()[-3000:]}"
    done = int(re.search(r"number of transactions actually processed: (\d+)", out).group(1))
    failed = int(re.search(r"number of failed transactions: (\d+)", out).group(1))
    assert done > 0 and failed == 0, out
    sums = pg.psql("SELECT (SELECT sum(abalance) FROM pgbench_accounts), (SELECT sum(tbalance) FROM pgbench_tellers), "
                   "(SELECT sum(bbalance) FROM pgbench_branches), (SELECT coalesce(sum(delta), 0) "
                   "FROM pgbench_history), (SELECT count(*) FROM pgbench_history)").split("|")
    assert len(set(sums[:4])) == 1 and int(sums[4]) == done, f"ledger out of balance: {sums}, {done} transactions"
    assert "hakmem:" not in pg.text(), f"the allocator complained:\n{pg.text()[-3000:]}"
    assert "terminated by signal" not in pg.text(), pg.text()[-3000:]

    # Stopped: every postgres process exits normally and removes its
    # telemetry file (learnd removes what a killed one leaves).
    pg.stop()
    try:
        wait_for(lambda: not telemetry_files(shm), 2, "the postgres processes' telemetry files to go")
        left = []
    except AssertionError:
        left = [f"telemetry files left after postgres stopped: {telemetry_files(shm)}"]
    assert d.stop() == 0, d.text()[-3000:]
    log = d.text()
    report = "\n".join([*(b.describe(t0) for b in backends.values()), "other postgres processes publishing:",
                        *others, "learnd:", *postgres_events(log)[-40:]])

    # (b) learnd wrote candidates for postgres, and each backend took up
    # every snapshot written to it within APPLY_S. Snapshots written less
    # than APPLY_S before pgbench ended are not judged: their backend was
    # leaving.
    problems = [] if re.search(r"policy_applied postgres\b", log) else ["learnd proposed no candidate for postgres"]
    problems += [ln for b in backends.values() for ln in b.late(scaled(APPLY_S), t0, t_end)]
    problems += [f"backend {b.pid}: learnd wrote no snapshot to it in time to judge" for b in backends.values()
                 if b.file_at is not None and not b.judged(scaled(APPLY_S), t_end)]
    # (c) learnd never gave up on postgres for not applying its candidate
    # (nor saw a snapshot rejected).
    problems += [ln for ln in postgres_events(log) if "did not apply" in ln or "rejected snapshot" in ln]
    # ... and kept measuring them under its policies: a window counts for a
    # policy only when every process of the program had applied it before the
    # window began (daemon.py, sample), so a change costs a window or two,
    # and a process that never takes a policy up leaves every window after
    # it unmeasured, the trial in progress stuck, silently.
    for b in backends.values():
        ids = [r[0] for r in db_rows(d.db, "SELECT w.policy_id FROM windows w JOIN processes p ON p.id = w.process_id "
                                           "WHERE p.pid = ? AND p.start_time = ? ORDER BY w.t_start", b.pid, b.start)]
        run = longest = 0
        for pol in ids[1:-1]:          # the first and last windows are cut by the backend's start and end
            run = run + 1 if pol is None else 0
            longest = max(longest, run)
        if longest > UNMEASURED_MAX:
            problems.append(f"backend {b.pid}: learnd measured none of {longest} windows in a row "
                            f"(of {len(ids)}; at most {UNMEASURED_MAX} expected): no policy was in force in every "
                            f"process of postgres")
    problems += left
    assert not problems, "\n".join(problems) + "\n---\n" + report
    assert telemetry_files(shm) == [], telemetry_files(shm)
    print(report)          # what happened, for the record (pytest -rP shows it)
