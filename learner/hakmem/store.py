"""hakmem-learnd's SQLite store: programs, processes, windows, policies,
evaluations. `sqlite3 learn.db` is a supported way to look (schemas/sql/).

- Migrations are the numbered files schemas/sql/NNNN_name.sql, each applied
  with its record in schema_migrations in one transaction; a database newer
  than this code is refused, never "downgraded". The package reads them as
  its data, hakmem/sql (a link to schemas/sql in the checkout, a copy in an
  installed wheel), or from $HAKMEM_SCHEMA_DIR when set.
- WAL, foreign keys on, a short busy timeout: the daemon's loop must never
  stall on a reader holding a lock. A write that fails (locked, read-only,
  disk full) raises StoreError; the daemon keeps the rows and tries again
  (daemon.py: Writes).
- Policies are stored once per program and set of knobs (by digest).
- A program is (exe, build_id, users): learned per user unless the
  configuration pools users (config.py: users_key); its key, the name the
  CLI, messages and events use, is exe@build_id#users (program_key).
"""
from __future__ import annotations

import contextlib
import errno
import importlib.resources
import json
import os
import pathlib
import re
import sqlite3
import tempfile
import time

import numpy as np

from .config import ConfigError, parse_users, users_names, users_text
from .knobs import KnobsError
from .learning import Evaluation, Prior, canonical, digest

SCHEMA_DIR = (pathlib.Path(os.environ["HAKMEM_SCHEMA_DIR"]) if os.environ.get("HAKMEM_SCHEMA_DIR") else
              importlib.resources.files(__package__) / "sql")
ORIGINS = ("default", "learned", "replay", "pinned")
# A window row is these keys, the allocation mix, and its measures: every
# other column of the windows table, as the migrations made it (window_columns):
# a column added by a migration is stored from learning.Window.row()'s key of
# that name and averaged by retain(), with no list to change here.
WINDOW_KEYS = ("process_id", "policy_id", "t_start", "t_end", "merged")
WINDOW_MIX = "mix"
_MIGRATION = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class StoreError(Exception):
    """A store that cannot be used or written, with the reason in one line."""


def migrations(directory=SCHEMA_DIR):
    out = []
    try:
        files = sorted(directory.iterdir(), key=lambda f: f.name)
    except OSError as e:
        raise StoreError(f"cannot read the schema directory {directory}: {e.strerror}") from None
    for f in files:
        m = _MIGRATION.match(f.name)
        if m:
            out.append((int(m.group(1)), m.group(2), f.read_text()))
    if [v for v, _, _ in out] != list(range(1, len(out) + 1)):
        raise StoreError(f"{directory}: migrations are not numbered 1..N without gaps")
    return out


def _why(e: sqlite3.Error, path) -> str:
    msg = str(e)
    if "locked" in msg or "busy" in msg:
        return f"{path}: database is locked by another process"
    if "readonly" in msg or "read-only" in msg:
        return f"{path}: database is read-only"
    if "malformed" in msg or "not a database" in msg:
        return f"{path}: database is damaged ({msg})"
    if "disk I/O error" in msg and _read_only_dir(path):
        # What SQLite says when the file system turns read-only under it
        # (ext4 after an error, errors=remount-ro).
        return f"{path}: database is read-only (its file system is read-only)"
    return f"{path}: {msg}"


