"""A real service on hakmem, operated as in production (issue 17): Debian's
redis-server, preloaded with hakmem, under redis-benchmark load, with
hakmem-learnd tuning it and serving metrics.

It proves: redis answers correctly under hakmem (values of every size class
read back byte for byte, counters and lists exact, no error reply, redis-
benchmark clean); learnd stores a learned policy for redis-server and redis's
allocator has exactly that policy in force; the metrics endpoint shows
redis's measurements to a real HTTP client, in a format prometheus-client's
parser reads; and when everything is stopped, nothing is left in the
telemetry and run directories but learnd's lock files.

Private places, as test_postgres.py: redis runs as Debian's `redis` account
in a temporary directory, on a unix socket there only (--port 0: no TCP),
without persistence (--save '' --appendonly no); learnd's database, sockets
and log are under tmp_path; the telemetry directory is a root-owned 1777 one
of its own. Debian's redis-server and redis-tools are installed when missing
(tools/install-deps.sh redis)."""
import hashlib
import json
import os
import pathlib
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import urllib.request

import pytest

from conftest import HAKMEM, LIB, ROOT, as_user, clean_env, need_root, scaled, wait_for
from test_learnd import Learnd, db_rows, telemetry_files

from prometheus_client.parser import text_string_to_metric_families

from hakmem.knobs import Knobs
from hakmem.ring import Ring, RingError

REDIS = "/usr/bin/redis-server"
BENCH = "/usr/bin/redis-benchmark"
# What learnd calls it: the executable the kernel runs (Debian's redis-server
# is a link to redis-check-rdb, one binary that acts on its argv[0]). Set by
# the redis_user fixture once redis is installed: resolved at import, on a
# machine where the fixture installs it, the link did not exist yet and the
# name stayed redis-server.
PROGRAM = None
PERIOD = 0.5


