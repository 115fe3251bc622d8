-- hakmem's fleet store on PostgreSQL, migration 1. Applied by the database's
-- owner (`hakmem fleet migrate`, learner/hakmem/fleet.py) with its record in
-- hakmem.schema_migrations in one transaction, under an advisory lock.
--
-- Each learnd host connects as a database role of its own, a member of
-- hakmem_host; `hakmem fleet add-host NAME` makes the role and its row in
-- hakmem.hosts. Row-level security lets a host write only rows that carry
-- its own host id (hakmem.me(): the host whose role is current_user), so a
-- host cannot speak for another. What the hosts measured is pooled only
-- between hosts of one hardware class, and a policy is offered to other hosts
-- only once `k` hosts measured it better than their default beyond noise
-- (hakmem.offers); an excluded host's rows count for nothing.
--
-- Times are timestamptz; costs are learnd's objective units, `rel` a cost
-- divided by the default's cost measured beside it (below 1: cheaper).

-- Fleet-wide settings, written only by the owner (`hakmem fleet migrate --k
-- 3 --canary 0.1`): a host cannot lower the agreement the others rely on.
CREATE TABLE hakmem.settings (
  name  text PRIMARY KEY CHECK (name IN ('k', 'canary_fraction', 'canary_confirm')),
  value double precision NOT NULL
);
INSERT INTO hakmem.settings VALUES
  ('k', 3),                 -- hosts that measured a policy better than their default, before it is offered
  ('canary_fraction', 0.10),-- of a class's hosts, hashed: offered a new fleet policy first
  ('canary_confirm', 1);    -- canaries that kept it (not worse beyond noise) before the rest get it