def _read_only_dir(path) -> bool:
    """Whether a file can no longer be made beside the database because its
    file system is read-only. (Not by opening the database itself: closing a
    descriptor of it would drop SQLite's POSIX locks.)"""
    try:
        fd, name = tempfile.mkstemp(prefix=".hakmem-probe-", dir=os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        return e.errno == errno.EROFS
    os.close(fd)
    os.unlink(name)
    return False


class Store:
    def __init__(self, path, readonly=False, busy_ms=250, migrate=True):
        self.path = str(path)
        self.readonly = readonly
        try:
            if readonly:
                if not os.path.exists(self.path):
                    raise StoreError(f"{self.path}: no such database")
                uri = f"file:{pathlib.Path(self.path).resolve()}?mode=ro"
                self.db = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=busy_ms / 1000)
            else:
                parent = os.path.dirname(os.path.abspath(self.path))
                try:
                    os.makedirs(parent, mode=0o700, exist_ok=True)
                except OSError as e:
                    raise StoreError(f"{self.path}: cannot create its directory: {e.strerror}") from None
                # SQLite says only "unable to open database file" for these.
                if os.statvfs(parent).f_flag & os.ST_RDONLY:
                    raise StoreError(f"{self.path}: database is read-only (its file system is mounted read-only)")
                if os.path.exists(self.path) and not os.access(self.path, os.W_OK):
                    raise StoreError(f"{self.path}: database is read-only (no write permission)")
                self.db = sqlite3.connect(self.path, isolation_level=None, timeout=busy_ms / 1000)
            self.db.row_factory = sqlite3.Row
            self.db.execute(f"PRAGMA busy_timeout = {int(busy_ms)}")
            self.db.execute("PRAGMA foreign_keys = ON")
            if not readonly:
                if self.db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                    raise StoreError(f"{self.path}: cannot switch the database to WAL mode")
                self.db.execute("PRAGMA synchronous = NORMAL")
            self.db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.Error as e:
            raise StoreError(_why(e, self.path)) from None
        if migrate and not readonly:
            self.migrate()
        else:
            self._check_version()

    def close(self):
        self.db.close()

    # ---- schema -------------------------------------------------------------
    def schema_version(self) -> int:
        try:
            row = self.db.execute("SELECT max(version) FROM schema_migrations").fetchone()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return 0
            raise StoreError(_why(e, self.path)) from None
        except sqlite3.Error as e:
            raise StoreError(_why(e, self.path)) from None
        return row[0] or 0

    def _check_version(self):
        have, known = self.schema_version(), len(migrations())
        if have > known:
            raise StoreError(f"{self.path}: schema version {have} is newer than this hakmem's ({known})")
        if have < known:
            raise StoreError(f"{self.path}: schema version {have} needs migrating to {known} "
                             f"(hakmem-learnd does it at start)")

    def migrate(self):
        known = migrations()
        try:
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                            "name TEXT NOT NULL, applied REAL NOT NULL)")
        except sqlite3.Error as e:
            raise StoreError(_why(e, self.path)) from None
        self._window_cols = None
        have = self.schema_version()
        if have > len(known):
            raise StoreError(f"{self.path}: schema version {have} is newer than this hakmem's ({len(known)})")
        for version, name, sql in known[have:]:
            # executescript would COMMIT on its own; statements one by one keep
            # the migration and its record in one transaction.
            with self.tx():
                for stmt in _statements(sql):
                    self.db.execute(stmt)
                self.db.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", (version, name, time.time()))

    @contextlib.contextmanager
    def tx(self):
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise StoreError(_why(e, self.path)) from None
        try:
            yield self.db
        except sqlite3.Error as e:
            self.db.execute("ROLLBACK")
            raise StoreError(_why(e, self.path)) from None
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        try:
            self.db.execute("COMMIT")
        except sqlite3.Error as e:
            with contextlib.suppress(sqlite3.Error):
                self.db.execute("ROLLBACK")
            raise StoreError(_why(e, self.path)) from None

    def integrity_check(self) -> str:
        return self.db.execute("PRAGMA integrity_check").fetchone()[0]

    # ---- programs and processes ---------------------------------------------
    def program(self, exe, build_id, users, class_sizes, now=None) -> int:
        """The id of the program (exe, build_id, users), stored if new. users:
        the uid of its processes as a decimal string, or the pooled uids
        sorted and joined by commas (config.Config.users_key)."""
        now = time.time() if now is None else now
        with self.tx() as db:
            row = db.execute("SELECT id FROM programs WHERE exe = ? AND build_id = ? AND users = ?",
                             (exe, build_id, users)).fetchone()
            if row:
                db.execute("UPDATE programs SET last_seen = ? WHERE id = ?", (now, row[0]))
                return row[0]
            return db.execute("INSERT INTO programs (exe, build_id, users, first_seen, last_seen, class_sizes) "
                              "VALUES (?, ?, ?, ?, ?, ?)",
                              (exe, build_id, users, now, now, json.dumps(list(class_sizes)))).lastrowid

    def process(self, program_id, pid, start_time, uid, now=None) -> int:
        now = time.time() if now is None else now
        with self.tx() as db:
            row = db.execute("SELECT id FROM processes WHERE pid = ? AND start_time = ?", (pid, start_time)).fetchone()
            if row:
                db.execute("UPDATE processes SET last_seen = ?, program_id = ? WHERE id = ?", (now, program_id, row[0]))
                return row[0]
            return db.execute("INSERT INTO processes (program_id, pid, start_time, uid, first_seen, last_seen) "
                              "VALUES (?, ?, ?, ?, ?, ?)", (program_id, pid, start_time, uid, now, now)).lastrowid

    def process_exited(self, process_id, now=None):
        now = time.time() if now is None else now
        with self.tx() as db:
            db.execute("UPDATE processes SET exited = ?, last_seen = ? WHERE id = ?", (now, now, process_id))

    def mark_unfinished_exited(self, now=None):
        """At start: processes a previous learnd saw alive and never saw exit."""
        now = time.time() if now is None else now
        with self.tx() as db:
            db.execute("UPDATE processes SET exited = last_seen WHERE exited IS NULL")

    # ---- policies -----------------------------------------------------------
    def policy(self, program_id, knobs, origin, note=None, now=None) -> int:
        """The id of this program's policy with these knobs, stored if new."""
        if origin not in ORIGINS:
            raise StoreError(f"unknown policy origin {origin!r} ({', '.join(ORIGINS)})")
        k = canonical(knobs)
        d = digest(k)
        now = time.time() if now is None else now
        with self.tx() as db:
            row = db.execute("SELECT id FROM policies WHERE program_id = ? AND digest = ?", (program_id, d)).fetchone()
            if row:
                return row[0]
            v = db.execute("SELECT coalesce(max(version), 0) + 1 FROM policies WHERE program_id = ?",
                           (program_id,)).fetchone()[0]
            return db.execute("INSERT INTO policies (program_id, version, origin, knobs, digest, created, note) "
                              "VALUES (?, ?, ?, ?, ?, ?, ?)",
                              (program_id, v, origin, json.dumps(k, separators=(",", ":")), d, now, note)).lastrowid

    def set_best(self, program_id, policy_id, mix=None):
        with self.tx() as db:
            db.execute("UPDATE programs SET best_policy = ?, mix = coalesce(?, mix) WHERE id = ?",
                       (policy_id, json.dumps([round(float(x), 5) for x in mix]) if mix is not None else None,
                        program_id))

    def pin(self, program_id, policy_id):
        with self.tx() as db:
            db.execute("UPDATE programs SET pinned_policy = ? WHERE id = ?", (policy_id, program_id))

    def unpin(self, program_id):
        with self.tx() as db:
            db.execute("UPDATE programs SET pinned_policy = NULL WHERE id = ?", (program_id,))

    # ---- samples and verdicts -----------------------------------------------
    def window_columns(self) -> tuple[str, ...]:
        """The windows table's columns but id, in table order: what the
        migrations made it (WINDOW_KEYS, the measures, WINDOW_MIX)."""
        cols = getattr(self, "_window_cols", None)
        if cols is None:
            try:
                cols = tuple(r[1] for r in self.db.execute("PRAGMA table_info(windows)") if r[1] != "id")
            except sqlite3.Error as e:
                raise StoreError(_why(e, self.path)) from None
            self._window_cols = cols
        return cols

    def window_measures(self) -> tuple[str, ...]:
        """The columns a window measures (averaged when windows are merged)."""
        return tuple(c for c in self.window_columns() if c not in WINDOW_KEYS and c != WINDOW_MIX)

    def add_windows(self, rows) -> int:
        """rows: dicts with a key for each of window_columns() (learning.Window.row()
        and the keys; mix: a numpy array or None). Other keys are not stored; a
        measure a row lacks (a counter added after the row was made) is 0, a
        key it lacks is refused by the table."""
        cols = self.window_columns()
        measures = set(self.window_measures())
        vals = []
        for r in rows:
            mix = r.get(WINDOW_MIX)
            vals.append(tuple((np.asarray(mix, dtype="<f4").tobytes() if mix is not None else None)
                              if c == WINDOW_MIX else r.get(c, 0.0 if c in measures else 1 if c == "merged" else None)
                              for c in cols))
        if not vals:
            return 0
        with self.tx() as db:
            db.executemany(f"INSERT INTO windows ({', '.join(cols)}) VALUES "
                           f"({', '.join('?' * len(cols))})", vals)
        return len(vals)

    def add_evaluation(self, program_id, policy_id, ev: Evaluation, learner, objective,
                       baseline_policy_id=None, fleet_body=None) -> int:
        """Stores a verdict and folds its windows into the policy's measured
        objective; with fleet_body, queues it for the fleet in the same
        transaction (fleet.py: nothing stored is left unpushed)."""
        with self.tx() as db:
            eid = db.execute(
                "INSERT INTO evaluations (program_id, policy_id, t_start, t_end, windows, cost_mean, cost_sd, "
                "time_cost, mem_cost, baseline_policy_id, baseline_cost, verdict, learner, objective) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (program_id, policy_id, ev.t_start, ev.t_end, ev.windows, ev.cost_mean, ev.cost_sd, ev.time_cost,
                 ev.mem_cost, baseline_policy_id, ev.baseline_cost, ev.verdict, learner, objective)).lastrowid
            self._refresh_objective(db, policy_id, objective)
            if fleet_body is not None:
                self.fleet_queue("evaluation", fleet_body, ev.verdict)
            return eid

    @staticmethod
    def _refresh_objective(db, policy_id, objective):
        # Pooled mean and sd over this objective's evaluations, weighted by windows.
        rows = db.execute("SELECT windows, cost_mean, coalesce(cost_sd, 0) FROM evaluations "
                          "WHERE policy_id = ? AND objective = ? AND windows > 0", (policy_id, objective)).fetchall()
        n = sum(r[0] for r in rows)
        if not n:
            return
        mean = sum(r[0] * r[1] for r in rows) / n
        var = sum(r[0] * (r[2] ** 2 + (r[1] - mean) ** 2) for r in rows) / n
        db.execute("UPDATE policies SET objective = ?, objective_sd = ?, evaluations = ? WHERE id = ?",
                   (mean, var ** 0.5, n, policy_id))

    def recent_mixes(self, program_id, limit=600) -> list[np.ndarray]:
        """Allocations per class of the program's latest raw windows that
        allocated, oldest first (merged windows keep no mix). A damaged mix
        (not a whole number of float32s, or not finite) is left out."""
        rows = self.db.execute(
            "SELECT w.mix FROM windows w JOIN processes p ON p.id = w.process_id "
            "WHERE p.program_id = ? AND w.mix IS NOT NULL AND w.allocs > 0 "
            "ORDER BY w.t_end DESC LIMIT ?", (program_id, int(limit))).fetchall()
        out = []
        for (blob,) in reversed(rows):
            if isinstance(blob, bytes) and len(blob) % 4 == 0:
                a = np.frombuffer(blob, dtype="<f4").astype(float)
                if np.isfinite(a).all():
                    out.append(a)
        return out

    def priors(self, program_id, objective) -> list[Prior]:
        """Every policy measured under this objective, pooled (for a warm start)."""
        out = []
        for r in self.db.execute(
                "SELECT p.knobs, sum(e.windows) AS n, sum(e.windows * e.cost_mean) / sum(e.windows) AS mean, "
                "max(coalesce(e.cost_sd, 0)) AS sd FROM evaluations e JOIN policies p ON p.id = e.policy_id "
                "WHERE e.program_id = ? AND e.objective = ? AND e.windows > 0 GROUP BY p.id",
                (program_id, objective)):
            out.append(Prior(knobs=_knobs(r["knobs"]), cost_mean=r["mean"], cost_sd=r["sd"], windows=r["n"]))
        return out

    # ---- retention ------------------------------------------------------------
    def retain(self, now=None, raw_s=6 * 3600, bucket_s=60, keep_s=30 * 86400, max_rows=500_000) -> dict:
        """Keeps the file bounded: raw windows older than raw_s are merged into
        one row per process, policy and bucket_s; merged rows older than keep_s
        are dropped, and so are the oldest rows past max_rows."""
        now = time.time() if now is None else now
        cut = now - raw_s
        measures = self.window_measures()
        agg = ", ".join(f"sum({c} * merged) / sum(merged) AS {c}" for c in measures)
        cols = ", ".join((*WINDOW_KEYS, *measures))
        with self.tx() as db:
            before = db.execute("SELECT count(*) FROM windows").fetchone()[0]
            db.execute(
                f"CREATE TEMP TABLE merged_w AS SELECT process_id, policy_id, min(t_start) AS t_start, "
                f"max(t_end) AS t_end, sum(merged) AS merged, {agg} FROM windows "
                f"WHERE t_end < ? AND mix IS NOT NULL GROUP BY process_id, policy_id, "
                f"CAST(t_end / ? AS INTEGER)", (cut, bucket_s))
            db.execute("DELETE FROM windows WHERE t_end < ? AND mix IS NOT NULL", (cut,))
            db.execute(f"INSERT INTO windows ({cols}) SELECT {cols} FROM merged_w")
            db.execute("DROP TABLE merged_w")
            db.execute("DELETE FROM windows WHERE t_end < ?", (now - keep_s,))
            over = db.execute("SELECT count(*) FROM windows").fetchone()[0] - max_rows
            if over > 0:
                db.execute("DELETE FROM windows WHERE id IN (SELECT id FROM windows ORDER BY t_end LIMIT ?)", (over,))
            after = db.execute("SELECT count(*) FROM windows").fetchone()[0]
        return {"before": before, "after": after}

    # ---- reads ----------------------------------------------------------------
    def programs(self) -> list[dict]:
        """Every program, with its processes counted and the objective of
        its latest evaluation (last_objective), in one query: `hakmem
        programs` on a learnd that has seen hundreds of programs made a few
        queries each and kept status waiting seconds on a loaded machine."""
        rows = self.db.execute(
            "SELECT g.*, (SELECT count(*) FROM processes p WHERE p.program_id = g.id) AS processes_seen, "
            "(SELECT count(*) FROM processes p WHERE p.program_id = g.id AND p.exited IS NULL) AS live, "
            "(SELECT e.objective FROM evaluations e WHERE e.program_id = g.id ORDER BY e.t_end DESC LIMIT 1) "
            "AS last_objective "
            "FROM programs g ORDER BY g.last_seen DESC").fetchall()
        return [_program(r) for r in rows]

    def program_by_id(self, program_id) -> dict | None:
        r = self.db.execute("SELECT g.*, (SELECT count(*) FROM processes p WHERE p.program_id = g.id) AS "
                            "processes_seen, (SELECT count(*) FROM processes p WHERE p.program_id = g.id AND "
                            "p.exited IS NULL) AS live FROM programs g WHERE id = ?", (program_id,)).fetchone()
        return _program(r) if r else None

    def find_program(self, text) -> dict:
        """A program named by id, key (exe@build_id#users), executable path or
        base name, either with #USERS (uids or user names: python3.11#1000,
        python3.11#root, /usr/bin/python3.11#0,101), or a prefix of a key.
        A name that fits several programs is refused with a name for each."""
        progs = self.programs()
        if not progs:
            raise StoreError("no program is known yet (learnd has not seen any process)")
        t = str(text).strip()
        hits = _resolve(t, progs)
        if len(hits) == 1:
            return hits[0]
        if hits:
            names = ", ".join(f"{_unique_name(p, progs)} (id {p['id']}, users {p['users_names'] or 'none'})"
                              for p in hits[:5])
            more = f" and {len(hits) - 5} more" if len(hits) > 5 else ""
            raise StoreError(f"{t!r} names {len(hits)} programs: {names}{more}; name one of them as shown, "
                             f"or by id")
        raise StoreError(f"no program matches {t!r} (hakmem policy list shows the known ones)")

    def processes(self, all=False) -> list[dict]:
        q = ("SELECT p.*, g.exe, g.build_id, g.users, "
             "(SELECT count(*) FROM windows w WHERE w.process_id = p.id) AS windows "
             "FROM processes p JOIN programs g ON g.id = p.program_id")
        if not all:
            q += " WHERE p.exited IS NULL"
        return [dict(r) | {"program": program_key(r["exe"], r["build_id"], r["users"])}
                for r in self.db.execute(q + " ORDER BY p.first_seen")]

    def policies(self, program_id=None) -> list[dict]:
        q = ("SELECT p.*, g.exe, g.build_id, g.users, g.best_policy = p.id AS best, g.pinned_policy = p.id AS pinned "
             "FROM policies p JOIN programs g ON g.id = p.program_id")
        args = ()
        if program_id is not None:
            q += " WHERE p.program_id = ?"
            args = (program_id,)
        return [_policy(r) for r in self.db.execute(q + " ORDER BY p.program_id, p.version", args)]

    def policy_by_id(self, policy_id) -> dict | None:
        return self.policies_by_id([policy_id]).get(policy_id) if policy_id else None

    def policies_by_id(self, ids) -> dict[int, dict]:
        """policy_by_id for many at once: {id: row} for those that exist."""
        ids = sorted({int(i) for i in ids if i})
        out: dict[int, dict] = {}
        for k in range(0, len(ids), 500):          # SQLite's bound on a statement's parameters
            part = ids[k:k + 500]
            q = ("SELECT p.*, g.exe, g.build_id, g.users, g.best_policy = p.id AS best, g.pinned_policy = p.id "
                 "AS pinned FROM policies p JOIN programs g ON g.id = p.program_id WHERE p.id IN "
                 f"({','.join('?' * len(part))})")
            for r in self.db.execute(q, part):
                out[r["id"]] = _policy(r)
        return out

    def policy_by_version(self, program_id, version) -> dict:
        r = self.db.execute("SELECT id FROM policies WHERE program_id = ? AND version = ?",
                            (program_id, version)).fetchone()
        if not r:
            raise StoreError(f"program {program_id} has no policy version {version}")
        return self.policy_by_id(r[0])

    def chosen(self, program_id) -> dict | None:
        """What a new process of the program gets: the pinned policy, else the best."""
        r = self.db.execute("SELECT coalesce(pinned_policy, best_policy) FROM programs WHERE id = ?",
                            (program_id,)).fetchone()
        return self.policy_by_id(r[0]) if r and r[0] else None

    def screened(self, program_id, objective) -> bool:
        """Whether learnd's screening ranked this program's policies under
        this objective before (replay_runs it kept for the program)."""
        return self.db.execute("SELECT 1 FROM replay_runs WHERE program_id = ? AND objective = ? LIMIT 1",
                               (program_id, objective)).fetchone() is not None

    def evaluations(self, program_id, limit=100) -> list[dict]:
        return [dict(r) for r in self.db.execute(
            "SELECT * FROM evaluations WHERE program_id = ? ORDER BY t_end DESC LIMIT ?", (program_id, limit))]

    def windows_count(self) -> int:
        return self.db.execute("SELECT count(*) FROM windows").fetchone()[0]

    # ---- the fleet's outbox (fleet.py) ---------------------------------------
    def fleet_epoch(self) -> str:
        """This file's epoch for the fleet: made once, kept."""
        row = self.db.execute("SELECT value FROM fleet_meta WHERE name = 'epoch'").fetchone()
        if row:
            return row[0]
        import uuid
        with self.tx() as db:
            db.execute("INSERT OR IGNORE INTO fleet_meta VALUES ('epoch', ?)", (uuid.uuid4().hex,))
        return self.db.execute("SELECT value FROM fleet_meta WHERE name = 'epoch'").fetchone()[0]

    def fleet_queue(self, kind: str, body: dict, verdict: str | None = None, now=None) -> None:
        """Queues a row; inside the caller's transaction when there is one."""
        now = time.time() if now is None else now
        args = (kind, json.dumps(body, separators=(",", ":")), verdict, now)
        q = "INSERT INTO fleet_outbox (kind, body, verdict, created) VALUES (?, ?, ?, ?)"
        if self.db.in_transaction:
            self.db.execute(q, args)
        else:
            with self.tx() as db:
                db.execute(q, args)

    def fleet_outbox(self, after=0, limit=500) -> list[tuple[int, str, dict]]:
        rows = self.db.execute("SELECT seq, kind, body FROM fleet_outbox WHERE seq > ? ORDER BY seq LIMIT ?",
                               (after, limit)).fetchall()
        return [(r[0], r[1], json.loads(r[2])) for r in rows]

    def fleet_backlog(self) -> int:
        return self.db.execute("SELECT count(*) FROM fleet_outbox").fetchone()[0]

    def fleet_sent(self, upto: int) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM fleet_outbox WHERE seq <= ?", (upto,))

    def fleet_bound(self, most: int) -> int:
        """Keeps the outbox at `most` rows, dropping the oldest plain
        measurements first (never a verdict or a best policy); returns how
        many it dropped."""
        over = self.fleet_backlog() - most
        if over <= 0:
            return 0
        with self.tx() as db:
            return db.execute("DELETE FROM fleet_outbox WHERE seq IN (SELECT seq FROM fleet_outbox "
                              "WHERE verdict = 'measured' ORDER BY seq LIMIT ?)", (over,)).rowcount


