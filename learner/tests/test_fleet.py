"""The fleet (fleet.py, schemas/fleet/): hosts sharing what they learn
through a real PostgreSQL, started here in a temporary directory as the
`postgres` account (pgcluster.py), each host a role of its own with a
password. learnd processes are real, each a host with its own telemetry
directory, SQLite file and role; simulated hosts push through the same
FleetDB.push learnd's worker uses.

Needs root: PostgreSQL runs as `postgres`, learnd reads root's workloads'
telemetry. Debian's postgresql is installed when missing
(tools/install-deps.sh postgresql)."""
import itertools
import json
import pathlib
import subprocess
import time

import pytest

from conftest import ROOT, WORKLOAD, clean_env, ring_path, scaled, start, wait_for
from pgcluster import Cluster
from test_learnd import CLS64, Learnd, db_rows, finish
from test_metrics import endpoint, samples, scrape
from test_postgres import pg_user   # noqa: F401  (the fixture: root, postgresql installed)
from hakmem import fleet as F
from hakmem.ring import Ring

CLASS = "c2-test"
_dbs = itertools.count(1)


@pytest.fixture(scope="module")
def cluster(pg_user):   # noqa: F811
    c = Cluster(pg_user).initdb().start()
    yield c
    c.cleanup()


class Fleet:
    """A fleet database of its own in the cluster, migrated, and its hosts."""

    def __init__(self, cluster, **settings):
        self.cluster = cluster
        self.name = f"fleet{next(_dbs)}"
        admin = F.FleetDB(cluster.url())
        admin._run(lambda cur: None)
        admin.conn.execute(f"CREATE DATABASE {self.name}")
        admin.close()
        self.owner = F.FleetDB(self.url(), settle_age_ms=0)
        self.owner.migrate(**settings)
        self.epochs = {}
        self.seqs = {}

    def url(self, host=None):
        if host is None:
            return self.cluster.url(db=self.name)
        return self.cluster.url(self.role(host), f"pw-{host}", db=self.name)

    @staticmethod
    def role(host):
        return "hakmem_host_" + host.lower().replace("-", "_").replace(".", "_")

    def host(self, name, klass=CLASS):
        """A host: its role and row, and one empty push (its class known)."""
        self.owner.add_host(name, f"pw-{name}")
        db = F.FleetDB(self.url(name), settle_age_ms=0)
        db.push(f"epoch-{name}", [], klass, "test")
        return db

    def verdict(self, db, host, knobs, vs, source="local", program=("build1", "work", "0"), rel=0.9, klass=CLASS):
        """One evaluation of knobs against the default, as learnd queues it."""
        seq = self.seqs[host] = self.seqs.get(host, 0) + 1
        default = {"drain_ms": 1000}
        verdict = {"better": "accepted", "within": "rejected", "worse": "rolled_back"}[vs]
        body = {"program": dict(zip(("build_id", "exe_name", "users"), program)), "knobs": knobs,
                "baseline_knobs": default, "verdict": verdict, "source": source, "windows": 8,
                "cost_mean": rel, "cost_sd": 0.01, "baseline_cost": 1.0, "objective": "lambda=0.5", "learner": "gp",
                "t_start": time.time() - 10, "t_end": time.time(),
                "vs_default": {"knobs": knobs, "verdict": vs, "rel": rel}}
        return db.push(f"epoch-{host}", [(seq, "evaluation", body)], klass, "test")

    def offers(self, db, klass=CLASS):
        return {k[1]: (o.knobs, o.stage) for k, o in db.offers(klass).items()}

    def close(self):
        self.owner.close()


@pytest.fixture
def fleet(cluster):
    made = []

    def make(**settings):
        f = Fleet(cluster, **settings)
        made.append(f)
        return f
    yield make
    for f in made:
        f.close()


X = {"drain_ms": 50}
Y = {"drain_ms": 7}


