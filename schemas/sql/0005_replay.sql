-- Migration 5: offline replay results (`hakmem replay`, learner/hakmem/replay.py).
-- One row per trace and policy replayed through build/hakmem-replay: what
-- the replayer measured (medians over `repeat` runs) and the cost the live
-- objective gives it (learner/hakmem/objective.py), in the units of the
-- evaluations table. A sweep stores each row as it completes, keyed by the
-- trace's content and the policy asked for, so a rerun skips what is here.
CREATE TABLE replay_runs (
  id             INTEGER PRIMARY KEY,
  trace_hash     TEXT NOT NULL,           -- sha256 of the trace file's bytes
  trace_path     TEXT NOT NULL,           -- where it was when replayed
  exe            TEXT NOT NULL,           -- the trace header's program
  build_id       TEXT NOT NULL,
  program_id     INTEGER REFERENCES programs(id),  -- when the program is known (promoted, or seen by learnd)
  knobs          TEXT NOT NULL,           -- JSON: the policy asked for ({} = the allocator's default)
  knobs_hash     TEXT NOT NULL,           -- sha256 of that JSON, canonical
  policy         TEXT,                    -- JSON: every knob in force, as the replayer reported it
  objective      TEXT NOT NULL,           -- Objective.describe() the cost was computed under
  repeat         INTEGER NOT NULL,        -- runs the medians are over
  wall_s         REAL,
  cpu_s          REAL,
  peak_rss_bytes REAL,
  os_calls       REAL,                    -- mmap+munmap+madvise per run
  minflt         REAL,
  time_cost      REAL,                    -- core-seconds per second of the traced program
  mem_cost       REAL,
  cost           REAL NOT NULL,           -- time_cost + mem_cost: the median run's
  spread         REAL,                    -- (max - min) / median of the runs' costs
  result         TEXT,                    -- the replayer's whole --json output
  created        REAL NOT NULL,
  UNIQUE (trace_hash, knobs_hash, objective)
);
CREATE INDEX replay_runs_trace ON replay_runs(trace_hash);