def program_key(exe, build_id, users) -> str:
    """How a program is named everywhere (CLI, messages, events): exe@build_id#users."""
    return f"{exe}@{build_id}#{users}"


def _program(r) -> dict:
    d = dict(r)
    d["key"] = program_key(d["exe"], d["build_id"], d["users"])
    d["users_names"] = users_names(d["users"])
    d["class_sizes"] = json.loads(d["class_sizes"])
    d["mix"] = json.loads(d["mix"]) if d.get("mix") else None
    return d


def _knobs(text: str):
    """A row's knobs in the dict form: a row stored before a later knob
    (retain_mib) gets its default, as the allocator then ran it. A row that
    is not knobs at all is returned as it is, for its reader to refuse."""
    raw = json.loads(text)
    try:
        return canonical(raw)
    except (KnobsError, TypeError):
        return raw


def _policy(r) -> dict:
    d = dict(r)
    d["knobs"] = _knobs(d["knobs"])
    d["program"] = program_key(d.pop("exe"), d.pop("build_id"), d["users"])
    d["best"] = bool(d["best"])
    d["pinned"] = bool(d["pinned"])
    return d


def _users_of(who: str) -> str | None:
    """#USERS of a program name as a program's users ("0,101"), or None when
    a name in it is no user here."""
    try:
        return users_text(parse_users(who, "users"))
    except ConfigError:
        return None


