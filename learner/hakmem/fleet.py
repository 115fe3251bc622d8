"""The fleet: hakmem-learnd hosts share what they learn through PostgreSQL.

One machine stays whole on its own: its SQLite file is the host's truth and
learnd never waits on the network. With `--fleet URL` learnd also

- **pushes** its evaluations and best policies: each is queued in the SQLite
  file (table fleet_outbox) in the same transaction as the evaluation itself,
  and a worker thread sends the queue in batches; (host, epoch, seq) is the
  idempotency key, so a batch sent twice (a lost reply, a crash between the
  commit and the queue's trim) inserts nothing the second time, and nothing
  is lost while the database is away: the queue waits in SQLite;
- **pulls** the fleet's offers for its hardware class every `fleet_pull`
  seconds: a program new to the host starts from the offered policy (a
  prior, applied at its start), and learnd's own A/B against the default
  decides whether it stays (daemon.py, `_activate`).

The database side (schemas/fleet/, the owner's migrations): a host is a role
and row-level security lets it write only rows with its own host id; a policy
is offered only once `k` hosts' own searches measured it better than their
default beyond noise, to a hashed fraction of the class's hosts first (the
canaries), to the rest once a canary kept it, and to nobody once a canary
rolled it back (hakmem.standing). This module is every statement that runs
there: the CLI's (`hakmem fleet ...`) and the worker's.

The daemon touches the fleet only at its turn boundaries (FleetLink.turn):
it hands the worker a batch read from the outbox and takes back what the
worker finished; the worker alone talks to PostgreSQL, each statement under
a timeout.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import math
import os
import pathlib
import queue
import re
import threading
import time

SCHEMA_DIR = (pathlib.Path(os.environ["HAKMEM_FLEET_SCHEMA_DIR"]) if os.environ.get("HAKMEM_FLEET_SCHEMA_DIR")
              else importlib.resources.files(__package__) / "fleet_sql")
CONNECT_TIMEOUT_S = 3
STATEMENT_TIMEOUT_MS = 5000
BATCH = 500                  # outbox rows per push (halved after each failure, down to BATCH_MIN)
BATCH_MIN = 10
SETTLE_AGE_MS = 1000         # a program's standing is recomputed once its evidence is this old ...
SETTLE_PER_CALL = 8          # ... at most this many programs after each push or pull (hakmem.settle)
OUTBOX_MAX = 100_000         # rows kept while the database is away; older plain measurements go first
ERROR_EVERY_S = 60.0         # one log line a minute while the fleet is away
HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
VERDICT_VS_DEFAULT = {
    # The candidate measured against the default (the baseline).
    "candidate": {"accepted": "better", "rejected": "within", "rolled_back": "worse"},
    # The default measured against the candidate (the baseline): the
    # default's verdict read the other way round.
    "default": {"accepted": "worse", "rejected": "within", "rolled_back": "better"},
}


class FleetError(Exception):
    """The fleet database cannot be used, with the reason in one line."""


# ---- identity ----------------------------------------------------------------------
def hw_class(cpus: int | None = None, mem_bytes: int | None = None) -> str:
    """This machine's hardware class: its CPU count and its memory in GiB,
    rounded down to a power of two ("c2-m16" for 2 CPUs and 24 GiB).
    Evidence pools only between hosts of one class."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if mem_bytes is None:
        mem_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gib = max(mem_bytes / 2**30, 1.0)
    return f"c{cpus}-m{2 ** int(math.floor(math.log2(gib)))}"


def canary_order(host_ids) -> list[str]:
    """Hosts in the order hakmem.restage takes a policy's canaries in: by the md5
    of the host id (hex), then the id."""
    return sorted(host_ids, key=lambda h: (hashlib.md5(h.encode()).hexdigest(), h))