-- A host: a role that logs in. Made by the owner; the host updates only
-- when it was last seen, its class and its software version.
CREATE TABLE hakmem.hosts (
  host_id      text PRIMARY KEY CHECK (host_id ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$'),
  role         name NOT NULL UNIQUE,
  hw_class     text,                    -- e.g. "c2-m16": CPU count and memory bucket, reported by the host
  version      text,                    -- the hakmem it runs
  added        timestamptz NOT NULL DEFAULT now(),
  last_seen    timestamptz,
  excluded     timestamptz,             -- set by the operator: its rows count for nothing
  excluded_why text,
  rank_key     text GENERATED ALWAYS AS (md5(host_id)) STORED   -- the canaries' order (hakmem.restage)
);
CREATE INDEX hosts_class_rank ON hakmem.hosts(hw_class, rank_key, host_id) WHERE excluded IS NULL;

-- The host behind the current session: NULL for a role that is no host.
CREATE FUNCTION hakmem.me() RETURNS text LANGUAGE sql STABLE AS
$$ SELECT host_id FROM hakmem.hosts WHERE role = current_user $$;

-- A program's fleet identity: its build, its executable's name (paths differ
-- between hosts), whose processes it learns from, and the hardware class.
CREATE TABLE hakmem.programs (
  id        bigserial PRIMARY KEY,
  build_id  text NOT NULL CHECK (length(build_id) <= 200),
  exe_name  text NOT NULL CHECK (length(exe_name) <= 255),
  users     text NOT NULL CHECK (length(users) <= 200),
  hw_class  text NOT NULL CHECK (length(hw_class) <= 40),
  first_pushed timestamptz NOT NULL DEFAULT now(),
  UNIQUE (build_id, exe_name, users, hw_class)
);

-- Every evaluation a host pushed, as it pushed it: the fleet's raw record.
-- (host_id, epoch, seq) is the push's idempotency key: seq numbers the
-- host's outbox rows, epoch its SQLite file (a new file starts a new epoch),
-- so a batch pushed twice inserts nothing the second time.
CREATE TABLE hakmem.evaluations (
  host_id        text NOT NULL REFERENCES hakmem.hosts(host_id),
  epoch          text NOT NULL CHECK (length(epoch) <= 64),
  seq            bigint NOT NULL,
  program_id     bigint NOT NULL REFERENCES hakmem.programs(id),
  knobs          jsonb NOT NULL,
  baseline_knobs jsonb,
  verdict        text NOT NULL CHECK (verdict IN ('measured', 'accepted', 'rejected', 'rolled_back')),
  source         text NOT NULL CHECK (source IN ('local', 'fleet')),   -- fleet: a trial of a fleet policy
  windows        integer NOT NULL,
  cost_mean      double precision NOT NULL,
  cost_sd        double precision,
  baseline_cost  double precision,
  objective      text NOT NULL,
  learner        text NOT NULL,
  t_start        timestamptz NOT NULL,
  t_end          timestamptz NOT NULL,
  pushed         timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (host_id, epoch, seq)
);
CREATE INDEX evaluations_program ON hakmem.evaluations(program_id, t_end);

-- Each host's latest verdict on a policy against its own default: the
-- evidence offers are made from. One row per host, program, policy and
-- source; a later measurement replaces an earlier one.
CREATE TABLE hakmem.verdicts (
  host_id    text NOT NULL REFERENCES hakmem.hosts(host_id),
  program_id bigint NOT NULL REFERENCES hakmem.programs(id),
  knobs      jsonb NOT NULL,
  source     text NOT NULL CHECK (source IN ('local', 'fleet')),
  vs_default text NOT NULL CHECK (vs_default IN ('better', 'within', 'worse')),
  rel        double precision,          -- its cost over the default's, as measured
  windows    integer NOT NULL,
  t_end      timestamptz NOT NULL,
  PRIMARY KEY (host_id, program_id, knobs, source)
);
CREATE INDEX verdicts_program ON hakmem.verdicts(program_id);

-- Each host's best policy per program, and when it last ran it.
CREATE TABLE hakmem.host_best (
  host_id    text NOT NULL REFERENCES hakmem.hosts(host_id),
  program_id bigint NOT NULL REFERENCES hakmem.programs(id),
  knobs      jsonb NOT NULL,
  origin     text NOT NULL CHECK (origin IN ('default', 'learned', 'replay', 'pinned', 'fleet')),
  updated    timestamptz NOT NULL,
  PRIMARY KEY (host_id, program_id)
);

-- Where each policy of a program stands in the fleet, from the verdicts of
-- non-excluded hosts. Recomputed per program when its evidence changed
-- (hakmem.dirty, hakmem.settle): a pull reads it, so 1,000 hosts pulling
-- cost a lookup each.
--   agree    hosts whose own search measured it better than their default
--   against  hosts whose own search measured it worse
--   canaries the hosts it reaches first: the ceil(canary_fraction x n) of the
--            class's n non-excluded hosts with the lowest md5 of their host id,
--            leaving out the hosts whose own search measured it (they are its
--            evidence, not its test); learner/hakmem/fleet.py canary_order
--   kept     canaries that tried it from the fleet and kept it (better or within)
--   worse    canaries that tried it from the fleet and found it worse: a rollback
--   stage    evidence (fewer than k agree, or as many against), canary,
--            offered (canary_confirm canaries kept it, or it has no canaries),
--            stopped (a canary rolled it back: offered to nobody)
-- Only the canaries' trials count for or against it: a host outside them
-- can neither promote nor stop a policy.
CREATE TABLE hakmem.standing (
  program_id bigint NOT NULL REFERENCES hakmem.programs(id),
  knobs      jsonb NOT NULL,
  agree      integer NOT NULL,
  against    integer NOT NULL,
  canaries   text[],                  -- NULL while it is evidence only
  kept       integer NOT NULL DEFAULT 0,
  worse      integer NOT NULL DEFAULT 0,
  rel        double precision,        -- the median cost ratio of the hosts that agree
  stage      text NOT NULL CHECK (stage IN ('evidence', 'canary', 'offered', 'stopped')),
  updated    timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (program_id, knobs)
);
CREATE INDEX programs_class ON hakmem.programs(hw_class);

-- Programs whose evidence changed since their standing was computed: a
-- push marks them (hakmem.touch, in its transaction), and the next pull or
-- push of any host settles them (hakmem.settle). A program pushed by many
-- hosts at once is recomputed once, by one of them, off the pushes' path.
CREATE TABLE hakmem.dirty (
  program_id bigint PRIMARY KEY REFERENCES hakmem.programs(id),
  since      timestamptz NOT NULL
);

-- The standing of one program recomputed from every host's rows. It writes
-- as the owner, deterministically from the evidence, so what one host can
-- do is add its own vote.
CREATE FUNCTION hakmem.restage(pid bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
DECLARE
  cls text;
  nh bigint;
  k double precision;
  frac double precision;
  conf double precision;
BEGIN
  SELECT max(value) FILTER (WHERE name = 'k'), max(value) FILTER (WHERE name = 'canary_fraction'),
         max(value) FILTER (WHERE name = 'canary_confirm') INTO k, frac, conf FROM hakmem.settings;
  SELECT hw_class INTO cls FROM hakmem.programs WHERE id = pid;
  SELECT count(*) INTO nh FROM hakmem.hosts WHERE hw_class = cls AND excluded IS NULL;
  DELETE FROM hakmem.standing WHERE program_id = pid;
  INSERT INTO hakmem.standing (program_id, knobs, agree, against, canaries, kept, worse, rel, stage)
  WITH v AS (
    SELECT v.host_id, v.knobs, v.source, v.vs_default, v.rel FROM hakmem.verdicts v
    JOIN hakmem.hosts h ON h.host_id = v.host_id
    WHERE v.program_id = pid AND h.excluded IS NULL),
  p AS (
    SELECT knobs,
           count(*) FILTER (WHERE source = 'local' AND vs_default = 'better') AS agree,
           count(*) FILTER (WHERE source = 'local' AND vs_default = 'worse') AS against,
           coalesce(array_agg(host_id) FILTER (WHERE source = 'local'), '{}') AS measured_by,
           coalesce(array_agg(host_id) FILTER (WHERE source = 'fleet' AND vs_default IN ('better', 'within')),
                    '{}') AS kept_by,
           coalesce(array_agg(host_id) FILTER (WHERE source = 'fleet' AND vs_default = 'worse'), '{}') AS worse_by,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY rel)
             FILTER (WHERE source = 'local' AND vs_default = 'better') AS rel
    FROM v GROUP BY knobs),
  c AS MATERIALIZED (
    SELECT p.*, CASE WHEN p.agree >= k THEN ARRAY(
             SELECT h.host_id FROM hakmem.hosts h
             WHERE h.hw_class = cls AND h.excluded IS NULL AND h.host_id <> ALL (p.measured_by)
             ORDER BY h.rank_key, h.host_id
             LIMIT ceil(frac * greatest(nh - cardinality(p.measured_by), 0))::bigint) END AS canaries
    FROM p),
  t AS (
    SELECT c.*,
           (SELECT count(*) FROM unnest(c.kept_by) x WHERE x = ANY(c.canaries)) AS kept,
           (SELECT count(*) FROM unnest(c.worse_by) x WHERE x = ANY(c.canaries)) AS worse
    FROM c)
  SELECT pid, t.knobs, t.agree, t.against, t.canaries, t.kept, t.worse, t.rel,
         CASE WHEN t.agree < k OR t.against >= t.agree THEN 'evidence'
              WHEN t.worse > 0 THEN 'stopped'
              WHEN t.kept >= least(conf, cardinality(t.canaries)) THEN 'offered'
              ELSE 'canary' END
  FROM t;
END $$;

-- Marks programs for settling. Rows are locked in id order (two pushes never
-- wait on each other in a cycle); the update (not "do nothing") locks a row
-- already there, so a settle that would take it waits for this commit and
-- then sees this push's verdicts.
CREATE FUNCTION hakmem.touch(p_programs bigint[]) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
  INSERT INTO hakmem.dirty (program_id, since)
  SELECT DISTINCT x, now() FROM unnest(p_programs) x WHERE x IS NOT NULL ORDER BY x
  ON CONFLICT (program_id) DO UPDATE SET since = least(hakmem.dirty.since, excluded.since)
$$;

-- Recomputes up to p_max programs marked at least p_age_ms ago, oldest
-- first; returns how many. A mark a push still holds is skipped (settled
-- later, with that push's verdicts), and two settles never take one mark:
-- no settle waits, and one program is recomputed by one at a time.
CREATE FUNCTION hakmem.settle(p_max integer, p_age_ms integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
DECLARE
  pid bigint;
  n integer := 0;
BEGIN
  WHILE n < p_max LOOP
    DELETE FROM hakmem.dirty WHERE program_id = (
      SELECT program_id FROM hakmem.dirty WHERE since <= now() - make_interval(secs => p_age_ms / 1000.0)
      ORDER BY since, program_id LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING program_id INTO pid;
    EXIT WHEN pid IS NULL;
    PERFORM hakmem.restage(pid);
    n := n + 1;
  END LOOP;
  RETURN n;
END $$;

-- Marks every program of these classes (NULL: all): what a change of the
-- hosts (one joins a class, is excluded or counted again) or of the
-- settings moves.
CREATE FUNCTION hakmem.touch_classes(p_classes text[]) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
  SELECT hakmem.touch(array_agg(id)) FROM hakmem.programs WHERE p_classes IS NULL OR hw_class = ANY(p_classes)
$$;

-- What the calling host is offered, for programs of its class: per program
-- the offered policy most hosts agree on (then the cheapest), or, while it
-- is in its canary stage, that policy if this host is one of its canaries.
CREATE FUNCTION hakmem.offers(p_class text)
RETURNS TABLE (build_id text, exe_name text, users text, knobs jsonb, stage text, agree integer, rel double precision)
LANGUAGE sql STABLE AS $$
  SELECT DISTINCT ON (g.id) g.build_id, g.exe_name, g.users, st.knobs, st.stage, st.agree, st.rel
  FROM hakmem.standing st JOIN hakmem.programs g ON g.id = st.program_id
  WHERE g.hw_class = p_class
    AND (st.stage = 'offered' OR (st.stage = 'canary' AND hakmem.me() = ANY(st.canaries)))
  ORDER BY g.id, st.agree DESC, st.rel ASC NULLS LAST, st.knobs::text
$$;

-- Hosts: read everything, write only their own rows; settings and the
-- hosts' list belong to the owner.
DO $$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'hakmem_host') THEN
    CREATE ROLE hakmem_host NOLOGIN;
  END IF;
END $$;
GRANT USAGE ON SCHEMA hakmem TO hakmem_host;
GRANT SELECT ON hakmem.schema_migrations TO hakmem_host;   -- learnd checks the version it talks to
GRANT SELECT ON hakmem.settings, hakmem.hosts, hakmem.programs, hakmem.evaluations, hakmem.verdicts,
  hakmem.host_best, hakmem.standing TO hakmem_host;
REVOKE ALL ON FUNCTION hakmem.restage(bigint), hakmem.touch(bigint[]), hakmem.settle(integer, integer),
  hakmem.touch_classes(text[]) FROM PUBLIC;
GRANT UPDATE (hw_class, version, last_seen) ON hakmem.hosts TO hakmem_host;
GRANT INSERT ON hakmem.programs, hakmem.evaluations, hakmem.verdicts, hakmem.host_best TO hakmem_host;
GRANT UPDATE ON hakmem.verdicts, hakmem.host_best TO hakmem_host;
GRANT USAGE ON SEQUENCE hakmem.programs_id_seq TO hakmem_host;
GRANT EXECUTE ON FUNCTION hakmem.me(), hakmem.offers(text), hakmem.touch(bigint[]),
  hakmem.settle(integer, integer), hakmem.touch_classes(text[]) TO hakmem_host;

ALTER TABLE hakmem.hosts ENABLE ROW LEVEL SECURITY;
CREATE POLICY read_all ON hakmem.hosts FOR SELECT USING (true);
CREATE POLICY own_row ON hakmem.hosts FOR UPDATE USING (role = current_user) WITH CHECK (role = current_user);

ALTER TABLE hakmem.evaluations ENABLE ROW LEVEL SECURITY;
CREATE POLICY read_all ON hakmem.evaluations FOR SELECT USING (true);
CREATE POLICY own_rows ON hakmem.evaluations FOR INSERT WITH CHECK (host_id = hakmem.me());

ALTER TABLE hakmem.verdicts ENABLE ROW LEVEL SECURITY;
CREATE POLICY read_all ON hakmem.verdicts FOR SELECT USING (true);
CREATE POLICY own_rows ON hakmem.verdicts FOR INSERT WITH CHECK (host_id = hakmem.me());
CREATE POLICY own_rows_update ON hakmem.verdicts FOR UPDATE USING (host_id = hakmem.me())
  WITH CHECK (host_id = hakmem.me());

ALTER TABLE hakmem.host_best ENABLE ROW LEVEL SECURITY;
CREATE POLICY read_all ON hakmem.host_best FOR SELECT USING (true);
CREATE POLICY own_rows ON hakmem.host_best FOR INSERT WITH CHECK (host_id = hakmem.me());
CREATE POLICY own_rows_update ON hakmem.host_best FOR UPDATE USING (host_id = hakmem.me())
  WITH CHECK (host_id = hakmem.me());
