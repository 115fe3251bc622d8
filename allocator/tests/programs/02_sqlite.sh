#!/usr/bin/env bash
# 02_sqlite.sh — proves the sqlite3 shell works unchanged with hakmem preloaded:
# 200k INSERT statements parsed and executed in one transaction into an on-disk
# database, an index built, GROUP BY / ORDER BY / LIKE / JOIN / window queries,
# UPDATE and DELETE of many rows, VACUUM and integrity_check. stdout and exit
# status must be identical with and without LD_PRELOAD, and the preloaded run
# must not print "hakmem:" on stderr. sqlite3 uses malloc for every statement,
# page cache entry and result string, so this covers many sizes and lifetimes.
#
# Env: LIB = absolute path of libhakmem.so (required); WORK = scratch dir
# (optional). Exit 0 pass, 77 skip (sqlite3 missing), anything else = fail.
name=02_sqlite
. "$(dirname "$0")/lib/common.sh" || exit 1
need_cmd sqlite3
need_cmd awk
setup_scratch 60

# The SQL script: schema, 200k INSERTs (deterministic LCG data), queries.
awk 'BEGIN {
  print "PRAGMA journal_mode=DELETE;";
  print "CREATE TABLE t(id INTEGER PRIMARY KEY, grp INTEGER, name TEXT, val REAL, note TEXT);";
  print "CREATE TABLE g(grp INTEGER PRIMARY KEY, label TEXT);";
  print "BEGIN;";
  x = 12345;
  for (i = 1; i <= 200000; i++) {
    x = (x * 16807) % 2147483647; y = int(x / 256);   # exact in doubles
    grp = y % 97; len = 1 + (y % 23);
    note = substr("the quick brown fox jumps over the lazy dog again", 1 + (y % 17), len);
    printf "INSERT INTO t VALUES(%d,%d,%cname_%d_%x%c,%d.%02d,%c%s%c);\n", i, grp, 39, i % 5000, y % 65536, 39, y % 100000, y % 100, 39, note, 39;
  }
  for (g = 0; g < 97; g++) printf "INSERT INTO g VALUES(%d,%clabel-%03d%c);\n", g, 39, g, 39;
  print "COMMIT;";
}' > "$T/load.sql"

cat > "$T/query.sql" <<'SQL'
.headers on
.mode list
CREATE INDEX t_grp_name ON t(grp, name);
CREATE INDEX t_note ON t(note);
SELECT count(*), sum(grp), round(sum(val), 2), sum(length(name)), sum(length(note)) FROM t;
SELECT grp, count(*) AS n, round(avg(val), 4) AS a, min(name), max(name) FROM t GROUP BY grp ORDER BY n DESC, grp LIMIT 15;
SELECT id, name, val FROM t WHERE name LIKE 'name_42%' ORDER BY val DESC, id LIMIT 20;
SELECT count(*) FROM t WHERE note LIKE '%fox%';
SELECT g.label, count(*), round(sum(t.val), 2) FROM t JOIN g ON g.grp = t.grp WHERE t.id % 3 = 0 GROUP BY g.label ORDER BY 2 DESC, 1 LIMIT 10;
SELECT note, count(*) FROM t GROUP BY note ORDER BY count(*) DESC, note LIMIT 10;
SELECT id, grp, rank FROM (SELECT id, grp, rank() OVER (PARTITION BY grp ORDER BY val DESC, id) AS rank FROM t) WHERE rank <= 2 ORDER BY grp, rank LIMIT 30;
SELECT group_concat(name, ',') FROM (SELECT name FROM t WHERE grp = 7 ORDER BY id LIMIT 200);
BEGIN;
UPDATE t SET note = note || '-' || printf('%08d', id) WHERE id % 5 = 0;
DELETE FROM t WHERE grp IN (3, 14, 15, 92) OR id % 7 = 0;
INSERT INTO t(grp, name, val, note) SELECT grp, upper(name), val * 2, replace(note, 'o', '0') FROM t WHERE id % 11 = 0;
COMMIT;
SELECT count(*), sum(grp), round(sum(val), 2), sum(length(note)), max(id) FROM t;
SELECT substr(group_concat(note, '|'), 1, 300) FROM (SELECT note FROM t ORDER BY note, id LIMIT 1000);
VACUUM;
PRAGMA integrity_check;
SELECT count(*), sum(length(name) + length(note)) FROM t;
SELECT name FROM t ORDER BY name DESC LIMIT 5;
SQL

run() {  # run plain|pre
  local tag=$1; rm -f "$T/db.$tag"
  if [ "$tag" = pre ]; then
    ( cd "$T" && LD_PRELOAD="$LIB" $TO sqlite3 -bail "db.$tag" <load.sql >"$tag.out" 2>"$tag.err" &&
      LD_PRELOAD="$LIB" $TO sqlite3 -bail "db.$tag" <query.sql >>"$tag.out" 2>>"$tag.err" ); echo $? >"$T/$tag.rc"
  else
    ( cd "$T" && $TO sqlite3 -bail "db.$tag" <load.sql >"$tag.out" 2>"$tag.err" &&
      $TO sqlite3 -bail "db.$tag" <query.sql >>"$tag.out" 2>>"$tag.err" ); echo $? >"$T/$tag.rc"
  fi
}
run plain; run pre
p=plain q=pre
check_preloaded_stderr "$q"
check_served "$T/$q.err" 2000000   # measured: 5.2M
check_plain_rc "$p" "test bug or broken sqlite3"
grep -qx "ok" "$T/$p.out" || fail "plain run: integrity_check did not print ok" "$T/$p.out"
check_same "$p" "$q"
echo "$name: PASS ($(wc -l <"$T/$p.out") lines, md5 $(md5sum <"$T/$p.out" | cut -c1-12))"
exit 0
