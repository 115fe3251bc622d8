-- hakmem-learnd's store, migration 2: a program is learned per user.
-- Applied with its record in schema_migrations in one transaction
-- (learner/hakmem/store.py).
--
-- A program becomes (exe, build_id, users): `users` is the uid of its
-- processes as a decimal string ("1000"), or, when the configuration pools
-- users' evidence (pool_users), the sorted pooled uids joined by commas
-- ("0,101"). Evidence from one user never reaches another user's processes
-- (issue 10, finding 4: a user forging counters in their own process's
-- telemetry steered the policy root's processes got).
--
-- Existing programs get `users` from their processes: the distinct uids,
-- sorted, joined by commas. A program pooled from several users keeps its
-- evidence under that pooled key (applied only when the configuration pools
-- exactly those users); a program with no process gets "" and is never
-- matched by a live process. Ids are kept, so processes, policies and
-- evaluations still point at the same rows.
--
-- SQLite cannot change a UNIQUE constraint, so the table is rebuilt. The
-- rows are copied aside, the table dropped and made again, and the rows put
-- back: with foreign keys deferred, dropping the table counts a violation
-- per row that refers to it, and putting each parent row back counts them
-- off again, so the commit checks that every reference still holds. (A
-- rename of a new table over the old one would leave the drop's count
-- standing: the commit would fail.)
PRAGMA defer_foreign_keys = ON;

-- The distinct uids of each program's processes, sorted, joined by commas
-- (group_concat's order is not defined: built one uid at a time instead).
CREATE TEMP TABLE program_users_0002 AS
WITH RECURSIVE
  ranked(program_id, uid, n) AS (
    SELECT program_id, uid, row_number() OVER (PARTITION BY program_id ORDER BY uid)
    FROM (SELECT DISTINCT program_id, uid FROM processes)),
  joined(program_id, n, users) AS (
    SELECT program_id, n, CAST(uid AS TEXT) FROM ranked WHERE n = 1
    UNION ALL
    SELECT r.program_id, r.n, j.users || ',' || r.uid
    FROM joined j JOIN ranked r ON r.program_id = j.program_id AND r.n = j.n + 1)
SELECT program_id, users FROM joined j
WHERE n = (SELECT max(n) FROM ranked r WHERE r.program_id = j.program_id);

CREATE TEMP TABLE programs_0002 AS
SELECT g.id, g.exe, g.build_id, coalesce(u.users, '') AS users, g.first_seen, g.last_seen, g.class_sizes,
       g.best_policy, g.pinned_policy, g.mix
FROM programs g LEFT JOIN program_users_0002 u ON u.program_id = g.id;

DROP TABLE programs;

-- A program: an executable, its build identity and the users whose
-- processes it learns from. Policies belong here.
CREATE TABLE programs (
  id            INTEGER PRIMARY KEY,
  exe           TEXT NOT NULL,             -- /proc/<pid>/exe at discovery
  build_id      TEXT NOT NULL,             -- GNU build id (hex), or "stat:<size>:<mtime>"
  users         TEXT NOT NULL,             -- "1000", or pooled uids sorted, joined by commas: "0,101"
  first_seen    REAL NOT NULL,
  last_seen     REAL NOT NULL,
  class_sizes   TEXT NOT NULL,             -- JSON array: the class table knob arrays index
  best_policy   INTEGER REFERENCES policies(id),   -- lowest measured objective
  pinned_policy INTEGER REFERENCES policies(id),   -- set by an operator: learnd applies it and does not explore
  mix           TEXT,                      -- JSON: allocation share per class the best was learned under
  UNIQUE (exe, build_id, users)
);

INSERT INTO programs (id, exe, build_id, users, first_seen, last_seen, class_sizes, best_policy, pinned_policy, mix)
SELECT id, exe, build_id, users, first_seen, last_seen, class_sizes, best_policy, pinned_policy, mix
FROM programs_0002 ORDER BY id;

DROP TABLE programs_0002;
DROP TABLE program_users_0002;