def vs_default(verdict: str, knobs, baseline, default) -> tuple[dict, str] | None:
    """What an evaluation says about a policy against the default: (that
    policy, "better" | "within" | "worse"), or None when it compares two
    policies neither of which is the default, or is a plain measurement."""
    from .learning import canonical, same
    if baseline is None or verdict == "measured":
        return None
    if same(baseline, default) and not same(knobs, default):
        return canonical(knobs), VERDICT_VS_DEFAULT["candidate"][verdict]
    if same(knobs, default) and not same(baseline, default):
        return canonical(baseline), VERDICT_VS_DEFAULT["default"][verdict]
    return None


def redact(url: str) -> str:
    """A connection URL without its password, for a log line."""
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url)


def migrations(directory=None):
    from .store import StoreError, migrations as _m
    try:
        return _m(directory or SCHEMA_DIR)
    except StoreError as e:
        raise FleetError(str(e)) from None


# ---- the database --------------------------------------------------------------------
def _psycopg():
    try:
        import psycopg
    except ImportError:
        raise FleetError("the fleet needs psycopg 3 (pip install 'hakmem[fleet]', or Debian's python3-psycopg)") \
            from None
    return psycopg


class FleetDB:
    """A connection to the fleet database, as a host or as its owner."""

    def __init__(self, url: str, *, connect_timeout=CONNECT_TIMEOUT_S, statement_ms=STATEMENT_TIMEOUT_MS,
                 settle_age_ms=SETTLE_AGE_MS):
        psycopg = _psycopg()
        self.url = url
        self.settle_age_ms = settle_age_ms
        try:
            self.conn = psycopg.connect(url, connect_timeout=connect_timeout, autocommit=True,
                                        options=f"-c statement_timeout={int(statement_ms)} "
                                                f"-c lock_timeout={int(statement_ms)}")
        except psycopg.Error as e:
            raise FleetError(f"{redact(url)}: {_first_line(e)}") from None

    def close(self):
        try:
            self.conn.close()
        except Exception:
            pass

    def _run(self, fn):
        """fn(cursor) in one transaction; a database error as FleetError."""
        psycopg = _psycopg()
        try:
            with self.conn.transaction(), self.conn.cursor() as cur:
                return fn(cur)
        except psycopg.Error as e:
            raise FleetError(_first_line(e)) from None

    # -- schema (the owner) --
    def version(self) -> int:
        def q(cur):
            cur.execute("SELECT to_regclass('hakmem.schema_migrations') IS NOT NULL")
            if not cur.fetchone()[0]:
                return 0
            cur.execute("SELECT coalesce(max(version), 0) FROM hakmem.schema_migrations")
            return cur.fetchone()[0]
        return self._run(q)

    def migrate(self, k=None, canary=None, confirm=None, directory=None) -> tuple[int, int]:
        """Applies what is missing, each migration with its record in one
        transaction (an advisory lock keeps two owners from racing); then the
        settings given. Returns (version before, version after)."""
        known = migrations(directory)

        def apply(cur):
            cur.execute("SELECT pg_advisory_xact_lock(hashtext('hakmem fleet migrate'))")
            cur.execute("CREATE SCHEMA IF NOT EXISTS hakmem")
            cur.execute("CREATE TABLE IF NOT EXISTS hakmem.schema_migrations (version integer PRIMARY KEY, "
                        "name text NOT NULL, applied timestamptz NOT NULL DEFAULT now())")
            cur.execute("SELECT coalesce(max(version), 0) FROM hakmem.schema_migrations")
            have = cur.fetchone()[0]
            if have > len(known):
                raise FleetError(f"the fleet database's schema is version {have}, newer than this hakmem's "
                                 f"({len(known)})")
            for version, name, sql in known[have:]:
                cur.execute(sql)
                cur.execute("INSERT INTO hakmem.schema_migrations (version, name) VALUES (%s, %s)", (version, name))
            changed = False
            for key, value in (("k", k), ("canary_fraction", canary), ("canary_confirm", confirm)):
                if value is not None:
                    cur.execute("UPDATE hakmem.settings SET value = %s WHERE name = %s AND value <> %s",
                                (float(value), key, float(value)))
                    changed |= cur.rowcount > 0
            if changed:
                cur.execute("SELECT hakmem.touch_classes(NULL)")     # every standing moves with them
            return have, len(known)
        out = self._run(apply)
        self.settle_all()
        return out

    def settle_all(self):
        """Recomputes every marked standing now (the owner's changes)."""
        while self._run(lambda cur: (cur.execute("SELECT hakmem.settle(100, 0)"), cur.fetchone()[0])[1]):
            pass

    def check_version(self):
        have, known = self.version(), len(migrations())
        if have < known:
            raise FleetError(f"the fleet database's schema is version {have}, this hakmem needs {known} "
                             f"(its owner runs `hakmem fleet migrate`)")
        if have > known:
            raise FleetError(f"the fleet database's schema is version {have}, newer than this hakmem's ({known})")

    def settings(self) -> dict:
        def q(cur):
            cur.execute("SELECT name, value FROM hakmem.settings")
            return dict(cur.fetchall())
        return self._run(q)

    def add_host(self, host_id: str, password: str | None) -> str:
        """A host's role (hakmem_host_<id>, a member of hakmem_host) and its row."""
        if not HOST_RE.match(host_id):
            raise FleetError(f"{host_id!r} is not a host id (letters, digits, '.', '_', '-'; 63 at most)")
        role = "hakmem_host_" + host_id.lower().replace(".", "_").replace("-", "_")
        psycopg = _psycopg()
        from psycopg import sql

        def q(cur):
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
            if cur.fetchone() is None:
                cur.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE hakmem_host").format(sql.Identifier(role)))
            if password is not None:
                cur.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(role), sql.Literal(password)))
            cur.execute("INSERT INTO hakmem.hosts (host_id, role) VALUES (%s, %s) "
                        "ON CONFLICT (host_id) DO UPDATE SET role = excluded.role", (host_id, role))
            return role
        del psycopg
        return self._run(q)

    def exclude(self, host_id: str, why: str | None, exclude=True) -> None:
        def q(cur):
            if exclude:
                cur.execute("UPDATE hakmem.hosts SET excluded = now(), excluded_why = %s WHERE host_id = %s",
                            (why or "excluded by the operator", host_id))
            else:
                cur.execute("UPDATE hakmem.hosts SET excluded = NULL, excluded_why = NULL WHERE host_id = %s",
                            (host_id,))
            if cur.rowcount == 0:
                raise FleetError(f"no fleet host {host_id!r}")
            cur.execute("SELECT hakmem.touch_classes(ARRAY(SELECT hw_class FROM hakmem.hosts WHERE host_id = %s "
                        "AND hw_class IS NOT NULL))", (host_id,))
        self._run(q)
        self.settle_all()

    # -- a host --
    def me(self) -> str:
        def q(cur):
            cur.execute("SELECT hakmem.me()")
            return cur.fetchone()[0]
        host = self._run(q)
        if host is None:
            raise FleetError("this database role is no fleet host (its owner runs `hakmem fleet add-host`)")
        return host

    def push(self, epoch: str, rows, hw: str, version: str) -> int:
        """Outbox rows [(seq, kind, body)] in one transaction; returns how many
        evaluations were new (a batch pushed again inserts nothing)."""
        def q(cur):
            cur.execute("SELECT hw_class FROM hakmem.hosts WHERE role = current_user")
            row = cur.fetchone()
            if row is None:
                raise FleetError("this database role is no fleet host (its owner runs `hakmem fleet add-host`)")
            cur.execute("UPDATE hakmem.hosts SET last_seen = now(), hw_class = %s, version = %s "
                        "WHERE role = current_user", (hw, version))
            if row[0] != hw:
                # A host joins (or leaves) a class: its programs' canaries move.
                cur.execute("SELECT hakmem.touch_classes(%s)", ([c for c in (row[0], hw) if c is not None],))
            ids: dict[tuple, int] = {}
            touched: set[int] = set()
            new = 0
            for seq, kind, body in rows:
                g = body["program"]
                ident = (g["build_id"], g["exe_name"], g["users"], hw)
                if ident not in ids:
                    cur.execute("INSERT INTO hakmem.programs (build_id, exe_name, users, hw_class) "
                                "VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING", ident)
                    cur.execute("SELECT id FROM hakmem.programs WHERE build_id = %s AND exe_name = %s "
                                "AND users = %s AND hw_class = %s", ident)
                    ids[ident] = cur.fetchone()[0]
                pid = ids[ident]
                if kind == "best":
                    cur.execute("INSERT INTO hakmem.host_best (host_id, program_id, knobs, origin, updated) "
                                "VALUES (hakmem.me(), %s, %s, %s, to_timestamp(%s)) "
                                "ON CONFLICT (host_id, program_id) DO UPDATE SET knobs = excluded.knobs, "
                                "origin = excluded.origin, updated = excluded.updated "
                                "WHERE host_best.updated <= excluded.updated",
                                (pid, _wire(body["knobs"]), body["origin"], body["t"]))
                    continue
                cur.execute("INSERT INTO hakmem.evaluations (host_id, epoch, seq, program_id, knobs, baseline_knobs, "
                            "verdict, source, windows, cost_mean, cost_sd, baseline_cost, objective, learner, "
                            "t_start, t_end) VALUES (hakmem.me(), %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, "
                            "%s, to_timestamp(%s), to_timestamp(%s)) ON CONFLICT DO NOTHING RETURNING seq",
                            (epoch, seq, pid, _wire(body["knobs"]),
                             _wire(body["baseline_knobs"]) if body.get("baseline_knobs") is not None else None,
                             body["verdict"], body["source"], body["windows"], body["cost_mean"], body.get("cost_sd"),
                             body.get("baseline_cost"), body["objective"], body["learner"], body["t_start"],
                             body["t_end"]))
                if cur.fetchone() is None:
                    continue          # pushed before
                new += 1
                vd = body.get("vs_default")
                if vd is not None:
                    cur.execute("INSERT INTO hakmem.verdicts (host_id, program_id, knobs, source, vs_default, rel, "
                                "windows, t_end) VALUES (hakmem.me(), %s, %s, %s, %s, %s, %s, to_timestamp(%s)) "
                                "ON CONFLICT (host_id, program_id, knobs, source) DO UPDATE SET "
                                "vs_default = excluded.vs_default, rel = excluded.rel, windows = excluded.windows, "
                                "t_end = excluded.t_end WHERE verdicts.t_end <= excluded.t_end",
                                (pid, _wire(vd["knobs"]), body["source"], vd["verdict"], vd.get("rel"),
                                 body["windows"], body["t_end"]))
                    touched.add(pid)
            if touched:
                cur.execute("SELECT hakmem.touch(%s)", (sorted(touched),))
            return new
        new = self._run(q)
        self.settle(quiet=True)
        return new

    def settle(self, quiet=False) -> int:
        """Recomputes a few standings whose evidence changed (any host's),
        after this host's own transaction: off the push's locks. quiet: a
        failure is the fleet's work left for the next host, not this host's
        push or pull failing (0)."""
        try:
            return self._run(lambda cur: (cur.execute("SELECT hakmem.settle(%s, %s)",
                                                      (SETTLE_PER_CALL, self.settle_age_ms)), cur.fetchone()[0])[1])
        except FleetError:
            if not quiet:
                raise
            return 0

    def offers(self, hw: str) -> dict:
        """{(build_id, exe_name, users): Offer} this host is offered."""
        def q(cur):
            cur.execute("SELECT build_id, exe_name, users, knobs, stage, agree, rel FROM hakmem.offers(%s)", (hw,))
            return {(b, e, u): Offer(knobs=k, stage=s, agree=a, rel=r) for b, e, u, k, s, a, r in cur.fetchall()}
        return self._run(q)

    # -- what the CLI shows --
    def _fresh(self):
        """What a person reads is the evidence as it is now: the standings
        marked since their last recomputation, recomputed first (a bounded
        number)."""
        self._run(lambda cur: cur.execute("SELECT hakmem.settle(100, 0)"))

    def status(self) -> dict:
        self._fresh()

        def q(cur):
            cur.execute("SELECT (SELECT count(*) FROM hakmem.hosts), (SELECT count(*) FROM hakmem.hosts "
                        "WHERE excluded IS NOT NULL), (SELECT count(*) FROM hakmem.programs), "
                        "(SELECT count(*) FROM hakmem.evaluations), "
                        "(SELECT count(*) FROM hakmem.standing WHERE stage = 'offered'), "
                        "(SELECT count(*) FROM hakmem.standing WHERE stage = 'canary'), "
                        "(SELECT count(*) FROM hakmem.standing WHERE stage = 'stopped')")
            h, x, g, e, off, can, stop = cur.fetchone()
            return {"hosts": h, "excluded": x, "programs": g, "evaluations": e, "offered": off, "canary": can,
                    "stopped": stop}
        out = self._run(q)
        out["schema_version"] = self.version()
        out["settings"] = self.settings()
        return out

    def hosts(self) -> list[dict]:
        """Every host with what it pushed and how often its own verdicts
        disagree with the other hosts' on the same policy (an outlier: a
        host whose measurements the rest of the fleet does not reproduce)."""
        def q(cur):
            # Set-based: per policy the non-excluded hosts' verdict counts,
            # then per host's verdict the others' (its own taken out) and
            # their most common verdict (ties: better, within, worse).
            cur.execute("""
              WITH v AS (SELECT v.host_id, v.program_id, v.knobs, v.vs_default, h.excluded IS NULL AS counted
                         FROM hakmem.verdicts v JOIN hakmem.hosts h USING (host_id) WHERE v.source = 'local'),
              n AS (SELECT program_id, knobs,
                           count(*) FILTER (WHERE vs_default = 'better') AS b,
                           count(*) FILTER (WHERE vs_default = 'within') AS w,
                           count(*) FILTER (WHERE vs_default = 'worse') AS x
                    FROM v WHERE counted GROUP BY program_id, knobs),
              o AS (SELECT v.host_id, v.vs_default,
                           n.b - (v.counted AND v.vs_default = 'better')::int AS b,
                           n.w - (v.counted AND v.vs_default = 'within')::int AS w,
                           n.x - (v.counted AND v.vs_default = 'worse')::int AS x
                    FROM v JOIN n USING (program_id, knobs)),
              cmp AS (
                SELECT host_id, count(*) AS compared,
                       count(*) FILTER (WHERE vs_default <> CASE WHEN b >= w AND b >= x THEN 'better'
                                                                 WHEN w >= x THEN 'within' ELSE 'worse' END) AS disagree
                FROM o WHERE b + w + x >= 2 GROUP BY host_id)
              SELECT h.host_id, h.role, h.hw_class, h.version, extract(epoch FROM h.last_seen),
                     extract(epoch FROM h.excluded), h.excluded_why,
                     (SELECT count(*) FROM hakmem.evaluations e WHERE e.host_id = h.host_id),
                     (SELECT count(*) FROM hakmem.verdicts x WHERE x.host_id = h.host_id),
                     coalesce(c.compared, 0), coalesce(c.disagree, 0)
              FROM hakmem.hosts h LEFT JOIN cmp c USING (host_id) ORDER BY h.host_id""")
            out = []
            for r in cur.fetchall():
                compared, disagree = r[9], r[10]
                out.append({"host": r[0], "role": r[1], "hw_class": r[2], "version": r[3],
                            "last_seen": None if r[4] is None else float(r[4]),
                            "excluded": None if r[5] is None else float(r[5]), "excluded_why": r[6], "evaluations": r[7], "verdicts": r[8],
                            "compared": compared, "disagree": disagree,
                            "outlier": compared >= 3 and disagree / compared > 0.5})
            return out
        return self._run(q)

    def programs(self) -> list[dict]:
        self._fresh()

        def q(cur):
            cur.execute("""
              SELECT g.id, g.exe_name, g.build_id, g.users, g.hw_class,
                     (SELECT count(DISTINCT host_id) FROM hakmem.evaluations e WHERE e.program_id = g.id),
                     (SELECT count(*) FROM hakmem.evaluations e WHERE e.program_id = g.id),
                     (SELECT stage FROM hakmem.standing s WHERE s.program_id = g.id AND s.stage <> 'evidence'
                      ORDER BY s.stage = 'offered' DESC, s.agree DESC LIMIT 1)
              FROM hakmem.programs g ORDER BY g.exe_name, g.hw_class, g.id""")
            return [{"id": r[0], "exe_name": r[1], "build_id": r[2], "users": r[3], "hw_class": r[4], "hosts": r[5],
                     "evaluations": r[6], "stage": r[7]} for r in cur.fetchall()]
        return self._run(q)

    def policy(self, text: str) -> list[dict]:
        """Where each policy of the programs named `text` (an id, an
        executable name, or NAME@BUILD) stands."""
        self._fresh()

        def q(cur):
            if text.isdigit():
                cur.execute("SELECT id FROM hakmem.programs WHERE id = %s", (int(text),))
            else:
                name, _, build = text.partition("@")
                cur.execute("SELECT id FROM hakmem.programs WHERE exe_name = %s AND (%s = '' OR build_id LIKE %s)",
                            (name, build, build + "%"))
            ids = [r[0] for r in cur.fetchall()]
            if not ids:
                raise FleetError(f"no fleet program {text!r} (hakmem fleet programs lists them)")
            cur.execute("SELECT s.program_id, g.exe_name, g.build_id, g.hw_class, s.knobs, s.agree, s.against, "
                        "coalesce(cardinality(s.canaries), 0), s.kept, s.worse, s.rel, s.stage FROM hakmem.standing s "
                        "JOIN hakmem.programs g ON g.id = s.program_id WHERE s.program_id = ANY(%s) "
                        "ORDER BY s.program_id, s.agree DESC, s.rel NULLS LAST", (ids,))
            return [{"program_id": r[0], "exe_name": r[1], "build_id": r[2], "hw_class": r[3], "knobs": r[4],
                     "agree": r[5], "against": r[6], "canaries": r[7], "kept": r[8], "worse": r[9], "rel": r[10],
                     "stage": r[11]} for r in cur.fetchall()]
        return self._run(q)