# ---- the schema ----------------------------------------------------------------------
def test_migrations_from_an_empty_database_and_from_each_earlier_version(cluster, tmp_path):
    known = F.migrations()
    for upto in range(0, len(known) + 1):
        name = f"mig{next(_dbs)}"
        F.FleetDB(cluster.url()).conn.execute(f"CREATE DATABASE {name}")
        db = F.FleetDB(cluster.url(db=name))
        part = tmp_path / f"upto{upto}"
        part.mkdir()
        for f in sorted(F.SCHEMA_DIR.iterdir(), key=lambda p: p.name)[:upto]:
            (part / f.name).write_text(f.read_text())
        if upto:
            assert db.migrate(directory=part) == (0, upto)
        assert db.migrate() == (upto, len(known))
        assert db.migrate() == (len(known), len(known))          # again: nothing to do
        assert db.version() == len(known)
        db.check_version()
        db.close()
    # A database newer than this hakmem is refused, never "downgraded".
    db = F.FleetDB(cluster.url(db=name))
    db.conn.execute("INSERT INTO hakmem.schema_migrations (version, name) VALUES (%s, 'future')", (len(known) + 1,))
    with pytest.raises(F.FleetError, match="newer than this hakmem"):
        db.migrate()
    with pytest.raises(F.FleetError, match="newer than this hakmem"):
        db.check_version()
    db.close()


def test_the_cli_migrates_adds_hosts_and_reports_as_json(cluster, tmp_path):
    name = f"cli{next(_dbs)}"
    F.FleetDB(cluster.url()).conn.execute(f"CREATE DATABASE {name}")
    url = cluster.url(db=name)
    hk = [str(ROOT / ".venv" / "bin" / "hakmem"), "fleet"]

    def run(*a, ok=True):
        r = subprocess.run([*hk, *a], capture_output=True, text=True, timeout=scaled(30), env=clean_env())
        assert (r.returncode == 0) == ok, (a, r.returncode, r.stdout, r.stderr)
        return r
    out = json.loads(run("migrate", "--url", url, "--k", "2", "--canary", "0.25", "--json").stdout)
    assert out["version"] == len(F.migrations()) and out["settings"]["k"] == 2
    assert "postgres@" in out["url"]
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    out = json.loads(run("add-host", "web-1", "--url", url, "--password-file", str(pw), "--json").stdout)
    assert out["role"] == "hakmem_host_web_1"
    host = F.FleetDB(cluster.url("hakmem_host_web_1", "s3cret", db=name))
    assert host.me() == "web-1"
    # A host reads what every host may read, and writes none of the owner's.
    st = json.loads(run("status", "--url", cluster.url("hakmem_host_web_1", "s3cret", db=name), "--json").stdout)
    assert st["hosts"] == 1 and st["settings"]["canary_fraction"] == 0.25
    r = run("migrate", "--url", cluster.url("hakmem_host_web_1", "s3cret", db=name), "--k", "1", ok=False)
    assert r.stderr.startswith("hakmem: error: ") and r.stderr.count("\n") == 1, r.stderr
    r = run("status", "--url", cluster.url("hakmem_host_web_1", "wrong", db=name), ok=False)
    assert "password authentication failed" in r.stderr and "wrong" not in r.stderr, r.stderr
    r = run("status", ok=False)
    assert r.returncode == 2 and "no fleet database" in r.stderr
    hosts = json.loads(run("hosts", "--url", url, "--json").stdout)
    assert [h["host"] for h in hosts] == ["web-1"]
    assert "web-1" in run("hosts", "--url", url).stdout
    run("exclude", "web-1", "--url", url, "--why", "drill")
    assert json.loads(run("hosts", "--url", url, "--json").stdout)[0]["excluded_why"] == "drill"
    run("include", "web-1", "--url", url)
    assert run("exclude", "nobody", "--url", url, ok=False).stderr.strip() == "hakmem: error: no fleet host 'nobody'"
    assert "1 hosts (0 excluded), 0 programs" in run("status", "--url", url).stdout
    assert run("programs", "--url", url).stdout.strip() == "no programs yet"
    assert "no fleet program 'work'" in run("policy", "work", "--url", url, ok=False).stderr
    # One host's verdict: evidence, short of k = 2.
    f = Fleet.__new__(Fleet)
    f.seqs = {}
    f.verdict(host, "web-1", X, "better")
    assert "work" in run("programs", "--url", url).stdout
    out = run("policy", "work", "--url", url).stdout
    assert "evidence: 1 hosts better (median -10.0%), 0 worse" in out and '{"drain_ms":50}' in out, out
    assert json.loads(run("policy", "work", "--url", url, "--json").stdout)[0]["stage"] == "evidence"
    host.close()


