-- hakmem-learnd's store, migration 1. Applied with its record in
-- schema_migrations in one transaction (learner/hakmem/store.py).
-- Times are unix seconds (REAL). Rates are per second. Costs are the
-- objective's units: core-seconds per second of allocator time plus the
-- memory term (learner/hakmem/objective.py).

-- A program: an executable and its build identity. Policies belong here.
CREATE TABLE programs (
  id            INTEGER PRIMARY KEY,
  exe           TEXT NOT NULL,             -- /proc/<pid>/exe at discovery
  build_id      TEXT NOT NULL,             -- GNU build id (hex), or "stat:<size>:<mtime>"
  first_seen    REAL NOT NULL,
  last_seen     REAL NOT NULL,
  class_sizes   TEXT NOT NULL,             -- JSON array: the class table knob arrays index
  best_policy   INTEGER REFERENCES policies(id),   -- lowest measured objective
  pinned_policy INTEGER REFERENCES policies(id),   -- set by an operator: learnd applies it and does not explore
  mix           TEXT,                      -- JSON: allocation share per class the best was learned under
  UNIQUE (exe, build_id)
);

-- A process seen publishing telemetry.
CREATE TABLE processes (
  id          INTEGER PRIMARY KEY,
  program_id  INTEGER NOT NULL REFERENCES programs(id),
  pid         INTEGER NOT NULL,
  start_time  INTEGER NOT NULL,            -- clock ticks since boot, as in the ring file name
  uid         INTEGER NOT NULL,
  first_seen  REAL NOT NULL,
  last_seen   REAL NOT NULL,
  exited      REAL,                        -- when learnd saw it gone (NULL: alive or unknown)
  UNIQUE (pid, start_time)
);
CREATE INDEX processes_program ON processes(program_id);

-- A policy of a program, stored once per distinct set of knobs.
CREATE TABLE policies (
  id           INTEGER PRIMARY KEY,
  program_id   INTEGER NOT NULL REFERENCES programs(id),
  version      INTEGER NOT NULL,           -- 1, 2, ... per program
  origin       TEXT NOT NULL CHECK (origin IN ('default', 'learned', 'replay', 'pinned')),
  knobs        TEXT NOT NULL,              -- JSON {"drain_ms": n, "tcache_cap": [...], "tcache_batch": [...], "warm_slabs": [...]}
  digest       TEXT NOT NULL,              -- sha256 of the canonical knobs JSON
  created      REAL NOT NULL,
  objective    REAL,                       -- mean cost measured under it (NULL: not measured)
  objective_sd REAL,
  evaluations  INTEGER NOT NULL DEFAULT 0, -- windows measured under it
  note         TEXT,
  UNIQUE (program_id, version),
  UNIQUE (program_id, digest)
);

-- One sampled window of one process. Old rows are merged by retention
-- (store.py: retain): `merged` raw windows per row, rates averaged.
CREATE TABLE windows (
  id              INTEGER PRIMARY KEY,
  process_id      INTEGER NOT NULL REFERENCES processes(id),
  policy_id       INTEGER REFERENCES policies(id),   -- in force for the whole window (NULL: changed during it)
  t_start         REAL NOT NULL,
  t_end           REAL NOT NULL,
  merged          INTEGER NOT NULL DEFAULT 1,
  allocs          REAL NOT NULL,           -- per second, all classes
  refills         REAL NOT NULL,
  drains          REAL NOT NULL,
  remote_frees    REAL NOT NULL,
  slow_ns         REAL NOT NULL,           -- ns of slow path per second
  os_calls        REAL NOT NULL,           -- mmap+munmap+madvise per second
  minflt          REAL NOT NULL,           -- page faults per second (/proc/<pid>/stat)
  rss_bytes       REAL NOT NULL,
  cached_bytes    REAL NOT NULL,
  live_bytes      REAL NOT NULL,
  committed_bytes REAL NOT NULL,
  time_cost       REAL NOT NULL,
  mem_cost        REAL NOT NULL,
  cost            REAL NOT NULL,
  mix             BLOB                     -- float32 allocs/s per class; NULL once merged
);
CREATE INDEX windows_process_time ON windows(process_id, t_end);
CREATE INDEX windows_policy ON windows(policy_id);
CREATE INDEX windows_time ON windows(t_end);

-- A verdict on a policy: measured over some windows against a baseline.
CREATE TABLE evaluations (
  id                 INTEGER PRIMARY KEY,
  program_id         INTEGER NOT NULL REFERENCES programs(id),
  policy_id          INTEGER NOT NULL REFERENCES policies(id),
  t_start            REAL NOT NULL,
  t_end              REAL NOT NULL,
  windows            INTEGER NOT NULL,
  cost_mean          REAL NOT NULL,
  cost_sd            REAL,
  time_cost          REAL,
  mem_cost           REAL,
  baseline_policy_id INTEGER REFERENCES policies(id),
  baseline_cost      REAL,
  verdict            TEXT NOT NULL CHECK (verdict IN ('measured', 'accepted', 'rejected', 'rolled_back')),
  learner            TEXT NOT NULL,
  objective          TEXT NOT NULL          -- the objective it was measured under, as text
);
CREATE INDEX evaluations_program ON evaluations(program_id, t_end);