def _first_line(e: BaseException) -> str:
    s = str(e).strip() or type(e).__name__
    return s.splitlines()[0]


@dataclasses.dataclass(frozen=True)
class Offer:
    knobs: dict
    stage: str          # offered | canary
    agree: int
    rel: float | None   # the median cost ratio the agreeing hosts measured (below 1: cheaper)

    def describe(self) -> str:
        rel = f", median {(self.rel - 1) * 100:+.1f}% cost" if self.rel is not None else ""
        stage = "as a canary" if self.stage == "canary" else "offered"
        return f"{stage}: {self.agree} host{'s' if self.agree != 1 else ''} measured it better than their default{rel}"


# ---- learnd's side ---------------------------------------------------------------------
class FleetLink:
    """learnd's link to the fleet: a worker thread that alone talks to
    PostgreSQL, and what the daemon exchanges with it at turn boundaries.

    The daemon calls turn(): it collects what the worker finished (rows
    pushed, offers pulled, an error), trims the outbox of what was pushed,
    and hands the worker its next batch or pull. Nothing here blocks on the
    network; with the database away, evaluations wait in the outbox."""

    def __init__(self, url: str, store, log, *, pull_every=5.0, klass: str | None = None, clock=time,
                 version: str = ""):
        self.url = url
        self.store = store
        self.log = log
        self.pull_every = pull_every
        self.klass = klass or hw_class()
        self.clock = clock
        self.version = version
        self.epoch = store.fleet_epoch()
        self.offers: dict = {}
        self.offers_at: float | None = None    # monotonic time of the last good pull
        self.host: str | None = None
        self.pushed = 0                         # evaluations the database took (new ones)
        self.push_batches = 0
        self.pulls = 0
        self.errors = 0
        self.dropped = 0                        # plain measurements dropped from a full outbox
        self.adopted = 0                        # programs started from the fleet's policy
        self.backlog = 0
        self.last_error: str | None = None
        self.up = False
        self._next_pull = 0.0
        self._next_try = 0.0
        self._backoff = 1.0
        self._next_note = 0.0
        self._next_bound = 0.0
        self._next_count = 0.0
        self._busy = False
        self._sent_upto = 0                     # outbox rows up to here are with the worker or pushed
        self._batch = BATCH                     # halved after a failed push: a batch too big for the
                                                # statement timeout must not fail forever
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="hakmem-fleet", daemon=True)
        self._thread.start()

    # -- the worker thread: the only code that talks to PostgreSQL --
    def _work(self):
        db = None
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            if job is None:
                break
            try:
                if db is None:
                    db = FleetDB(self.url)
                    self._schema(db)
                    host = db.me()
                    self._done.put(("host", host))
                if job[0] == "push":
                    _, upto, rows = job
                    new = db.push(self.epoch, rows, self.klass, self.version)
                    self._done.put(("pushed", upto, new))
                elif job[0] == "pull":
                    self._done.put(("offers", db.offers(self.klass)))
                    db.settle(quiet=True)     # the fleet's work, after this host's pull: its share of recomputing
            except FleetError as e:
                self._done.put(("error", job[0], str(e)))
                if db is not None:
                    db.close()
                    db = None
            except Exception as e:      # a bug here must not end learnd, nor the worker
                self._done.put(("error", job[0], f"internal error: {type(e).__name__}: {e}"))
                if db is not None:
                    db.close()
                    db = None
        if db is not None:
            db.close()

    @staticmethod
    def _schema(db):
        """Migrates a database older than this hakmem when the role may (its
        owner's); a host's role may not, and says who must."""
        have, known = db.version(), len(migrations())
        if have < known:
            try:
                db.migrate()
            except FleetError as e:
                raise FleetError(f"the fleet database's schema is version {have}, this hakmem needs {known}, and "
                                 f"this role cannot migrate it ({e}): its owner runs `hakmem fleet migrate`") from None
        db.check_version()

    def close(self, timeout=2.0):
        self._stop.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- the daemon's turn --
    def turn(self, writes):
        now = self.clock.monotonic()
        while True:
            try:
                msg = self._done.get_nowait()
            except queue.Empty:
                break
            self._take(msg, now, writes)
        if now >= self._next_bound:
            self._next_bound = now + 60.0
            self._bound(writes)
        if now >= self._next_count:           # the backlog as the metrics and `hakmem status` show it
            self._next_count = now + 1.0
            try:
                self.backlog = self.store.fleet_backlog()
            except Exception:
                pass
        if self._busy or now < self._next_try:
            return
        if now >= self._next_pull:
            self._next_pull = now + self.pull_every
            self._busy = True
            self._jobs.put(("pull",))
            return
        try:
            rows = self.store.fleet_outbox(after=self._sent_upto, limit=self._batch)
        except Exception as e:
            self._note(now, f"cannot read the fleet outbox: {e}")
            return
        if rows:
            self._busy = True
            upto = rows[-1][0]
            self._sent_upto = upto
            self._jobs.put(("push", upto, rows))

    def _take(self, msg, now, writes):
        kind = msg[0]
        if kind == "host":
            if self.host != msg[1]:
                self.log("info", f"fleet: {redact(self.url)} as host {msg[1]} (class {self.klass})")
            self.host = msg[1]
            return
        self._busy = False
        if kind == "error":
            self.errors += 1
            self.up = False
            self.last_error = msg[2]
            self._sent_upto = 0            # what was in flight is sent again (idempotent)
            if msg[1] == "push":
                self._batch = max(BATCH_MIN, self._batch // 2)
            self._next_try = now + self._backoff
            self._backoff = min(self._backoff * 2, 30.0)
            self._note(now, f"fleet: {msg[1]} failed: {msg[2]}; learning goes on locally, "
                            f"{self.backlog} outbox rows wait")
            return
        if not self.up and self.last_error is not None:
            self.log("info", f"fleet: {redact(self.url)} reachable again")
        self.up, self._backoff = True, 1.0
        if kind == "pushed":
            self._batch = min(BATCH, self._batch * 2)
            upto, new = msg[1], msg[2]
            self.pushed += new
            self.push_batches += 1
            writes.add(lambda s, u=upto: s.fleet_sent(u))
        elif kind == "offers":
            self.offers, self.offers_at = msg[1], now
            self.pulls += 1

    def _bound(self, writes):
        def op(s):
            self.dropped += s.fleet_bound(OUTBOX_MAX)
        writes.add(op)

    def _note(self, now, text):
        if now >= self._next_note:
            self._next_note = now + ERROR_EVERY_S
            self.log("warning", text)

    def offer(self, build_id: str, exe: str, users: str) -> Offer | None:
        return self.offers.get((build_id, os.path.basename(exe), users))

    def line(self) -> str:
        """The link's state for `hakmem status`, one line."""
        who = f"as host {self.host}" if self.host else "not connected yet"
        state = "up" if self.up else (f"unreachable ({self.last_error})" if self.last_error else "connecting")
        return (f"{redact(self.url)} {who}, class {self.klass}: {state}; {self.backlog} rows to push, "
                f"{self.pushed} evaluations pushed, {len(self.offers)} offers, {self.adopted} programs started "
                f"from the fleet's policy")

    def describe(self) -> dict:
        return {"url": redact(self.url), "host": self.host, "class": self.klass, "up": self.up,
                "backlog": self.backlog, "pushed": self.pushed, "pulls": self.pulls, "errors": self.errors,
                "dropped": self.dropped, "offers": len(self.offers), "adopted": self.adopted,
                "last_error": self.last_error}


def _wire(knobs) -> str:
    """Knobs as the fleet's rows hold them (jsonb, compared and grouped as
    values): their identity form, so a host from before a later knob
    (retain_mib) and one after it name the same policy alike."""
    from .knobs import LATER
    return json.dumps({k: v for k, v in dict(knobs).items() if LATER.get(k, -1) != v})


def outbox_evaluation(prog_ident: dict, ev, default, source: str, learner: str, objective: str) -> dict:
    """An evaluation as the outbox keeps it (JSON): what push() sends."""
    from .learning import canonical
    knobs = canonical(ev.knobs)
    base = canonical(ev.baseline_knobs) if ev.baseline_knobs is not None else None
    vd = vs_default(ev.verdict, knobs, base, default)
    rel = None
    if vd is not None and ev.baseline_cost and ev.cost_mean:
        # The policy's cost over the default's, whichever side it was on.
        rel = ev.cost_mean / ev.baseline_cost if base is not None and vd[0] == knobs else \
            ev.baseline_cost / ev.cost_mean
    return {"program": prog_ident, "knobs": knobs, "baseline_knobs": base, "verdict": ev.verdict, "source": source,
            "windows": int(ev.windows), "cost_mean": float(ev.cost_mean),
            "cost_sd": None if ev.cost_sd is None else float(ev.cost_sd),
            "baseline_cost": None if ev.baseline_cost is None else float(ev.baseline_cost),
            "objective": objective, "learner": learner, "t_start": float(ev.t_start), "t_end": float(ev.t_end),
            "vs_default": None if vd is None else {"knobs": vd[0], "verdict": vd[1], "rel": rel}}


def program_ident(exe: str, build_id: str, users: str) -> dict:
    return {"build_id": build_id, "exe_name": os.path.basename(exe), "users": users}