# ---- trust ---------------------------------------------------------------------------
def test_a_host_writes_only_its_own_rows(fleet):
    f = fleet(k=1, canary=0.0)
    a, b = f.host("a"), f.host("b")
    assert f.verdict(a, "a", X, "better") == 1
    # b speaking for a: refused by row-level security, whatever the statement.
    for stmt in ("INSERT INTO hakmem.evaluations (host_id, epoch, seq, program_id, knobs, verdict, source, windows, "
                 "cost_mean, objective, learner, t_start, t_end) VALUES ('a', 'e', 99, 1, '{}', 'accepted', 'local', "
                 "1, 1, 'x', 'gp', now(), now())",
                 "INSERT INTO hakmem.verdicts VALUES ('a', 1, '{\"drain_ms\": 3}', 'local', 'better', 0.5, 9, now())",
                 "UPDATE hakmem.settings SET value = 1",
                 "UPDATE hakmem.hosts SET excluded = now() WHERE host_id = 'a'",
                 "INSERT INTO hakmem.hosts (host_id, role) VALUES ('c', current_user)",
                 "DELETE FROM hakmem.verdicts"):
        with pytest.raises(F.FleetError, match="row-level security|permission denied"):
            b._run(lambda cur, s=stmt: cur.execute(s))
    # An update that names a's rows finds none of them.
    assert b._run(lambda cur: (cur.execute("UPDATE hakmem.verdicts SET vs_default = 'worse'"), cur.rowcount)[1]) == 0
    assert b._run(lambda cur: (cur.execute("UPDATE hakmem.hosts SET version = 'x' WHERE host_id = 'a'"),
                               cur.rowcount)[1]) == 0
    assert f.offers(b) == {"work": (X, "offered")}
    # A role that is no host pushes nothing.
    f.owner.conn.execute("CREATE ROLE stranger LOGIN PASSWORD 'pw-stranger' IN ROLE hakmem_host")
    s = F.FleetDB(f.cluster.url("stranger", "pw-stranger", db=f.name))
    with pytest.raises(F.FleetError, match="no fleet host"):
        s.push("e", [], CLASS, "test")
    with pytest.raises(F.FleetError, match="no fleet host"):
        s.me()


def test_a_push_sent_twice_counts_once(fleet):
    f = fleet(k=1, canary=0.0)
    a = f.host("a")
    body = {"program": {"build_id": "b", "exe_name": "w", "users": "0"}, "knobs": X, "baseline_knobs": {"drain_ms": 1},
            "verdict": "accepted", "source": "local", "windows": 8, "cost_mean": 0.8, "cost_sd": 0.1,
            "baseline_cost": 1.0, "objective": "lambda=0.5", "learner": "gp", "t_start": 1e9, "t_end": 1e9 + 5,
            "vs_default": {"knobs": X, "verdict": "better", "rel": 0.8}}
    rows = [(1, "evaluation", body), (2, "evaluation", dict(body, verdict="measured", vs_default=None)),
            (3, "best", {"program": body["program"], "knobs": X, "origin": "learned", "t": 1e9 + 5})]
    assert a.push("e1", rows, CLASS, "t") == 2
    assert a.push("e1", rows, CLASS, "t") == 0          # a lost reply, sent again
    assert a.push("e1", rows[1:], CLASS, "t") == 0
    assert a.push("e2", rows[:1], CLASS, "t") == 1      # a new SQLite file: a new epoch
    n = f.owner._run(lambda cur: (cur.execute("SELECT count(*), count(DISTINCT (epoch, seq)) FROM "
                                              "hakmem.evaluations"), cur.fetchone())[1])
    assert n == (3, 3)
    assert f.owner._run(lambda cur: (cur.execute("SELECT count(*) FROM hakmem.verdicts"), cur.fetchone())[1]) == (1,)
    assert f.owner._run(lambda cur: (cur.execute("SELECT knobs FROM hakmem.host_best"), cur.fetchall())[1]) == [(X,)]


