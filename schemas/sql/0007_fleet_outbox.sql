-- hakmem-learnd's store, migration 7: what learnd must still push to the
-- fleet (learner/hakmem/fleet.py). A row is queued in the transaction that
-- stores its evaluation (or a new best policy), so nothing is lost while the
-- fleet database is away, and deleted once the database has it. seq never
-- repeats (AUTOINCREMENT): with the file's epoch it is the push's
-- idempotency key, so a batch pushed twice is counted once.
CREATE TABLE fleet_outbox (
  seq     INTEGER PRIMARY KEY AUTOINCREMENT,
  kind    TEXT NOT NULL CHECK (kind IN ('evaluation', 'best')),
  body    TEXT NOT NULL,             -- JSON: fleet.py outbox_evaluation, or the best policy
  verdict TEXT,                      -- an evaluation's, so a full outbox drops plain measurements first
  created REAL NOT NULL
);

-- Facts about this file the fleet needs: its epoch (a random id made once).
CREATE TABLE fleet_meta (
  name  TEXT PRIMARY KEY,
  value TEXT NOT NULL
);