# ---- a minimal RESP client: the answers are checked byte for byte ---------------------
class Resp:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(scaled(10))
        self.s.connect(str(path))
        self.f = self.s.makefile("rb")

    @staticmethod
    def encode(*args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        return b"".join(out)

    def read(self):
        line = self.f.readline()
        if not line.endswith(b"\r\n"):
            raise AssertionError(f"redis closed the connection ({line!r})")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise AssertionError(f"redis answered an error: {rest.decode()}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise AssertionError(f"bad RESP line {line!r}")

    def pipeline(self, cmds):
        """Every command sent at once, every answer read in order."""
        self.s.sendall(b"".join(self.encode(*c) for c in cmds))
        return [self.read() for _ in cmds]

    def __call__(self, *args):
        return self.pipeline([args])[0]

    def close(self):
        self.f.close()
        self.s.close()


class Redis:
    """redis-server in a temporary directory, as ids, hakmem preloaded."""

    def __init__(self, ids, lib, shm):
        self.ids = ids
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-redis-"))
        os.chown(self.dir, *ids)
        self.sock = self.dir / "redis.sock"
        self.logpath = self.dir / "redis.log"
        env = clean_env(LD_PRELOAD=lib, HAKMEM_SHM_DIR=str(shm))
        self.proc = as_user(ids, [REDIS, "--port", "0", "--unixsocket", self.sock, "--unixsocketperm", "700",
                                  "--save", "", "--appendonly", "no", "--dir", self.dir, "--logfile", self.logpath,
                                  "--daemonize", "no", "--io-threads", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: self.sock.exists() or self.proc.poll() is not None, 15, "redis's socket")
        assert self.proc.poll() is None, f"redis-server exited at start:\n{self.text()}"

    def text(self):
        try:
            return self.logpath.read_text(errors="replace")
        except OSError:
            return ""

    def client(self):
        return Resp(self.sock)

    def bench(self, *args, **kw):
        return subprocess.Popen([BENCH, "-s", str(self.sock), *map(str, args)], env=clean_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)

    def stop(self):
        """SHUTDOWN NOSAVE (redis exits normally: its telemetry file goes
        with it); a redis that does not is killed. Safe to call twice."""
        if self.proc.poll() is None:
            try:
                c = self.client()
                c.s.sendall(Resp.encode("SHUTDOWN", "NOSAVE"))
                c.close()
            except OSError:
                pass
            try:
                self.proc.wait(scaled(15))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def redis_user():
    need_root("runs redis-server as Debian's redis account, reads its telemetry as root"
              + ("" if os.path.exists(BENCH) else ", installs redis-server (tools/install-deps.sh redis)"))
    r = subprocess.run([str(ROOT / "tools" / "install-deps.sh"), "redis"], capture_output=True, text=True,
                       timeout=scaled(900))
    assert r.returncode == 0, f"tools/install-deps.sh redis failed ({r.returncode}):\n{r.stdout}{r.stderr}"
    assert os.path.exists(REDIS) and os.path.exists(BENCH), "redis-server/redis-benchmark missing after install"
    global PROGRAM
    PROGRAM = os.path.basename(os.path.realpath(REDIS))
    try:
        pw = pwd.getpwnam("redis")
    except KeyError:
        pytest.fail("Debian's redis-server package made no `redis` account")
    return pw.pw_uid, pw.pw_gid


def scrape(url):
    with urllib.request.urlopen(url, timeout=scaled(5)) as r:
        assert r.status == 200
        return list(text_string_to_metric_families(r.read().decode()))


def redis_policies(db):
    """(version, origin, Knobs) of every policy stored for redis-server."""
    rows = db_rows(db, "SELECT p.version, p.origin, p.knobs FROM policies p JOIN programs g ON g.id = p.program_id "
                       "WHERE g.exe = ? ORDER BY p.version", os.path.realpath(REDIS))
    return [(v, o, Knobs.of(json.loads(k))) for v, o, k in rows]


def check_answers(c, rnd, tag):
    """Values of every size from 1 byte to 256 KiB, set then read back
    (MGET), their digests compared; exact counters and lists. Keys under tag."""
    n0 = c("DBSIZE")
    sizes = [1, 7, 16, 24, 48, 64, 100, 128, 200, 500, 1000, 4000, 8192, 30000, 65536, 100_000, 262_144]
    vals = {f"{tag}:k:{i}": rnd.randbytes(rnd.choice(sizes)) for i in range(600)}
    assert c.pipeline([("SET", k, v) for k, v in vals.items()]) == ["OK"] * len(vals)
    keys = list(vals)
    got = c("MGET", *keys)
    bad = [k for k, g in zip(keys, got) if g is None or hashlib.sha256(g).digest() != hashlib.sha256(vals[k]).digest()]
    assert not bad, f"{len(bad)} values read back differ, first {bad[:5]}"
    assert c.pipeline([("INCR", f"{tag}:counter")] * 1000)[-1] == 1000
    items = [rnd.randbytes(rnd.randint(1, 300)) for _ in range(2000)]
    c.pipeline([("RPUSH", f"{tag}:list", x) for x in items])
    assert c("LRANGE", f"{tag}:list", 0, -1) == items
    assert c("DEL", *keys[::2]) == len(keys[::2])
    assert c("DBSIZE") == n0 + len(keys) - len(keys[::2]) + 2


def test_redis_under_load_tuned_by_learnd_with_metrics(redis_user, shared_shm, public_bin, tmp_path):
    # --no-screen: what is under test is a policy's way into redis's allocator,
    # and redis's replay ranks nothing above the default (screening would
    # settle on it); test_learnd.py covers screening.
    d = Learnd(tmp_path / "learnd", "--learner", "gp", "--no-screen", "--metrics", "127.0.0.1:0", shm=shared_shm,
               period=PERIOD)
    redis = load = None
    try:
        url = wait_for(lambda: re.search(r"metrics (http://\S+/metrics)", d.text()), 10, "the metrics URL").group(1)
        redis = Redis(redis_user, str(public_bin / LIB.name), shared_shm)
        c = redis.client()
        assert c("PING") == "PONG"
        rnd = random.Random(17)
        check_answers(c, rnd, "before")

        # redis-benchmark, checked: every test ran and reported a rate, no error.
        b = redis.bench("-c", 8, "-n", 20000, "-t", "set,get,incr,lpush,rpop,sadd,hset,lrange_100", "-d", 256,
                        "-r", 10000, "--csv")
        out, err = b.communicate(timeout=scaled(60))
        assert b.returncode == 0 and "rror" not in err + out, f"redis-benchmark failed ({b.returncode}):\n{out}\n{err}"
        rows = {ln.split(",")[0].strip('"'): float(ln.split(",")[1].strip('"'))
                for ln in out.splitlines()[1:] if ln.strip()}
        want = {"SET", "GET", "INCR", "LPUSH", "RPOP", "SADD", "HSET", "LRANGE_100 (first 100 elements)"}
        assert want <= set(rows) and all(v > 0 for v in rows.values()), out

        # Load while learnd tunes: a policy for redis-server stored, and in
        # force in redis's allocator (applied, and the very knobs stored).
        load = redis.bench("-c", 4, "-n", 10_000_000, "-t", "set,get,lpush,lpop", "-d", 512, "-r", 50000, "-q", "-l")
        # <pid>-<start>, not <pid>-<start>.trace-N (learnd's screening capture).
        ring_file = wait_for(lambda: next((p for p in pathlib.Path(shared_shm).glob(f"{redis.proc.pid}-*")
                                           if "." not in p.name), None), 10,
                             "redis's telemetry file")
        ring = Ring(str(ring_file))
        try:
            def learned_in_force():
                learned = [k for _, o, k in redis_policies(d.db) if o == "learned"]
                try:
                    pol = ring.policy_in_force(timeout=0.05)
                except RingError:
                    return None
                now = Knobs.of({k: v for k, v in pol.items() if k != "version"})
                return now if learned and any(now == k for k in learned) else None
            in_force = wait_for(learned_in_force, 40, lambda: "a learned redis-server policy stored and in force:\n"
                                + "\n".join(ln for ln in d.text().splitlines() if PROGRAM in ln)[-3000:])
            assert ring.status()["applied_version"] > 0
        finally:
            ring.close()
        assert re.search(rf"policy_applied {PROGRAM}\b", d.text()), d.text()[-2000:]   # /usr/bin/redis-server links to it

        # The CLI shows it: learnd's live answer.
        r = subprocess.run([*HAKMEM, "policy", "show", "redis-server", "--json", "--db", str(d.db), "--run-dir",
                            str(d.run)], capture_output=True, text=True, env=clean_env(), cwd=ROOT,
                           timeout=scaled(30))
        assert r.returncode == 0, r.stderr
        assert os.path.realpath(REDIS) in r.stdout, r.stdout

        # Metrics: redis's rates, memory and policy as a scraper sees them.
        def redis_metrics():
            # The series are made at each window's end: the one after the
            # policy was applied (screening puts the first trial late).
            fams = {f.name: f for f in scrape(url)}
            allocs = [s for s in fams["hakmem_process_counter_rate"].samples
                      if s.labels["program"] == PROGRAM and s.labels["counter"] == "allocs"]
            applied = [s for s in fams["hakmem_process_policy_applied_version"].samples
                       if s.labels["program"] == PROGRAM and s.value > 0]
            return fams if allocs and allocs[0].value > 0 and applied else None
        fams = wait_for(redis_metrics, 10, "redis-server's allocation rate and applied policy in the metrics")
        rss = [s for s in fams["hakmem_process_resident_bytes"].samples if s.labels["pid"] == str(redis.proc.pid)]
        assert rss and rss[0].value > 1e6, rss
        ver = [s for s in fams["hakmem_process_policy_applied_version"].samples
               if s.labels["program"] == PROGRAM]
        assert ver and ver[0].value > 0, ver
        assert any(s.labels["program"] == PROGRAM and s.value >= 1
                   for s in fams["hakmem_program_policy_changes"].samples), fams["hakmem_program_policy_changes"]
        assert in_force is not None

        # Still correct after being tuned under load.
        # redis-benchmark -l has been seen to outlive a SIGINT by 15 s (CI,
        # the mutants' baseline run): what is checked is the server, below.
        load.send_signal(signal.SIGINT)
        try:
            load.communicate(timeout=scaled(15))
        except subprocess.TimeoutExpired:
            load.kill()
            load.communicate()
        check_answers(c, rnd, "tuned")
        stats = c("INFO", "stats").decode()
        assert re.search(r"^total_error_replies:0\r?$", stats, re.M), stats
        c.close()
        assert "hakmem:" not in redis.text(), redis.text()[-2000:]
    finally:
        if load is not None and load.poll() is None:
            load.kill()
            load.communicate()
        rc = redis.stop() if redis is not None else None
        if redis is not None:
            redis.cleanup()
        # learnd removes what the processes it tracked leave; then it stops.
        left_shm = None
        try:
            wait_for(lambda: not telemetry_files(pathlib.Path(shared_shm)), 5, "redis's telemetry file to go")
        except AssertionError:
            left_shm = telemetry_files(pathlib.Path(shared_shm))
        stopped = d.stop() if d.proc.poll() is None else d.proc.returncode
    assert rc == 0, f"redis-server exited {rc}"
    assert stopped == 0, d.text()[-3000:]
    assert left_shm is None, f"left in the telemetry directory: {left_shm}"
    assert sorted(os.listdir(d.run)) in ([], ["learnd.lock"]), os.listdir(d.run)
    assert sorted(os.listdir(shared_shm)) in ([], ["learnd.lock"]), os.listdir(shared_shm)
    assert not [ln for ln in d.text().splitlines() if PROGRAM in ln and ("did not apply" in ln or "rejected" in ln)]