def test_k_hosts_must_agree_and_one_poisoned_host_moves_nobody(fleet):
    f = fleet(k=3, canary=0.0)
    hosts = {h: f.host(h) for h in ("a", "b", "c", "d", "m")}
    m = hosts["m"]
    # The poisoned host votes for its policy as often as it likes: one host,
    # one vote per policy, and nothing it says reaches another host.
    for _ in range(5):
        f.verdict(m, "m", Y, "better", rel=0.01)
    f.verdict(m, "m", {"drain_ms": 10**9}, "better", rel=0.01)    # out of bounds too
    assert f.offers(hosts["d"]) == {}
    # Two honest hosts are not k = 3 ...
    f.verdict(hosts["a"], "a", X, "better")
    f.verdict(hosts["b"], "b", X, "better")
    assert f.offers(hosts["d"]) == {}
    assert {(r["knobs"]["drain_ms"], r["stage"]) for r in f.owner.policy("work")} == \
        {(50, "evidence"), (7, "evidence"), (10**9, "evidence")}
    # ... three are.
    f.verdict(hosts["c"], "c", X, "better")
    assert f.offers(hosts["d"]) == {"work": (X, "offered")}
    # Against X, m's verdicts weigh one host each: its own search "worse",
    # and a fleet trial it ran outside the canaries (there are none here).
    f.verdict(m, "m", X, "worse")
    f.verdict(m, "m", X, "worse", source="fleet")
    assert f.offers(hosts["d"]) == {"work": (X, "offered")}
    # m disagrees with the others everywhere: an outlier, which the owner sees.
    for prog in (("build2", "two", "0"), ("build3", "three", "0")):
        for h in ("a", "b", "c"):
            f.verdict(hosts[h], h, X, "better", program=prog)
        f.verdict(m, "m", X, "worse", program=prog)
    table = {h["host"]: h for h in f.owner.hosts()}
    assert table["m"]["outlier"] and table["m"]["disagree"] == 3, table["m"]
    assert not any(table[h]["outlier"] for h in "abcd"), table
    # Excluded, its rows count for nothing: it is not one of three.
    f.owner.exclude("m", "outlier")
    f.owner.exclude("c", "drill")
    assert f.offers(hosts["d"]) == {}
    f.owner.exclude("c", None, exclude=False)
    assert f.offers(hosts["d"]) == {"work": (X, "offered"), "two": (X, "offered"), "three": (X, "offered")}


