"""Programs are learned per user (issue 10, finding 4): the configuration's
pool_users and users_key, the store's programs keyed (exe, build id, users),
how the CLI's names find them, and migration 0002 on a database made before;
retention (raw windows merged per minute after 6 h, dropped after 30 days).

Real SQLite files; no learnd, no allocator.
"""
import contextlib
import json
import pwd
import sqlite3

import numpy as np
import pytest

from hakmem import config
from hakmem import layout as L
from hakmem.config import Config, ConfigError
from hakmem.learning import Evaluation, canonical
from hakmem.store import SCHEMA_DIR, Store, StoreError, migrations

SIZES = [0] + [16 * i for i in range(1, L.NUM_CLASSES)]
EXE, BUILD = "/usr/bin/python3.11", "ab12"
OBJECTIVE = "time + 0.125/GiB"


def _name(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


ROOT_NAME = _name(0)                                   # "root"
NOBODY = pwd.getpwnam("nobody").pw_uid                 # a second user every Linux has
UNNAMED = next(u for u in range(4_200_000, 4_300_000) if _name(u) is None)   # a uid with no name here


def knobs(drain=100, cap=64):
    n = L.NUM_CLASSES - 1
    return canonical({"drain_ms": drain, "tcache_cap": [0] + [cap] * n, "tcache_batch": [0] + [16] * n,
                      "warm_slabs": [0] + [1] * n})


def one_line(e):
    s = str(e.value)
    assert "\n" not in s, s
    return s


# ---- configuration: who is pooled -------------------------------------------------------
def test_users_key_is_the_uid_unless_pooled(tmp_path):
    c = Config()
    assert c.pool_users == () and c.users_key(0) == "0" and c.users_key(1000) == "1000"

    toml = tmp_path / "learnd.toml"
    toml.write_text(f'pool_users = ["nobody", "{ROOT_NAME}", 0]\n')   # names and uids, once each
    c = config.load(str(toml))
    assert c.pool_users == (0, NOBODY)
    pooled = f"0,{NOBODY}"                               # sorted as numbers
    assert c.users_key(0) == pooled and c.users_key(NOBODY) == pooled
    assert c.users_key(1000) == "1000" and c.users_key(UNNAMED) == str(UNNAMED)

    # The flag: a comma-separated string, winning over the file; "" pools nobody.
    c = config.load(str(toml), pool_users=f" {UNNAMED}, nobody ")
    assert c.pool_users == (NOBODY, UNNAMED) and c.users_key(0) == "0"
    assert c.users_key(UNNAMED) == f"{NOBODY},{UNNAMED}"
    assert config.load(str(toml), pool_users="").pool_users == ()
    assert config.load(None, pool_users=None).pool_users == ()
    # Numbers sort as numbers: 99 before 100.
    assert config.load(None, pool_users="100,99").users_key(100) == "99,100"


@pytest.mark.parametrize("text, want", [
    ('pool_users = ["no-such-user-hk"]', "pool_users: no user named 'no-such-user-hk' on this machine"),
    ('pool_users = "root"', "pool_users must be a list of user names or uids, got 'root'"),
    ("pool_users = [true]", "pool_users: a user is a name or a uid, got True"),
    ("pool_users = [-1]", "pool_users: -1 is not a uid"),
    ("pool_users = [4294967295]", "pool_users: 4294967295 is not a uid"),
])
def test_pool_users_errors(tmp_path, text, want):
    toml = tmp_path / "learnd.toml"
    toml.write_text(text + "\n")
    with pytest.raises(ConfigError) as e:
        config.load(str(toml))
    assert one_line(e) == f"{toml}: {want}"


def test_pool_users_flag_errors():
    with pytest.raises(ConfigError) as e:
        config.load(None, pool_users="root,no-such-user-hk")
    assert one_line(e) == "--pool-users: no user named 'no-such-user-hk' on this machine"


def test_users_names():
    assert config.users_names("0") == ROOT_NAME
    assert config.users_names(f"0,{NOBODY}") == f"{ROOT_NAME},nobody"
    assert config.users_names(f"0,{UNNAMED}") == f"{ROOT_NAME},{UNNAMED}"       # no name: the number
    assert config.users_names("") == ""


# ---- the store: one program per users ------------------------------------------------------
@pytest.fixture
def store(tmp_path):
    with contextlib.closing(Store(tmp_path / "learn.db")) as s:
        yield s


def _evaluate(s, prog, pol, k, cost):
    s.add_evaluation(prog, pol, Evaluation(k, 0.0, 10.0, 10, cost, 0.001, cost, 0.0, "accepted"), "gp", OBJECTIVE)


def test_two_users_of_one_executable_are_two_programs(store):
    s = store
    root = s.program(EXE, BUILD, "0", SIZES)
    user = s.program(EXE, BUILD, "1000", SIZES)
    pooled = s.program(EXE, BUILD, f"0,{NOBODY}", SIZES)
    assert len({root, user, pooled}) == 3
    assert s.program(EXE, BUILD, "1000", SIZES) == user          # found again, not made twice

    # The user forges a great cost for wild knobs: only the user's program learns it.
    forged = knobs(drain=1, cap=4096)
    p_user = s.policy(user, forged, "learned")
    _evaluate(s, user, p_user, forged, 1e-9)
    s.set_best(user, p_user)
    s.pin(user, p_user)
    p_root = s.policy(root, knobs(), "default")
    _evaluate(s, root, p_root, knobs(), 0.02)
    s.set_best(root, p_root)
    p_root_pin = s.policy(root, knobs(drain=7), "pinned")
    s.pin(root, p_root_pin)

    assert p_user != s.policy(root, forged, "learned")           # the same knobs: another row, another program
    assert s.chosen(root)["id"] == p_root_pin and s.chosen(user)["id"] == p_user and s.chosen(pooled) is None
    assert [p.knobs for p in s.priors(root, OBJECTIVE)] == [knobs()]
    assert [p.knobs for p in s.priors(user, OBJECTIVE)] == [forged]
    assert s.priors(pooled, OBJECTIVE) == []
    s.unpin(user)
    assert s.chosen(root)["id"] == p_root_pin                    # the other user's pin is untouched

    rows = {r["id"]: r for r in s.programs()}
    assert rows[root]["key"] == f"{EXE}@{BUILD}#0" and rows[root]["users"] == "0"
    assert rows[root]["users_names"] == ROOT_NAME and rows[root]["best_policy"] == p_root
    assert rows[root]["pinned_policy"] == p_root_pin
    assert rows[user]["best_policy"] == p_user and rows[user]["pinned_policy"] is None
    assert rows[pooled]["key"] == f"{EXE}@{BUILD}#0,{NOBODY}"
    assert rows[pooled]["users_names"] == f"{ROOT_NAME},nobody"
    assert {r["program"] for r in s.policies(user)} == {f"{EXE}@{BUILD}#1000"}
    assert s.policy_by_id(p_root)["users"] == "0"
    proc = s.process(user, 4242, 1, 1000)
    assert [(r["id"], r["program"], r["users"]) for r in s.processes()] == [(proc, f"{EXE}@{BUILD}#1000", "1000")]
    with pytest.raises(sqlite3.IntegrityError):                  # the key is unique
        s.db.execute("INSERT INTO programs (exe, build_id, users, first_seen, last_seen, class_sizes) "
                     "VALUES (?, ?, '0', 0, 0, '[]')", (EXE, BUILD))


# ---- names -------------------------------------------------------------------------------
def test_find_program_by_users(store):
    s = store
    root = s.program(EXE, BUILD, "0", SIZES)
    user = s.program(EXE, BUILD, "1000", SIZES)
    pooled = s.program(EXE, BUILD, f"0,{NOBODY}", SIZES)
    unnamed = s.program(EXE, BUILD, str(UNNAMED), SIZES)
    other = s.program("/usr/bin/sqlite3", "cd34", "1000", SIZES)
    find = lambda t: s.find_program(t)["id"]                      # noqa: E731
    assert find(str(root)) == root and find(f"{EXE}@{BUILD}#1000") == user
    assert find("python3.11#0") == root and find(f"python3.11#{ROOT_NAME}") == root
    assert find(f"{EXE}#1000") == user and find(f"{EXE}@{BUILD}#0") == root
    assert find(f"python3.11#0,{NOBODY}") == pooled
    assert find(f"python3.11#nobody,{ROOT_NAME}") == pooled       # names, in any order
    assert find(f"python3.11#{ROOT_NAME},nobody") == pooled
    assert find(f"python3.11#{UNNAMED}") == unnamed
    assert find("sqlite3") == other                               # one program: no users needed

    with pytest.raises(StoreError) as e:
        s.find_program("python3.11")
    msg = one_line(e)
    assert msg.startswith("'python3.11' names 4 programs: ")
    for pid, users, names in ((root, "0", ROOT_NAME), (user, "1000", config.users_names("1000")),
                              (pooled, f"0,{NOBODY}", f"{ROOT_NAME},nobody"), (unnamed, str(UNNAMED), str(UNNAMED))):
        assert f"python3.11#{users} (id {pid}, users {names})" in msg, msg
    assert msg.endswith("; name one of them as shown, or by id")
    with pytest.raises(StoreError, match="'/usr/bin/python3.11@ab12' names 4 programs"):
        s.find_program(f"{EXE}@{BUILD}")                          # a key's prefix: every user's
    for t in ("python3.11#no-such-user-hk", "python3.11#4", "sqlite3#0", "nosuch"):
        with pytest.raises(StoreError, match=f"^no program matches '{t}'"):
            s.find_program(t)

    # Two builds for one user: base#users is not enough; the key is offered.
    new = s.program(EXE, "ef56", "1000", SIZES)
    with pytest.raises(StoreError) as e:
        s.find_program("python3.11#1000")
    msg = one_line(e)
    assert msg.startswith("'python3.11#1000' names 2 programs: ")
    assert f"{EXE}@{BUILD}#1000 (id {user}," in msg and f"{EXE}@ef56#1000 (id {new}," in msg
    assert find(f"{EXE}@ef56#1000") == new


# ---- migration 0002 ------------------------------------------------------------------------
def _database_of_migration_1(path):
    """A database as hakmem made it before programs were per user: migration
    1 alone, recorded, with rows in every table."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA foreign_keys = ON")
    db.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
               "applied REAL NOT NULL)")
    db.executescript((SCHEMA_DIR / "0001_initial.sql").read_text())
    db.execute("INSERT INTO schema_migrations VALUES (1, 'initial', 1.0)")
    sizes = json.dumps(SIZES)
    # Program 3: root's alone. Program 7: processes of three users (uids
    # that sort differently as text and as numbers). Program 9: no process.
    for pid_, exe, build in ((3, "/usr/sbin/nginx", "aa"), (7, EXE, BUILD), (9, "/opt/idle", "bb")):
        db.execute("INSERT INTO programs (id, exe, build_id, first_seen, last_seen, class_sizes) "
                   "VALUES (?, ?, ?, 1, 2, ?)", (pid_, exe, build, sizes))
    pol = 20
    for prog in (3, 7, 9):
        for v in (1, 2):
            k = knobs(drain=10 * v + prog)
            db.execute("INSERT INTO policies (id, program_id, version, origin, knobs, digest, created) "
                       "VALUES (?, ?, ?, 'learned', ?, ?, 1)", (pol, prog, v, json.dumps(k), f"d{pol}"))
            pol += 1
    db.execute("UPDATE programs SET best_policy = 20, pinned_policy = 21, mix = '[0.5]' WHERE id = 3")
    db.execute("UPDATE programs SET best_policy = 23 WHERE id = 7")
    db.execute("UPDATE programs SET pinned_policy = 24 WHERE id = 9")
    procs = [(3, 100, 0), (3, 101, 0), (7, 102, 1000), (7, 103, 99), (7, 104, 100), (7, 105, 1000)]
    for i, (prog, pid, uid) in enumerate(procs, start=50):
        db.execute("INSERT INTO processes (id, program_id, pid, start_time, uid, first_seen, last_seen) "
                   "VALUES (?, ?, ?, 1, ?, 1, 2)", (i, prog, pid, uid))
    cols = "allocs refills drains remote_frees slow_ns os_calls minflt rss_bytes cached_bytes live_bytes " \
           "committed_bytes time_cost mem_cost cost".split()
    db.execute(f"INSERT INTO windows (process_id, policy_id, t_start, t_end, {', '.join(cols)}) "
               f"VALUES (52, 23, 1, 2, {', '.join('1' * len(cols))})")
    db.execute("INSERT INTO evaluations (program_id, policy_id, t_start, t_end, windows, cost_mean, verdict, "
               "learner, objective) VALUES (7, 23, 1, 2, 5, 0.5, 'accepted', 'gp', ?)", (OBJECTIVE,))
    db.close()


DUMPED = ("processes", "policies", "windows", "evaluations")


def _dump(path, like=None):
    """Every row of the tables a migration must keep. With like (an earlier
    dump), only the columns that dump had: later migrations may add some."""
    db = sqlite3.connect(path)
    try:
        out = {}
        for t in DUMPED:
            cols = like[t][0] if like else [r[1] for r in db.execute(f"PRAGMA table_info({t})")]
            out[t] = (cols, db.execute(f"SELECT {', '.join(cols)} FROM {t} ORDER BY id").fetchall())
        return out
    finally:
        db.close()


def test_migration_0002_keeps_every_row_and_adds_users(tmp_path):
    path = tmp_path / "learn.db"
    _database_of_migration_1(path)
    before = _dump(path)

    s = Store(path)
    try:
        assert s.schema_version() == LATEST      # 0002, then every later migration
        assert s.integrity_check() == "ok"
        assert s.db.execute("PRAGMA foreign_key_check").fetchall() == []
        assert s.db.execute("SELECT name FROM sqlite_temp_master").fetchall() == []     # nothing left aside
        assert [tuple(r) for r in s.db.execute("SELECT version, name FROM schema_migrations")][:2] == \
            [(1, "initial"), (2, "per_user_programs")]
        progs = {r["id"]: r for r in s.programs()}
        assert {i: (r["key"], r["best_policy"], r["pinned_policy"]) for i, r in progs.items()} == {
            3: ("/usr/sbin/nginx@aa#0", 20, 21),
            7: (f"{EXE}@{BUILD}#99,100,1000", 23, None),          # pooled from several users: kept pooled
            9: ("/opt/idle@bb#", None, 24),                       # no process: no users, never matched
        }
        assert progs[3]["mix"] == [0.5] and progs[3]["first_seen"] == 1 and progs[3]["class_sizes"] == SIZES
        assert s.chosen(3)["id"] == 21 and s.chosen(7)["id"] == 23 and s.chosen(9)["id"] == 24
        assert [p.cost_mean for p in s.priors(7, OBJECTIVE)] == [0.5]
        # The new key: the same executable for one user is a new program.
        assert s.program("/usr/sbin/nginx", "aa", "0", SIZES) == 3
        fresh = s.program(EXE, BUILD, "1000", SIZES)
        assert fresh not in progs and s.chosen(fresh) is None
        assert s.program(EXE, BUILD, "99,100,1000", SIZES) == 7
    finally:
        s.close()
    assert _dump(path, like=before) == before                      # ids and rows of every other table kept

    applied = sqlite3.connect(path).execute("SELECT applied FROM schema_migrations WHERE version = 2").fetchone()
    with contextlib.closing(Store(path)) as s:                     # a second open: nothing to do
        assert s.schema_version() == LATEST
        assert s.db.execute("SELECT applied FROM schema_migrations WHERE version = 2").fetchone()[0] == applied[0]
        assert len(s.programs()) == 4
    with contextlib.closing(Store(path, readonly=True)) as s:
        assert s.find_program("nginx")["users"] == "0"


def test_migration_0002_is_all_or_nothing(tmp_path, monkeypatch):
    """A migration that fails leaves the database as it was (its statements
    and its record are one transaction)."""
    path = tmp_path / "learn.db"
    _database_of_migration_1(path)
    schema = tmp_path / "sql"
    schema.mkdir()
    for f in SCHEMA_DIR.glob("*.sql"):
        text = f.read_text()
        if f.name.startswith("0002"):
            text += "\nINSERT INTO no_such_table VALUES (1);\n"     # fails after the rebuild
        (schema / f.name).write_text(text)
    import hakmem.store
    monkeypatch.setattr(hakmem.store, "SCHEMA_DIR", schema)
    monkeypatch.setattr(hakmem.store.migrations, "__defaults__", (schema,))
    before = _dump(path)
    with pytest.raises(StoreError, match="no such table: no_such_table"):
        Store(path)
    db = sqlite3.connect(path)
    assert db.execute("SELECT max(version) FROM schema_migrations").fetchone() == (1,)
    assert "users" not in [r[1] for r in db.execute("PRAGMA table_info(programs)")]
    assert db.execute("SELECT count(*) FROM programs").fetchone() == (3,)
    db.close()
    assert _dump(path) == before


# ---- retention: raw windows merged per minute after 6 h, dropped after 30 days ------------
H, DAY = 3600.0, 86400.0
NOW = 60 * 20_000_000 + 30.0          # 30 s into a minute
LATEST = len(migrations())     # the schema version every open migrates to

VALUE_COLS = ("allocs", "refills", "drains", "remote_frees", "slow_ns", "os_calls", "minflt", "rss_bytes",
              "cached_bytes", "live_bytes", "committed_bytes", "time_cost", "mem_cost", "cost")


def _window(proc, pol, t_end, v, mix=True, merged=1):
    """A window ending at t_end whose every value column is v (cost: 2v)."""
    row = {c: float(v) for c in VALUE_COLS}
    row.update(cost=2.0 * v, process_id=proc, policy_id=pol, t_start=t_end - 1.0, t_end=t_end, merged=merged,
               mix=np.arange(L.NUM_CLASSES, dtype=np.float32) if mix else None)
    return row


def _windows(path):
    """Every window as (process, policy, t_start, t_end, merged, allocs, cost, has mix), in time order."""
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT process_id, policy_id, t_start, t_end, merged, allocs, cost, mix IS NOT NULL "
                          "FROM windows ORDER BY t_end, process_id, policy_id").fetchall()
    finally:
        db.close()


def test_retention_merges_raw_windows_per_minute_after_6_hours_and_drops_them_after_30_days(tmp_path):
    """Store.retain with its defaults (learnd's: Config.raw_hours 6, keep_days
    30) on a real file: which rows it keeps, merges and drops, to the second,
    and the merged rows' values (the mean of what they merge)."""
    path = tmp_path / "learn.db"
    s = Store(path)
    prog = s.program(EXE, BUILD, "0", SIZES, now=NOW)
    proc, other = s.process(prog, 100, 1, 0, now=NOW), s.process(prog, 101, 1, 0, now=NOW)
    a, b = s.policy(prog, knobs(cap=64), "default", now=NOW), s.policy(prog, knobs(cap=128), "learned", now=NOW)
    minute = 60 * int((NOW - 7 * H) // 60)           # a minute 7 h ago
    rows = [
        _window(proc, a, NOW - 10, 5),                # recent: kept as it is
        _window(proc, a, NOW - 6 * H + 1, 7),         # 1 s short of 6 h: kept as it is
        _window(proc, a, NOW - 6 * H - 1, 9),         # 1 s past 6 h: merged, alone in its minute
        # one minute 7 h ago: 4 windows of (proc, a) merged into one, mean 3;
        _window(proc, a, minute + 1, 1), _window(proc, a, minute + 20, 2),
        _window(proc, a, minute + 40, 3), _window(proc, a, minute + 59.5, 6),
        _window(proc, b, minute + 30, 10),            # another policy: a row of its own
        _window(other, a, minute + 30, 20),           # another process: a row of its own
        _window(proc, a, minute + 60, 11),            # the next minute: a row of its own
        _window(proc, None, minute + 10, 12), _window(proc, None, minute + 50, 14),   # no single policy: merged too
        _window(proc, a, NOW - 30 * DAY + 60, 30),    # 30 days less a minute: merged, kept
        _window(proc, a, NOW - 30 * DAY - 1, 31),     # 30 days and a second: dropped
        _window(proc, a, NOW - 40 * DAY, 40),         # long gone: dropped
        _window(proc, a, NOW - 8 * H, 50, mix=False, merged=5),   # merged before: kept, not merged again
        _window(proc, a, NOW - 31 * DAY, 60, mix=False, merged=5),  # merged before, past 30 days: dropped
    ]
    assert s.add_windows(rows) == len(rows)
    before = _windows(path)
    assert len(before) == 17

    assert s.retain(now=NOW) == {"before": 17, "after": 10}
    want = sorted([
        (proc, a, NOW - 30 * DAY + 59, NOW - 30 * DAY + 60, 1, 30.0, 60.0, 0),
        (proc, a, NOW - 8 * H - 1, NOW - 8 * H, 5, 50.0, 100.0, 0),
        (proc, a, minute, minute + 59.5, 4, 3.0, 6.0, 0),
        (proc, b, minute + 29, minute + 30, 1, 10.0, 20.0, 0),
        (other, a, minute + 29, minute + 30, 1, 20.0, 40.0, 0),
        (proc, None, minute + 9, minute + 50, 2, 13.0, 26.0, 0),
        (proc, a, minute + 59, minute + 60, 1, 11.0, 22.0, 0),
        (proc, a, NOW - 6 * H - 2, NOW - 6 * H - 1, 1, 9.0, 18.0, 0),
        (proc, a, NOW - 6 * H, NOW - 6 * H + 1, 1, 7.0, 14.0, 1),
        (proc, a, NOW - 11, NOW - 10, 1, 5.0, 10.0, 1),
    ], key=lambda r: (r[3], r[0], r[1] or 0))
    assert _windows(path) == want
    # Every value column of a merged row is the mean of what it merged.
    db = sqlite3.connect(path)
    vals = db.execute(f"SELECT {', '.join(VALUE_COLS)} FROM windows WHERE merged = 4").fetchall()
    db.close()
    assert vals == [tuple([3.0] * 13 + [6.0])]
    # Again at once: nothing left to merge or drop.
    assert s.retain(now=NOW) == {"before": 10, "after": 10}
    assert _windows(path) == want
    # A day later the raw rows of then (the two recent ones) are merged; the
    # row 30 days less a minute old is dropped.
    assert s.retain(now=NOW + DAY) == {"before": 10, "after": 9}
    later = _windows(path)
    assert all(not r[7] for r in later) and sum(r[4] for r in later) == sum(r[4] for r in want) - 1
    assert s.integrity_check() == "ok"
    s.close()


def test_retention_keeps_at_most_max_rows_dropping_the_oldest(tmp_path):
    path = tmp_path / "learn.db"
    s = Store(path)
    prog = s.program(EXE, BUILD, "0", SIZES, now=NOW)
    proc = s.process(prog, 100, 1, 0, now=NOW)
    pol = s.policy(prog, knobs(), "default", now=NOW)
    s.add_windows([_window(proc, pol, NOW - 100 + i, i) for i in range(10)])
    assert s.retain(now=NOW, max_rows=4) == {"before": 10, "after": 4}
    assert [r[5] for r in _windows(path)] == [6.0, 7.0, 8.0, 9.0]
    s.close()


def test_recent_mixes_are_the_programs_latest_raw_windows_that_allocated_oldest_first(tmp_path):
    """A warm start's memory of the mixes a program ran (gp.py "mix_memory"):
    every process of the program, newest `limit` windows, in time order;
    windows of other programs, without a mix (merged) or without
    allocations are not mixes."""
    s = Store(tmp_path / "learn.db")
    prog = s.program(EXE, BUILD, "0", SIZES, now=NOW)
    other_prog = s.program("/usr/bin/other", BUILD, "0", SIZES, now=NOW)
    a, b = s.process(prog, 100, 1, 0, now=NOW), s.process(prog, 101, 1, 0, now=NOW)
    c = s.process(other_prog, 102, 1, 0, now=NOW)
    pol, pol_c = s.policy(prog, knobs(), "default", now=NOW), s.policy(other_prog, knobs(), "default", now=NOW)

    def win(proc, p, t, k, **kw):
        row = _window(proc, p, t, 1.0, **kw)
        if row["mix"] is not None:
            row["mix"] = np.eye(L.NUM_CLASSES, dtype=np.float32)[k] * 1000
        return row
    s.add_windows([win(a, pol, NOW - 10, 1), win(b, pol, NOW - 9, 2), win(c, pol_c, NOW - 8, 3),
                   win(a, pol, NOW - 7, 4, mix=False), win(b, pol, NOW - 6, 5) | {"allocs": 0.0},
                   win(a, pol, NOW - 5, 6)])
    got = s.recent_mixes(prog)
    assert [int(np.argmax(m)) for m in got] == [1, 2, 6] and all(float(m.sum()) == 1000.0 for m in got)
    assert [int(np.argmax(m)) for m in s.recent_mixes(prog, limit=2)] == [2, 6]
    # A damaged mix (a truncated blob, a NaN, text) is left out, the rest kept.
    for bad in (b"\x00\x00\x80", np.full(L.NUM_CLASSES, np.nan, dtype="<f4").tobytes(), "text"):
        s.db.execute("UPDATE windows SET mix = ? WHERE t_end = ?", (bad, NOW - 9))
        s.db.commit()
        assert [int(np.argmax(m)) for m in s.recent_mixes(prog)] == [1, 6]
    s.close()


def test_learnd_retention_settings_are_the_documented_ones():
    cfg = Config()
    assert (cfg.raw_hours, cfg.keep_days, cfg.max_windows, cfg.retain_every) == (6.0, 30.0, 500_000, 600.0)


# ---- the windows table's columns come from the migrations, its values from Window.row ----
def test_every_window_measure_has_a_source_in_window_row(store):
    """The columns are the table's (PRAGMA table_info), not a list here; each
    measure must be a key of learning.Window.row() (a counter of the layout by
    its name, a /proc measure or a cost), or learnd could not fill it."""
    from hakmem.learning import Window
    from hakmem.store import WINDOW_KEYS, WINDOW_MIX
    cols = store.window_columns()
    table = [r[1] for r in store.db.execute("PRAGMA table_info(windows)") if r[1] != "id"]
    assert list(cols) == table and set(WINDOW_KEYS) | {WINDOW_MIX} <= set(cols)
    assert set(VALUE_COLS) <= set(store.window_measures())   # and the columns later migrations add
    row = Window(0.0, 1.0).row()
    assert set(store.window_measures()) <= set(row), set(store.window_measures()) - set(row)


def test_a_migration_adding_a_counter_column_is_stored_and_retained(tmp_path, monkeypatch):
    """What adding a counter takes on the store's side: one migration adding
    its column. A row key of that name (Window.row() has one per counter of
    the layout) is then stored, and merged by retain() like every measure."""
    from hakmem import store as store_mod
    d = tmp_path / "sql"
    d.mkdir()
    for f in SCHEMA_DIR.iterdir():
        if f.name.endswith(".sql"):
            (d / f.name).write_text(f.read_text())
    n = len(store_mod.migrations())
    (d / f"{n + 1:04d}_window_probe.sql").write_text(
        "ALTER TABLE windows ADD COLUMN probe REAL NOT NULL DEFAULT 0;\n")
    orig = store_mod.migrations
    monkeypatch.setattr(store_mod, "migrations", lambda directory=d: orig(directory))
    with contextlib.closing(Store(tmp_path / "learn.db")) as s:
        assert "probe" in s.window_measures()
        prog = s.program("/bin/x", "b", "0", [0] * L.NUM_CLASSES, now=0)
        proc = s.process(prog, 1, 1, 0, now=0)
        pol = s.policy(prog, knobs(), "default", now=0)
        day = 86400.0
        s.add_windows([_window(proc, pol, 10.0 + i, 1.0) | {"probe": float(i)} for i in range(4)])
        assert [r[0] for r in s.db.execute("SELECT probe FROM windows ORDER BY t_end")] == [0, 1, 2, 3]
        s.retain(now=day)
        assert [tuple(r) for r in s.db.execute("SELECT merged, probe FROM windows")] == [(4, 1.5)]


def test_screened_says_whether_a_screening_ranked_the_program_under_the_objective(tmp_path):
    # learnd screens a warm program that has a stored policy and no ranking
    # (its cold run was cut short, or its screening failed) and never one
    # it screened before (daemon.py _screened_before).
    s = Store(tmp_path / "learn.db")
    a = s.program(EXE, BUILD, "0", SIZES)
    b = s.program("/usr/bin/perl", BUILD, "0", SIZES)
    assert not s.screened(a, OBJECTIVE) and not s.screened(b, OBJECTIVE)
    with s.tx() as db:
        db.execute("INSERT INTO replay_runs (trace_hash, trace_path, exe, build_id, program_id, knobs, knobs_hash, "
                   "objective, repeat, cost, created) VALUES ('h', 'descriptor 3', ?, ?, ?, '{}', 'k', ?, 1, 0.1, 0)",
                   (EXE, BUILD, a, OBJECTIVE))
    assert s.screened(a, OBJECTIVE)
    assert not s.screened(a, "time + 2/GiB"), "another objective ranks the policies otherwise"
    assert not s.screened(b, OBJECTIVE)
    s.close()


def test_a_policy_stored_before_retain_mib_is_the_same_policy_with_its_default(store):
    """A learnd of layout 6 stored its knobs without retain_mib. That row
    reads back with retain_mib 256 (the allocator's behaviour then), keeps
    its identity (the same knobs are found, not stored again), and a policy
    with another retain_mib is another row."""
    s = store
    prog = s.program(EXE, BUILD, "0", SIZES)
    old = {k: v for k, v in knobs(drain=250).items() if k != "retain_mib"}
    pid = s.policy(prog, knobs(drain=250), "learned")
    s.db.execute("UPDATE policies SET knobs = ? WHERE id = ?", (json.dumps(old, separators=(",", ":")), pid))
    s.db.commit()
    _evaluate(s, prog, pid, knobs(drain=250), 0.5)
    row = s.policy_by_id(pid)
    assert row["knobs"]["retain_mib"] == 256 and row["knobs"] == knobs(drain=250)
    assert s.policy(prog, old, "learned") == pid == s.policy(prog, knobs(drain=250), "learned")
    assert [p.knobs for p in s.priors(prog, OBJECTIVE)] == [knobs(drain=250)]
    low = dict(knobs(drain=250), retain_mib=0)
    other = s.policy(prog, low, "learned")
    assert other != pid and s.policy_by_id(other)["knobs"]["retain_mib"] == 0