def _resolve(t: str, progs: list[dict]) -> list[dict]:
    """The programs t names: the first way of naming that fits any (see
    Store.find_program), in order."""
    ways = [lambda p: str(p["id"]) == t, lambda p: p["key"] == t, lambda p: p["exe"] == t,
            lambda p: os.path.basename(p["exe"]) == t]
    if "#" in t:
        name, who = t.rsplit("#", 1)
        users = _users_of(who)
        ways.append(lambda p: (name in (p["exe"], os.path.basename(p["exe"]), f"{p['exe']}@{p['build_id']}")
                               and (p["users"] == users or p["users_names"] == who)))
    ways.append(lambda p: p["key"].startswith(t))
    # A command the kernel knows by another name (ops, issue 17): Debian's
    # redis-server is a link to redis-check-rdb, the executable learnd sees.
    real = _command_path(t)
    if real:
        ways.append(lambda p: p["exe"] == real)
    for match in ways:
        hits = [p for p in progs if match(p)]
        if hits:
            return hits
    return []


def _command_path(t: str) -> str | None:
    """The executable a command name or path runs (links followed), or None."""
    if not t or "#" in t or "@" in t:
        return None
    import shutil
    found = shutil.which(t) if "/" not in t else (t if os.path.isfile(t) else None)
    return os.path.realpath(found) if found else None


def _unique_name(p: dict, progs: list[dict]) -> str:
    """The shortest name that names p alone: base#users, exe#users, the key, its id."""
    for name in (f"{os.path.basename(p['exe'])}#{p['users']}", f"{p['exe']}#{p['users']}", p["key"]):
        if _resolve(name, progs) == [p]:
            return name
    return str(p["id"])


def _statements(sql):
    """Splits a migration into statements (sqlite3.complete_statement knows
    where one ends, semicolons in strings and comments included)."""
    buf = ""
    for line in sql.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            if buf.strip():
                yield buf
            buf = ""
    if buf.strip() and not all(ln.strip().startswith("--") or not ln.strip() for ln in buf.splitlines()):
        raise StoreError(f"unterminated statement in a migration: {buf.strip()[:60]!r}")