def test_canaries_first_then_everyone_and_a_canary_rollback_stops_it(fleet):
    f = fleet(k=2, canary=0.5)
    names = [f"h{i}" for i in range(6)]
    hosts = {h: f.host(h) for h in names}
    f.verdict(hosts["h0"], "h0", X, "better")
    f.verdict(hosts["h1"], "h1", X, "better")
    # The canaries: half of the four hosts that did not find X, by md5.
    canaries = F.canary_order(names[2:])[:2]
    others = [h for h in names[2:] if h not in canaries]
    for h in canaries:
        assert f.offers(hosts[h]) == {"work": (X, "canary")}
    for h in others:
        assert f.offers(hosts[h]) == {}
    # A canary kept it (the default did not beat it): everyone gets it.
    f.verdict(hosts[canaries[0]], canaries[0], X, "within", source="fleet")
    for h in others:
        assert f.offers(hosts[h]) == {"work": (X, "offered")}
    # A host outside the canaries that finds it worse stops nothing ...
    f.verdict(hosts[others[0]], others[0], X, "worse", source="fleet")
    assert f.offers(hosts[others[1]]) == {"work": (X, "offered")}
    # ... a canary that rolls it back stops it everywhere.
    f.verdict(hosts[canaries[1]], canaries[1], X, "worse", source="fleet")
    for h in names:
        assert f.offers(hosts[h]) == {}
    assert [r["stage"] for r in f.owner.policy("work")] == ["stopped"]


def test_pools_evidence_only_within_a_hardware_class(fleet):
    f = fleet(k=1, canary=0.0)
    a, b = f.host("a"), f.host("b", klass="c64-m256")
    f.verdict(a, "a", X, "better")
    assert f.offers(a) == {"work": (X, "offered")}
    assert f.offers(b, klass="c64-m256") == {}


# ---- learnd as a host ------------------------------------------------------------------
def learnd_host(f, tmp_path, name, *extra):
    f.owner.add_host(name, f"pw-{name}")
    return Learnd(tmp_path / name, "--learner", "gp", "--fleet", f.url(name), "--fleet-pull", "0.5",
                  "--fleet-class", CLASS, *extra)


def pushed(f, host, where=""):
    """Evaluations of host in the fleet (a connection of its own: the database may have restarted)."""
    db = F.FleetDB(f.url())
    try:
        return db._run(lambda cur: (cur.execute(f"SELECT count(*) FROM hakmem.evaluations WHERE host_id = %s {where}",
                                                (host,)), cur.fetchone()[0])[1])
    finally:
        db.close()


def test_a_program_learned_on_host_a_starts_on_host_b_from_its_policy_within_a_second(fleet, tmp_path):
    f = fleet(k=1, canary=0.0)
    a = learnd_host(f, tmp_path, "a")
    try:
        w = start(["burst", 64, 4000, scaled(25)], a.shm)
        default_cap = Ring(ring_path(a.shm, w.pid)).policy_in_force()["tcache_cap"][CLS64]
        # A's own search finds a bigger 64-byte cache, and the fleet offers it.
        wait_for(lambda: any(o.knobs["tcache_cap"][CLS64] > default_cap
                             for o in F.FleetDB(f.url()).offers(CLASS).values()), 40,
                 lambda: f"an offered policy with a bigger 64-byte cache:\n{a.text()[-3000:]}")
        w.kill()
        w.wait()
    finally:
        assert a.stop() == 0, a.text()
    offer, = F.FleetDB(f.url()).offers(CLASS).values()
    assert "fleet: " in a.text() and "as host a" in a.text(), a.text()
    b = learnd_host(f, tmp_path, "b", "--metrics", "127.0.0.1:0")
    try:
        b.wait_log("as host b", 10)
        time.sleep(1.0)                   # two pulls: B holds the offer before the program starts
        t0 = time.monotonic()
        w = start(["burst", 64, 4000, scaled(20)], b.shm)
        path = ring_path(b.shm, w.pid)

        def applied():
            try:
                knobs = Ring(path).policy_in_force()
            except Exception:
                return None
            return knobs["tcache_cap"][CLS64] == offer.knobs["tcache_cap"][CLS64] and time.monotonic() - t0
        took = wait_for(applied, 5, lambda: f"the fleet's policy in force on host B:\n{b.text()[-3000:]}")
        print(f"host B: the fleet's policy in force {took:.3f} s after the program started")
        assert took < 1.0, took
        assert "fleet_start workload" in b.text(), b.text()
        assert "screened" not in b.text()          # the fleet's policy is tried, not a replay ranking
        # B's own A/B decides: the default against the fleet's policy, pushed as a fleet trial.
        wait_for(lambda: pushed(f, "b", "AND source = 'fleet' AND verdict <> 'measured'") > 0, 40,
                 lambda: f"host B's verdict on the fleet's policy in the fleet:\n{b.text()[-3000:]}")
        fams, _ = scrape(endpoint(b))
        assert samples(fams, "hakmem_fleet_up")[0].value == 1
        assert samples(fams, "hakmem_fleet_adopted_total")[0].value == 1
        assert samples(fams, "hakmem_fleet_offers")[0].value == 1
        assert samples(fams, "hakmem_fleet_pulls_total")[0].value >= 2
        assert samples(fams, "hakmem_fleet_pushed_evaluations_total")[0].value >= 1
        finish(w)
    finally:
        assert b.stop() == 0, b.text()
    # The bigger cache wins on B as on A: the default did not take over.
    best = json.loads(db_rows(b.db, "SELECT p.knobs FROM programs g JOIN policies p ON p.id = g.best_policy")[0][0])
    assert best["tcache_cap"][CLS64] == offer.knobs["tcache_cap"][CLS64], (best, b.text())
    assert db_rows(b.db, "SELECT note FROM policies WHERE note IS NOT NULL") == [("from the fleet",)]


def test_with_the_database_away_learnd_learns_on_and_pushes_everything_once_when_it_returns(fleet, tmp_path):
    f = fleet(k=3, canary=0.1)
    a = learnd_host(f, tmp_path, "a")
    try:
        w = start(["burst", 64, 4000, scaled(15)], a.shm)
        wait_for(lambda: pushed(f, "a") > 0, 20, lambda: f"a first push:\n{a.text()[-3000:]}")
        f.cluster.stop()
        windows0 = db_rows(a.db, "SELECT count(*) FROM windows")[0][0]
        # Learning goes on locally; what is not pushed waits in the outbox
        # (at the latest, what the learner hands over when the program ends).
        finish(w)
        a.wait_log("process_exited", 10)
        wait_for(lambda: db_rows(a.db, "SELECT count(*) FROM fleet_outbox")[0][0] >= 1, 10,
                 lambda: f"evaluations queued while the database is away:\n{a.text()[-3000:]}")
        assert db_rows(a.db, "SELECT count(*) FROM windows")[0][0] > windows0
        waiting = db_rows(a.db, "SELECT count(*) FROM fleet_outbox")[0][0]
        status = json.loads(subprocess.run([str(ROOT / ".venv" / "bin" / "hakmem"), "status", "--run-dir",
                                            str(a.run), "--json"], capture_output=True, text=True,
                                           timeout=scaled(30)).stdout)
        assert any("fleet unreachable" in x for x in status["status"]["warnings"]), status
        f.cluster.start()
        wait_for(lambda: db_rows(a.db, "SELECT count(*) FROM fleet_outbox")[0][0] == 0, 40,
                 lambda: f"the outbox pushed once the database is back:\n{a.text()[-3000:]}")
    finally:
        if f.cluster.pm is None:
            f.cluster.start()
        assert a.stop() == 0, a.text()
    # Nothing lost, nothing doubled: every evaluation learnd stored is in the
    # fleet once (the outbox took each in the transaction that stored it).
    local = db_rows(a.db, "SELECT count(*) FROM evaluations")[0][0]
    assert pushed(f, "a") == local, (pushed(f, "a"), local, waiting)
    log = a.text()
    # One line while it was away (a minute's worth), and one when it came back.
    assert log.count("fleet: push failed") + log.count("fleet: pull failed") == 1, log
    assert "reachable again" in log, log


@pytest.mark.parametrize("fault", ["not migrated", "wrong password"])
def test_a_database_not_migrated_or_refusing_the_role_is_said_once_and_learnd_learns_on(cluster, tmp_path, fault):
    f = Fleet(cluster, k=1)
    f.owner.add_host("a", "pw-a")
    if fault == "not migrated":
        name = f"bare{next(_dbs)}"
        F.FleetDB(cluster.url()).conn.execute(f"CREATE DATABASE {name}")
        url, why = cluster.url(Fleet.role("a"), "pw-a", db=name), "schema is version 0, this hakmem needs"
    else:
        url, why = cluster.url(Fleet.role("a"), "not-its-password", db=f.name), "password authentication failed"
    d = Learnd(tmp_path, "--learner", "gp", "--fleet", url, "--fleet-pull", "0.5", "--fleet-class", CLASS,
               "--metrics", "127.0.0.1:0")
    try:
        w = start(["burst", 64, 4000, scaled(4)], d.shm)
        d.wait_log("fleet: pull failed", 10)
        finish(w)
        d.wait_log("process_exited", 10)
        fams, _ = scrape(endpoint(d))
        assert samples(fams, "hakmem_fleet_up")[0].value == 0
        assert samples(fams, "hakmem_fleet_errors_total")[0].value >= 1
        assert samples(fams, "hakmem_fleet_pushed_evaluations_total")[0].value == 0
        wait_for(lambda: samples(scrape(endpoint(d))[0], "hakmem_fleet_backlog")[0].value > 0, 10,
                 "the outbox backlog in the metrics")
    finally:
        assert d.stop() == 0, d.text()
    log = d.text()
    assert why in log, log
    if fault == "not migrated":
        assert "its owner runs `hakmem fleet migrate`" in log, log
    assert "pw-a" not in log and "not-its-password" not in log
    assert log.count("fleet: pull failed") + log.count("fleet: push failed") == 1, log
    # What it could not push waits for the database.
    assert db_rows(d.db, "SELECT count(*) FROM fleet_outbox WHERE kind = 'evaluation'")[0][0] == \
        db_rows(d.db, "SELECT count(*) FROM evaluations")[0][0] > 0
    f.close()


def test_a_database_that_never_answers_costs_learnds_turn_nothing(tmp_path):
    """learnd never waits on the network: a server that takes the connection
    and never answers holds the worker thread for its connect timeout, while
    the daemon's turns stay as short as without a fleet, and the batches it
    hands over shrink after each failed push."""
    import socket
    from hakmem.store import Store

    sock_dir = tmp_path / "pg"
    sock_dir.mkdir()
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(sock_dir / ".s.PGSQL.5432"))
    silent.listen(64)                       # taken into the backlog, never accepted, never answered
    store = Store(tmp_path / "learn.db")
    for i in range(F.BATCH + 5):
        store.fleet_queue("evaluation", {"n": i}, "measured")
    logs = []
    link = F.FleetLink(f"postgresql://hakmem_host_a:secret@/fleet?host={sock_dir}", store,
                       lambda level, msg: logs.append((level, msg)), pull_every=1000, klass=CLASS)

    class Writes:
        def add(self, op):
            op(store)
    try:
        link._backoff = 0.0                 # try again at once: several failed pushes within the test
        worst, t_end = 0.0, time.monotonic() + scaled(8)
        while time.monotonic() < t_end and link.errors < 3:
            t0 = time.monotonic()
            link.turn(Writes())
            worst = max(worst, time.monotonic() - t0)
            link._backoff = min(link._backoff, 0.1)
            time.sleep(0.01)
        assert link.errors >= 2, (link.errors, logs)
        assert worst < 0.05, worst
        assert not link.up and "timeout" in link.last_error.lower(), link.last_error
        assert len([m for _, m in logs if m.startswith("fleet: ")]) == 1, logs     # one line a minute
        assert all("secret" not in m for _, m in logs)
        assert link._batch < F.BATCH, link._batch
        assert store.fleet_backlog() == F.BATCH + 5     # nothing lost
    finally:
        link.close(timeout=0.1)
        silent.close()
        store.close()


def test_the_outbox_gives_up_only_what_was_pushed_and_a_full_one_drops_plain_measurements_first(tmp_path):
    from hakmem.store import Store
    store = Store(tmp_path / "learn.db")
    try:
        epoch = store.fleet_epoch()
        assert store.fleet_epoch() == epoch and len(epoch) == 32
        for i, verdict in enumerate(["measured", "accepted", "measured", "measured", "rejected", "measured"]):
            store.fleet_queue("evaluation", {"n": i}, verdict)
        store.fleet_queue("best", {"n": 6})
        rows = store.fleet_outbox(after=0, limit=3)
        assert [body["n"] for _, _, body in rows] == [0, 1, 2]
        # Pushed: the batch handed to the worker; what was queued since stays.
        store.fleet_sent(rows[-1][0])
        assert [body["n"] for _, _, body in store.fleet_outbox()] == [3, 4, 5, 6]
        # Over its bound, the oldest plain measurements go; a verdict or a best policy never.
        assert store.fleet_bound(2) == 2
        assert [body["n"] for _, _, body in store.fleet_outbox()] == [4, 6]
        assert store.fleet_bound(1) == 0
        # seq never repeats, even once the rows before it are gone (the push's idempotency key).
        store.fleet_sent(10**6)
        store.fleet_queue("best", {"n": 7})
        assert store.fleet_outbox()[0][0] > rows[-1][0] + 4
    finally:
        store.close()


def test_a_fleet_policy_outside_the_allocators_bounds_is_not_applied(fleet, tmp_path):
    """Any host may push anything: an offered policy out of the allocator's
    bounds (k = 1, a single host's word) is refused by the host that pulls it,
    with a warning, and the program runs its own default."""
    from hakmem.procfs import program_identity
    f = fleet(k=1, canary=0.0)
    m = f.host("m")
    b = learnd_host(f, tmp_path, "b")
    try:
        b.wait_log("as host b", 10)
        probe = start(["burst", 64, 4000, scaled(20)], b.shm)
        path = ring_path(b.shm, probe.pid)
        default = Ring(path).policy_in_force()
        exe, build = program_identity(probe.pid)
        probe.kill()
        probe.wait()
        bad = json.loads(json.dumps(default))
        bad["tcache_cap"][CLS64] = 10**9
        f.verdict(m, "m", bad, "better", program=(build, pathlib.Path(exe).name, "0"))
        assert f.offers(m) != {}
        time.sleep(1.0)                   # two pulls: B holds the offer
        w = start(["burst", 64, 4000, scaled(3)], b.shm)
        path = ring_path(b.shm, w.pid)
        b.wait_log("the fleet's policy is outside the allocator's bounds", 10)
        assert Ring(path).policy_in_force()["tcache_cap"][CLS64] == default["tcache_cap"][CLS64]
        finish(w)
    finally:
        assert b.stop() == 0, b.text()
    assert "fleet_start" not in b.text(), b.text()


def test_a_policy_is_one_fleet_row_from_hosts_before_and_after_retain_mib():
    """The fleet groups verdicts by their knobs (jsonb values): a host of
    layout 6 pushes no retain_mib, one of layout 7 its default 256 for the
    same policy. Both push the same value; another retain_mib is another."""
    from hakmem.knobs import Knobs
    from hakmem import layout as L
    n = L.NUM_CLASSES - 1
    old = {"drain_ms": 1000, "tcache_cap": [0] + [64] * n, "tcache_batch": [0] + [32] * n,
           "warm_slabs": [0] + [1] * n}
    new = Knobs(old)
    assert new.retain_mib == 256
    assert json.loads(F._wire(new)) == json.loads(F._wire(old)) == old
    assert json.loads(F._wire(new.replace(retain_mib=64)))["retain_mib"] == 64
