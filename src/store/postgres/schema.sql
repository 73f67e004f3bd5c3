-- The PostgreSQL store's schema: a table of lock rows, a sequence of fencing tokens, a
-- table of the idempotency layer's answers, the functions that the store calls (one
-- statement a call), and the guard for your own transactions. Version 1 (the `_version`
-- function): a later release that changes any of this raises it, and ships the migration.
--
-- One row a lock key, written only by these functions:
--   owner, holds, modes, ends: one owner's exclusive holds (re-entry adds hold ids), which
--     end together at `ends`; `modes` has a letter a hold: 'x', or 's' for a shared hold
--     the owner took under its exclusive ones (the key turns shared again, with those, when
--     the last 'x' hold ends);
--   readers: shared holds, each (owner, hold, ends): a reader that dies takes only its own
--     hold with it;
--   line: waiters' reservations (ticket, ends), in ticket order: a waiter's place in line,
--     until its own deadline, whatever happens to the holds (an entry that ended may stay
--     until a change of the line walks it: every reader skips it).
-- A waiter with a big exclusive batch keeps its place in line apart from the rows, as one
-- row of `{T}_claims` (a claim: see there); one with a single key, exclusive, keeps beside
-- its reservation what the release needs to grant it the key (a turn: `{T}_turns`).
-- Every time is the database's clock (clock_timestamp()), never a client's. A row none of
-- whose holds and reservations has an end in the future is free, whatever it holds; the
-- next call on the key overwrites it, and `{T}_sweep` deletes the ones nobody calls on.
--
-- Keys are always taken in the order the caller gives (sorted, as the crate sends them), by
-- one statement, so two batches never wait for each other's rows crosswise: no deadlock.

CREATE SCHEMA IF NOT EXISTS {S};

DO $$ BEGIN
  CREATE TYPE {T}_reader AS (owner uuid, hold bigint, ends timestamptz);
EXCEPTION WHEN duplicate_object THEN NULL; END $$;

DO $$ BEGIN
  CREATE TYPE {T}_place AS (ticket numeric, ends timestamptz);
EXCEPTION WHEN duplicate_object THEN NULL; END $$;

-- Half of each page is left free (`fillfactor`): a contended key's row is written again
-- at every reservation, grant and release, and a new version that fits in its page needs
-- no new index entry and is pruned in place (a HOT update). An update of 2,000 rows with
-- lines took 4.3 ms at the default 100, 1.9 ms at 50.
CREATE TABLE IF NOT EXISTS {T} (
  key text COLLATE "C" PRIMARY KEY,
  owner uuid,
  holds bigint[],
  modes text,
  ends timestamptz,
  readers {T}_reader[],
  line {T}_place[]
) WITH (fillfactor = 50);

-- Claims: the place in line of a waiter with a big exclusive batch (64 keys or more), one
-- row a waiter: its ticket, its keys (sorted, as the crate sends them), until its own
-- deadline. Written into its keys' rows, that place cost a refused attempt of 2,000 keys
-- a write of each row (11-14 ms), its grant and the holder's release a change of each
-- row's line, and the rows stayed locked while it was written, so the next grant waited
-- for it; a claim is one row, which locks no key's. A live claim with an earlier ticket
-- keeps a caller out of the keys it names, as an earlier reservation does, unless the
-- caller's owner holds the key; a call that frees keys wakes the waiters of the claims
-- that name one and are behind no live claim ({T}_claim_heads); a grant ends its
-- waiter's claim, a withdrawal ends it. The rows stay as they are meanwhile: a held key
-- keeps its hold, a free one stays free (or absent). `behind`: the tickets of the earlier
-- live claims that shared a key with it when it was made, which keep its waiter out
-- while they live.
CREATE TABLE IF NOT EXISTS {T}_claims (
  ticket numeric PRIMARY KEY,
  keys text[] COLLATE "C" NOT NULL,
  ends timestamptz NOT NULL,
  behind numeric[] NOT NULL
);

-- Turns: what a waiter in line for one key alone, exclusively, needs to be granted by
-- the call that frees the key with it first in line (a hand-over): its owner, hold and
-- ttl, written by its refused attempt beside its reservation; `ends` is the
-- reservation's. The freeing call grants it the key in its own statement, marks the turn
-- with the fencing token it gave (`token`), and names both in its notification: the
-- waiter is granted without a call of its own. With a hot key's waiters, the woken
-- waiter's own attempt ran at the moment its holder's client sent its next request, whose
-- refused attempt wrote the same row: a grant cost two statements on one row at once, and
-- 64 clients granted 0.75-0.77x what one client did (`contention`, PostgreSQL, hot sku);
-- handed over, 0.89 and 0.93x in two runs of three (0.79 in the third; docs/bench). A
-- given turn lets the waiter's own attempt that crossed the hand-over recognise its grant
-- ({T}_acquire takes the hold over), and its withdrawal free the key; it goes at the key's
-- next hand-over (found by its key: the second index), or with the sweep once its
-- reservation ended.
CREATE TABLE IF NOT EXISTS {T}_turns (
  ticket numeric PRIMARY KEY,
  key text COLLATE "C" NOT NULL,
  owner uuid NOT NULL,
  hold bigint NOT NULL,
  ttl_ms bigint NOT NULL,
  ends timestamptz NOT NULL,
  token bigint,
  UNIQUE (key, ticket)
);

-- The least fencing token the database's clock allows now: its milliseconds since 2025
-- times 1024, the floor of every store's counter (see the crate's `FencingToken`).
CREATE OR REPLACE FUNCTION {T}_clock_floor() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
  SELECT floor(extract(epoch FROM clock_timestamp() - timestamptz '2025-01-01 00:00:00+00')
               * 1000)::bigint * 1024
$$;

-- Fencing tokens: a sequence never goes backwards, across restarts and crashes (a crash
-- may skip values, never repeat one). It starts at the clock's floor, so that a schema
-- made again (the old one dropped) starts above every token the old one handed out, while
-- that counted fewer than 1,024 grants a millisecond. It is not raised to the clock at
-- each grant, as the Redis stores' counters are: a sequence has no "at least", and a
-- raise at each grant would need a lock that the grant keeps to its commit, so that every
-- grant would wait for every other's. It is raised on a server other than the last
-- grant's (a promoted replica, a point-in-time recovery, a database restored from a dump
-- into a new cluster: {T}_fenced_on); after restoring a copy of the files, which starts no
-- new timeline, run {T}_raise_fence() before the first grant.
DO $$ BEGIN
  IF to_regclass('{T}_fence') IS NULL THEN
    EXECUTE format('CREATE SEQUENCE {T}_fence START WITH %s', {T}_clock_floor());
  END IF;
END $$;

-- Raises the fencing sequence to the clock's floor (never lowers it), and returns its
-- value, so that no token handed out before comes again: a grant on another server than
-- the last one's does it ({T}_granted), and an operator after restoring a copy of the
-- database's files (which starts no new timeline), before the first grant. The sequence's
-- last value is read by `pg_sequence_last_value`, not by a scan of the sequence (under its
-- caller's `enable_seqscan = off` a scan is priced at ten billion, and compiled by JIT);
-- where that says nothing (before the sequence's first value, or to a role that may not
-- read it), `nextval` (only then: `coalesce` stops at its first value) gives a value
-- above every token handed out, or fails, and never lets `setval` lower the sequence.
CREATE OR REPLACE FUNCTION {T}_raise_fence() RETURNS bigint
LANGUAGE sql AS $$
  SELECT setval('{T}_fence',
                greatest(coalesce(pg_sequence_last_value('{T}_fence'), nextval('{T}_fence')),
                         {T}_clock_floor()))
$$;

-- The server the last grant took its token on: the cluster's system identifier (one made
-- anew, or restored from a dump, has another) and its timeline (a promoted replica, or a
-- point-in-time recovery, starts a new one). A replica that was behind, or a restored
-- database, may have a sequence behind tokens handed out before: the first grant on
-- another server raises it, without an operator. One row.
CREATE TABLE IF NOT EXISTS {T}_fenced_on (
  id boolean PRIMARY KEY DEFAULT true CHECK (id),
  server text NOT NULL
);

-- This server, as {T}_fenced_on names it (the timeline: the first 8 hex digits of the
-- current WAL file's name); NULL for a role that may not read those (EXECUTE revoked),
-- which then gets no raise on a new server, as before this check.
CREATE OR REPLACE FUNCTION {T}_server() RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  RETURN (SELECT system_identifier FROM pg_control_system())::text || '/'
         || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8);
EXCEPTION WHEN insufficient_privilege THEN
  RETURN NULL;
END $$;

CREATE TABLE IF NOT EXISTS {T}_answers (
  key text COLLATE "C" PRIMARY KEY,
  answer bytea NOT NULL,
  ends timestamptz NOT NULL
);

CREATE OR REPLACE FUNCTION {T}_version() RETURNS int
LANGUAGE sql IMMUTABLE AS 'SELECT 1';

-- A call that grants nothing (a release, a withdrawal, a refused attempt, which may have
-- written its place in line) lets its transaction commit without waiting for the WAL to
-- reach the disk (or a synchronous standby): `synchronous_commit` off for that
-- transaction alone. A crash or a failover may lose the last such commits (after a
-- crash, up to three times `wal_writer_delay`, 600 ms by default): a release lost leaves
-- its keys held to their ttl, a withdrawal lost leaves the waiter's place in line to its
-- deadline, a place in line lost is taken again at the waiter's next attempt; nobody is
-- let in. A grant and a renewal (`_extend`) never call this: they commit as the session
-- says, so that no crash hands a fencing token out twice, nor ends a hold that its holder
-- counts on. A transaction keeps its row locks until its commit has waited, so on a
-- contended key every call waited for the disk of the call before it: with pgbench, 8
-- clients on one key (a disk that syncs in 0.17 ms) made 1,510-1,680 calls a second,
-- against 1,060-1,160 with every commit waiting; one client's 1-key acquire and release
-- took 0.82-0.99 ms, against 1.02-1.16. `_release` and `_withdraw` call this first,
-- `_acquire` just before it answers a refusal.
CREATE OR REPLACE FUNCTION {T}_commit_lazily() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  -- Local to the transaction, and not a SET clause of the function's, so that it holds
  -- when the transaction commits, after the function returns.
  SET LOCAL synchronous_commit = off;
END $$;

-- Plans. PL/pgSQL prepares each query of a function once a session, and plans it again
-- for the values of each call (a custom plan) for as long as a plan made for any values
-- (a generic one) looks dearer. Here it always does: a generic plan counts ten elements
-- in an array parameter, where most calls pass a few keys, so every call planned every
-- query again. A waiter's refused attempt of one key took 0.81 ms, 0.35 of them planning
-- {T}_conflicts' count, its withdrawal 0.61, a probe 0.16 (pgbench, a key with a line of
-- 64). The functions on a request's path (acquire, probe, release, withdraw, extend,
-- guard, force_release) take the generic plan at once (`plan_cache_mode`), and the
-- helpers they call with them: 0.38, 0.31 and 0.10 ms. A generic plan is made for any
-- size of the table too, and kept until the connection closes or the table's statistics
-- change: made while the table was a few rows, one that read it whole and compared each
-- row with each key (`= ANY` of an array parameter is not hashed) renewed 20,000 keys in
-- 4.7 s once the table had grown, against 60 ms. So each of these functions finds rows by
-- the key's index, whatever the table's size when it planned (`enable_seqscan = off`;
-- {T}_acquire and {T}_release need it for the key order besides), and a helper, whose
-- plan serves all its callers (the probe's and the acquire's {T}_probe_at), is planned
-- under that one setting; their queries on the claims table go by its key or through
-- helpers that read it whole ({T}_claimed). Big batches lose nothing: their queries find
-- rows by the index whatever the count, and those that join two arrays of keys are
-- planned at each call with EXECUTE (see {T}_claim), or keep a hash under a generic plan
-- ({T}_claimed). Those functions also turn JIT off (`jit = off`): under `enable_seqscan
-- = off`, a query that still scans (a small table read whole) is priced at ten billion
-- (up to PostgreSQL 17), above any `jit_above_cost`, and was compiled at each call, 10-20
-- ms (the claims table's reads, the fenced-on row's), where the whole call takes a
-- fraction of one.

-- The helpers below run once a row of a batch. Those that walk an array do it with
-- FOREACH and plain comparisons, which PL/pgSQL evaluates without a query (written as
-- queries over `unnest(…)`, each call ran one, tens of microseconds, and a waiting
-- 2,000-key batch spent most of its statement's time in them); those of one SQL expression
-- are inlined in the query that calls them, and call a walk only where they must.

-- The live reservations of `line` (kept in ticket order) other than `ticket`'s, with
-- `ticket`'s until `till` when `till` is given, in ticket order; NULL when none. A line
-- none of whose entries has ended, the rule, is cut and joined with slices, once, rather
-- than built again an entry at a time: a hot key's line is as long as its waiters, and
-- the changes that {T}_without and {T}_with do not make pass it here (a line of 64: 24 us
-- a call, 29 built again; a line of 1, 7 us).
CREATE OR REPLACE FUNCTION {T}_requeue(
  p_line {T}_place[], p_ticket numeric, p_till timestamptz, p_now timestamptz
) RETURNS {T}_place[]
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  q {T}_place;
  i int := 0;
  mine int;
  later int;
  kept {T}_place[] := '{}';
  placed boolean := p_till IS NULL;
BEGIN
  IF p_line IS NOT NULL THEN
    FOREACH q IN ARRAY p_line LOOP
      i := i + 1;
      EXIT WHEN q.ends <= p_now;
      IF q.ticket = p_ticket THEN mine := i; END IF;
      IF later IS NULL AND p_ticket < q.ticket THEN later := i; END IF;
    END LOOP;
  END IF;
  IF i = coalesce(cardinality(p_line), 0) AND (p_line IS NULL OR (p_line[i]).ends > p_now) THEN
    -- Every entry live: `ticket`'s out, then in again before the first later ticket.
    IF mine IS NOT NULL THEN
      p_line := p_line[:mine - 1] || p_line[mine + 1:];
      IF later > mine THEN later := later - 1; END IF;
    END IF;
    IF p_till IS NOT NULL THEN
      later := coalesce(later, coalesce(cardinality(p_line), 0) + 1);
      p_line := p_line[:later - 1] || ROW(p_ticket, p_till)::{T}_place || p_line[later:];
    END IF;
    RETURN CASE WHEN cardinality(p_line) > 0 THEN p_line END;
  END IF;
  FOREACH q IN ARRAY p_line LOOP
    IF q.ends > p_now AND q.ticket IS DISTINCT FROM p_ticket THEN
      IF NOT placed AND p_ticket < q.ticket THEN
        kept := kept || ROW(p_ticket, p_till)::{T}_place;
        placed := true;
      END IF;
      kept := kept || q;
    END IF;
  END LOOP;
  IF NOT placed THEN
    kept := kept || ROW(p_ticket, p_till)::{T}_place;
  END IF;
  RETURN CASE WHEN cardinality(kept) = 0 THEN NULL ELSE kept END;
END $$;

-- The ticket first in line, among the live reservations: the first live entry, the line
-- being in ticket order. {T}_head answers from the first entry when it is live, the rule
-- (an ended one stays first only where its waiter died, until a change of the line drops
-- it), in the query that calls it (an SQL function of one expression is inlined), and
-- walks the line ({T}_first_live) otherwise: a release or a grant of 2,000 keys with
-- lines read their heads in 10 ms with a call a row, 7 ms this way.
CREATE OR REPLACE FUNCTION {T}_first_live(p_line {T}_place[], p_now timestamptz)
RETURNS numeric
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  q {T}_place;
BEGIN
  IF p_line IS NOT NULL THEN
    FOREACH q IN ARRAY p_line LOOP
      IF q.ends > p_now THEN
        RETURN q.ticket;
      END IF;
    END LOOP;
  END IF;
  RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION {T}_head(p_line {T}_place[], p_now timestamptz) RETURNS numeric
LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN (p_line[1]).ends > p_now THEN (p_line[1]).ticket
              ELSE {T}_first_live(p_line, p_now) END
$$;

-- The two changes of a line that a contended key sees most, made where they are common
-- without {T}_requeue's walk (a call a row: 8.5 ms of a 2,000-key release from under
-- lines, 10-17 ms of a waiter's 2,000-key grant), in the query that calls them (inlined,
-- as {T}_head). They leave ended entries where they are: every reader skips them, and
-- the walk, which drops them, runs at the next change that is not one of these.
--
-- `p_line` without `p_ticket`'s entry (a grant or a withdrawal): the rest of the line
-- when that entry is first, the rule for a grant in line; a line of no waiter's stays
-- as it is (NULL: in no line).
CREATE OR REPLACE FUNCTION {T}_without(
  p_line {T}_place[], p_ticket numeric, p_now timestamptz
) RETURNS {T}_place[]
LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN p_ticket IS NULL OR p_line IS NULL THEN p_line
              WHEN (p_line[1]).ticket = p_ticket
                THEN CASE WHEN cardinality(p_line) > 1 THEN p_line[2:] END
              ELSE {T}_requeue(p_line, p_ticket, NULL, p_now) END
$$;

-- `p_line` with `p_ticket`'s entry until `p_till` (a reservation): at the end when its
-- ticket is the latest, the rule, since waiters arrive in ticket order.
CREATE OR REPLACE FUNCTION {T}_with(
  p_line {T}_place[], p_ticket numeric, p_till timestamptz, p_now timestamptz
) RETURNS {T}_place[]
LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN p_line IS NULL THEN ARRAY[ROW(p_ticket, p_till)::{T}_place]
              WHEN (p_line[cardinality(p_line)]).ticket < p_ticket
                THEN p_line || ROW(p_ticket, p_till)::{T}_place
              ELSE {T}_requeue(p_line, p_ticket, p_till, p_now) END
$$;

-- Whether the line keeps a caller in line with `ticket` out: its first live entry is
-- earlier (any, for a caller in no line).
CREATE OR REPLACE FUNCTION {T}_line_keeps_out(
  p_line {T}_place[], p_ticket numeric, p_now timestamptz
) RETURNS int
LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN p_ticket IS NULL THEN ({T}_head(p_line, p_now) IS NOT NULL)::int
              ELSE coalesce(({T}_head(p_line, p_now) < p_ticket)::int, 0) END
$$;

-- {T}_keeps_out for a row that no owner holds exclusively now, with readers.
CREATE OR REPLACE FUNCTION {T}_readers_keep_out(
  r {T}, p_owner uuid, p_shared boolean, p_ticket numeric, p_now timestamptz
) RETURNS int
LANGUAGE plpgsql STABLE AS $$
DECLARE
  x {T}_reader;
  mine boolean := false;
  others boolean := false;
BEGIN
  FOREACH x IN ARRAY r.readers LOOP
    IF x.ends > p_now THEN
      IF x.owner = p_owner THEN mine := true; ELSE others := true; END IF;
    END IF;
  END LOOP;
  IF mine THEN
    RETURN CASE WHEN p_shared OR NOT others THEN 0 ELSE 2 END;
  END IF;
  IF others AND NOT p_shared THEN
    RETURN 1;
  END IF;
  RETURN {T}_line_keeps_out(r.line, p_ticket, p_now);
END $$;

-- Whether the row `r` (NULL: no row) keeps out `owner`, asking for it shared or not, in
-- line with `ticket` (NULL: in no line, kept out by every live reservation): 0 no, 1 yes,
-- 2 yes, by an upgrade (the owner reads the key beside other readers, and asks for it
-- exclusively). An owner is never kept out of its own keys: it passes the reservations on
-- the keys it holds, and only on those. The rows of a contended batch, held exclusively or
-- free with a line, are answered in the query that asks (inlined, as {T}_head); a row with
-- readers by {T}_readers_keep_out. (A look at a waiter's 2,000 free keys, with a call a
-- row, took 7-9 ms.)
CREATE OR REPLACE FUNCTION {T}_keeps_out(
  r {T}, p_owner uuid, p_shared boolean, p_ticket numeric, p_now timestamptz
) RETURNS int
LANGUAGE sql STABLE AS $$
  SELECT CASE WHEN r.key IS NULL THEN 0
              WHEN r.owner IS NOT NULL AND r.ends > p_now THEN (r.owner <> p_owner)::int
              WHEN r.readers IS NOT NULL
                THEN {T}_readers_keep_out(r, p_owner, p_shared, p_ticket, p_now)
              ELSE {T}_line_keeps_out(r.line, p_ticket, p_now) END
$$;

-- What keeps the batch `p_keys` (in `p_modes`) of `p_owner`, in line with `p_ticket`, out
-- now, among the rows there: how many keys, up to `p_report` of them, whether one is an
-- upgrade, and the ms until the earliest held one ends; and how many keys lack a live
-- reservation of `p_ticket` (0 when nothing keeps it out). Reads only. (The rows are
-- found by `key = ANY(…)`, an index scan, and named in key order, which is the batch's.)
CREATE OR REPLACE FUNCTION {T}_conflicts(
  p_keys text[], p_modes text, p_owner uuid, p_ticket numeric, p_now timestamptz,
  p_report int,
  OUT conflicts int, OUT named text[], OUT upgrade boolean, OUT earliest_ms bigint,
  OUT unreserved int
)
LANGUAGE plpgsql STABLE AS $$
BEGIN
  -- The probe, which stops at the first key that keeps the batch out, says whether one
  -- does; only then are they counted and named (a count of 2,000 rows took 23-33 ms of a
  -- contended statement, the probe of a batch kept out by its first key next to none).
  IF {T}_probe_at(p_keys, p_modes, p_owner, p_ticket, p_now) = cardinality(p_keys) THEN
    conflicts := 0; named := '{}'; upgrade := false; unreserved := 0;
    RETURN;
  END IF;
  SELECT count(*) FILTER (WHERE c.blocked > 0)::int,
         coalesce((array_agg(c.key ORDER BY c.key) FILTER (WHERE c.blocked > 0))[:p_report], '{}'),
         coalesce(bool_or(c.blocked = 2), false),
         min(c.left_ms) FILTER (WHERE c.blocked > 0),
         (cardinality(p_keys) - count(*) FILTER (WHERE c.mine))::int
    INTO conflicts, named, upgrade, earliest_ms, unreserved
  FROM (
    -- Each row is asked only what it can answer: {T}_keeps_out reads a row's readers,
    -- and the mode asked for it, only where it has readers. A 2,000-key batch kept out by
    -- another's held keys, with a waiter in line on them: 14-18 ms a count with a call a
    -- row, 7-9 ms this way (psql).
    SELECT l.key,
           {T}_keeps_out(l, p_owner,
             (CASE WHEN length(p_modes) = 1 THEN p_modes
                   ELSE substr(p_modes, array_position(p_keys, l.key), 1) END) = 's',
             p_ticket, p_now) AS blocked,
           CASE WHEN l.owner IS NOT NULL AND l.ends > p_now
                  THEN floor(extract(epoch FROM l.ends - p_now) * 1000)::bigint
                WHEN l.readers IS NOT NULL THEN
                  (SELECT floor(extract(epoch FROM max(x.ends) - p_now) * 1000)::bigint
                   FROM unnest(l.readers) x WHERE x.ends > p_now) END AS left_ms,
           p_ticket IS NOT NULL AND l.line IS NOT NULL
             AND EXISTS (SELECT 1 FROM unnest(l.line) q
                         WHERE q.ticket = p_ticket AND q.ends > p_now) AS mine
    FROM {T} l
    WHERE l.key = ANY(p_keys)
  ) c;
END $$;

-- Puts the reservation of the waiter with `p_ticket` on every key of `p_keys`, for
-- `p_reserve_ms`, in one statement, in key order: a row for each key that has none; a
-- reservation with more than half its time left stays as it is.
CREATE OR REPLACE FUNCTION {T}_reserve(
  p_keys text[], p_ticket numeric, p_now timestamptz, p_reserve_ms bigint
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO {T} AS l (key, line)
  SELECT u.k, ARRAY[ROW(p_ticket, p_now + p_reserve_ms * interval '1 ms')::{T}_place]
  FROM unnest(p_keys) WITH ORDINALITY u(k, i)
  ORDER BY u.i
  ON CONFLICT (key) DO UPDATE
    SET line = {T}_with(l.line, p_ticket, p_now + p_reserve_ms * interval '1 ms', p_now)
    -- A line whose last ticket is earlier has no entry of this waiter's (the rule, for a
    -- waiter's first reservation): that needs no look through it (2,000 rows with lines
    -- of three: 15.5-17 -> 11-14 ms, psql).
    WHERE (l.line[cardinality(l.line)]).ticket < p_ticket
       OR NOT EXISTS (SELECT 1 FROM unnest(l.line) q WHERE q.ticket = p_ticket
                      AND q.ends > p_now + p_reserve_ms * interval '0.5 ms');
END $$;

-- Whether `p_owner` holds the key `p_key` now, in any mode.
CREATE OR REPLACE FUNCTION {T}_owner_holds(p_key text, p_owner uuid, p_now timestamptz)
RETURNS boolean
LANGUAGE sql STABLE AS $$
  SELECT EXISTS (
    SELECT 1 FROM {T} l WHERE l.key = p_key
      AND ((l.owner = p_owner AND l.ends > p_now)
           OR EXISTS (SELECT 1 FROM unnest(l.readers) x
                      WHERE x.owner = p_owner AND x.ends > p_now)))
$$;

-- The positions in `p_keys` (in order) of the keys that a live claim with an earlier
-- ticket than `p_ticket` (any live one, for NULL; never `p_ticket`'s own) names and that
-- `p_holder` does not hold now: the keys that claims keep the caller out of. `p_holder`:
-- the caller's owner where it may hold keys; NULL for a waiter in line, which holds none
-- (a look at each row: 6 ms for 1,333 held keys). Reads only; with no earlier claim, one
-- look at the claims table. A batch of up to 8 keys asks each claim of each of its keys (3
-- keys against three claims of 2,000: 0.2 ms; 63 keys: 10-14 ms); a bigger one hashes the
-- claims' keys once (2,000 keys against three claims: 2-3 ms, where `&&` or `= ANY` a key
-- compared every pair, 50 ms).
CREATE OR REPLACE FUNCTION {T}_claimed(
  p_keys text[], p_holder uuid, p_ticket numeric, p_now timestamptz
) RETURNS int[]
LANGUAGE plpgsql STABLE
-- The claims table is a few rows, read whole (the callers' `enable_seqscan = off` made
-- each of its scans cost ten billion, which turned on JIT: 20 ms a call).
SET enable_seqscan = on
AS $$
DECLARE
  at int[];
BEGIN
  IF NOT EXISTS (SELECT 1 FROM {T}_claims c
                 WHERE c.ends > p_now AND (p_ticket IS NULL OR c.ticket < p_ticket)) THEN
    RETURN '{}';
  END IF;
  IF cardinality(p_keys) <= 8 THEN
    SELECT array_agg(u.i::int ORDER BY u.i) INTO at
      FROM unnest(p_keys) WITH ORDINALITY u(k, i)
      WHERE EXISTS (SELECT 1 FROM {T}_claims c
                    WHERE c.ends > p_now AND (p_ticket IS NULL OR c.ticket < p_ticket)
                      AND u.k = ANY(c.keys));
  ELSE
    SELECT array_agg(u.i::int ORDER BY u.i) INTO at
      FROM unnest(p_keys) WITH ORDINALITY u(k, i)
      WHERE u.k IN (SELECT unnest(c.keys) FROM {T}_claims c
                    WHERE c.ends > p_now AND (p_ticket IS NULL OR c.ticket < p_ticket));
  END IF;
  IF at IS NULL THEN
    RETURN '{}';
  END IF;
  IF p_holder IS NOT NULL THEN
    -- The owner passes the claims on the keys it holds, and only on those.
    SELECT coalesce(array_agg(a ORDER BY a), '{}') INTO at FROM unnest(at) a
      WHERE NOT {T}_owner_holds(p_keys[a], p_holder, p_now);
  END IF;
  RETURN at;
END $$;

-- The keys of `p_keys` at the positions `p_at`, in order. (An SQL function with an
-- aggregate is not inlined, and each transaction that calls it plans its query again, 66
-- us: callers ask it only for a refusal's names.)
CREATE OR REPLACE FUNCTION {T}_at(p_keys text[], p_at int[]) RETURNS text[]
LANGUAGE sql IMMUTABLE AS $$
  SELECT coalesce(array_agg(p_keys[a] ORDER BY a), '{}') FROM unnest(p_at) a
$$;

-- Puts the claim of the waiter with `p_ticket` on the keys `p_keys`, for `p_reserve_ms`,
-- with the earlier live claims it is behind (the batch's keys hashed once: against three
-- claims of 2,000, under 1 ms); a claim with more than half its time left stays as it is.
-- (One waiter's attempts come one after another: no two calls make its claim at once.)
-- The look for those claims is planned each time (`EXECUTE`): a cached generic plan
-- takes an array parameter for ten elements, and compared every pair of keys instead
-- (340 ms for 2,000 keys against three claims, from the sixth call on).
CREATE OR REPLACE FUNCTION {T}_claim(
  p_keys text[], p_ticket numeric, p_now timestamptz, p_reserve_ms bigint
) RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = on -- as {T}_claimed
AS $$
BEGIN
  UPDATE {T}_claims c SET ends = p_now + p_reserve_ms * interval '1 ms'
    WHERE c.ticket = p_ticket AND c.ends <= p_now + p_reserve_ms * interval '0.5 ms';
  IF NOT FOUND AND NOT EXISTS (SELECT 1 FROM {T}_claims c WHERE c.ticket = p_ticket) THEN
    EXECUTE 'INSERT INTO {T}_claims (ticket, keys, ends, behind) VALUES ($1, $2, $3, ARRAY(
               SELECT DISTINCT e.ticket FROM {T}_claims e, unnest(e.keys) k
               WHERE e.ends > $4 AND e.ticket < $1 AND k IN (SELECT unnest($2))))'
      USING p_ticket, p_keys, p_now + p_reserve_ms * interval '1 ms', p_now;
  END IF;
END $$;

-- The tickets of the waiters with claims that a call freeing keys of `p_keys` may let in:
-- the live claims that name one of them and are behind no live claim (a waiter whose
-- claim is behind one is kept out by it, and is woken when that claim's keys are freed
-- or it is withdrawn). A batch of up to 8 keys has each looked for in those claims (two
-- keys against three claims of 2,000: 0.3 ms); a bigger one's are hashed once, and those
-- claims' keys looked up in them, in a query planned each time as in {T}_claim (2,000
-- keys against three claims: 1.7 ms, where a grouping of every claim's keys by key, to
-- find the first claim on each, took 6-7 ms). With no live claim, one look at the table.
-- None of these tickets is a line's head too: a waiter keeps its place by a claim or by
-- reservations, never both, so the callers add them to the heads they found as they are.
CREATE OR REPLACE FUNCTION {T}_claim_heads(p_keys text[], p_now timestamptz)
RETURNS text[]
LANGUAGE plpgsql STABLE
SET enable_seqscan = on -- as {T}_claimed
AS $$
DECLARE
  heads text[];
BEGIN
  IF NOT EXISTS (SELECT 1 FROM {T}_claims c WHERE c.ends > p_now) THEN
    RETURN '{}';
  END IF;
  IF cardinality(p_keys) <= 8 THEN
    RETURN ARRAY(
      SELECT c.ticket::text FROM {T}_claims c
      WHERE c.ends > p_now
        AND NOT EXISTS (SELECT 1 FROM {T}_claims e WHERE e.ticket = ANY(c.behind)
                          AND e.ends > p_now)
        AND EXISTS (SELECT 1 FROM unnest(p_keys) u(k) WHERE u.k = ANY(c.keys))
      ORDER BY c.ticket);
  END IF;
  EXECUTE 'SELECT ARRAY(
             SELECT DISTINCT c.ticket::text FROM {T}_claims c, unnest(c.keys) k
             WHERE c.ends > $2
               AND NOT EXISTS (SELECT 1 FROM {T}_claims e WHERE e.ticket = ANY(c.behind)
                                 AND e.ends > $2)
               AND k IN (SELECT unnest($1)))'
    INTO heads USING p_keys, p_now;
  RETURN heads;
END $$;

-- The waiters first in line on the keys a call freed (`p_keys[i]`'s is `p_heads[i]`) that
-- no live claim with an earlier ticket keeps out of that key, each once: one that such a
-- claim keeps out would only probe and sleep again (at 16 retail + 4 purchase clients, a
-- purchase order's release woke about 16 retail waiters, most of them kept out by the
-- next purchase order's claim). With no live claim, one look at the table; up to 8 keys
-- are each looked for in the claims, more are hashed in a query planned each time (as in
-- {T}_claim_heads).
CREATE OR REPLACE FUNCTION {T}_unclaimed_heads(
  p_keys text[], p_heads numeric[], p_now timestamptz
) RETURNS text[]
LANGUAGE plpgsql STABLE
SET enable_seqscan = on -- as {T}_claimed
AS $$
DECLARE
  heads text[];
BEGIN
  IF NOT EXISTS (SELECT 1 FROM {T}_claims c WHERE c.ends > p_now) THEN
    RETURN ARRAY(SELECT DISTINCT h::text FROM unnest(p_heads) h);
  END IF;
  IF cardinality(p_keys) <= 8 THEN
    RETURN ARRAY(
      SELECT DISTINCT x.head::text FROM unnest(p_keys, p_heads) x(key, head)
      WHERE NOT EXISTS (SELECT 1 FROM {T}_claims c WHERE c.ends > p_now
                          AND c.ticket < x.head AND x.key = ANY(c.keys)));
  END IF;
  EXECUTE 'SELECT ARRAY(
             SELECT DISTINCT x.head::text FROM unnest($1, $2) x(key, head)
             WHERE NOT EXISTS (SELECT 1 FROM {T}_claims c, unnest(c.keys) k(key)
                               WHERE c.ends > $3 AND c.ticket < x.head AND k.key = x.key))'
    INTO heads USING p_keys, p_heads, p_now;
  RETURN heads;
END $$;

-- A grant's fencing token, from the sequence, raised first on a server other than the
-- last grant's ({T}_fenced_on); a waiter granted with a claim (`p_claim`: its ticket)
-- ends it.
CREATE OR REPLACE FUNCTION {T}_granted(p_claim numeric) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
  v_server text := {T}_server();
  v_raise boolean;
BEGIN
  IF p_claim IS NOT NULL THEN
    DELETE FROM {T}_claims WHERE ticket = p_claim;
  END IF;
  -- By its key: the callers turn sequential scans off, which would price a scan high.
  IF v_server IS DISTINCT FROM (SELECT f.server FROM {T}_fenced_on f WHERE f.id = true)
     AND v_server IS NOT NULL THEN
    -- One grant raises the sequence: the row's lock lines up the others that saw the old
    -- server, which then find the row changed, and skip. (Two raises at once could each
    -- read the sequence before the other's `setval`, and set it back.) Every grant takes
    -- its token after the raise: the others waited for its commit.
    INSERT INTO {T}_fenced_on AS f (server) VALUES (v_server)
      ON CONFLICT (id) DO UPDATE SET server = excluded.server
      WHERE f.server IS DISTINCT FROM excluded.server
      RETURNING true INTO v_raise;
    IF v_raise THEN
      PERFORM {T}_raise_fence();
    END IF;
  END IF;
  RETURN nextval('{T}_fence');
END $$;

-- The rows that grant the keys `p_keys` (each in its mode of `p_modes`) to the hold
-- `p_hold` of `p_owner` until `p_till`, in the batch's order: what an acquisition inserts
-- for the keys that have no row.
CREATE OR REPLACE FUNCTION {T}_new_rows(
  p_keys text[], p_modes text, p_owner uuid, p_hold bigint, p_till timestamptz
) RETURNS TABLE (key text, owner uuid, holds bigint[], modes text, ends timestamptz,
                 readers {T}_reader[])
LANGUAGE sql IMMUTABLE AS $$
  SELECT u.k,
         CASE WHEN m.s THEN NULL ELSE p_owner END,
         CASE WHEN m.s THEN NULL ELSE ARRAY[p_hold] END,
         CASE WHEN m.s THEN NULL ELSE 'x' END,
         CASE WHEN m.s THEN NULL ELSE p_till END,
         CASE WHEN m.s THEN ARRAY[ROW(p_owner, p_hold, p_till)::{T}_reader] END
  FROM unnest(p_keys) WITH ORDINALITY u(k, i),
       LATERAL (SELECT (CASE WHEN length(p_modes) = 1 THEN p_modes
                             ELSE substr(p_modes, u.i::int, 1) END) = 's' AS s) m
  ORDER BY u.i
$$;

-- Locks every key of `keys` (sorted, distinct) in its mode (`modes`: one letter, 'x' or
-- 's', for all, or one a key) for `ttl_ms` under the hold `hold` of `owner`, or none.
-- `ticket`: the caller's place in line (NULL: in no line); `reserve_ms` > 0: a waiter in
-- line, which reserves the whole batch when it is kept out (a big exclusive batch with a
-- claim); `free_first`: whether a big batch tries its keys as new rows first (the store
-- leaves that out under contention, and for a waiter's retry). Returns the fencing token
-- when granted; otherwise how many keys kept it out, the ms until the earliest of the held
-- ones ends (NULL: unknown), up to `report` of them, and whether one is an upgrade. A
-- batch that earlier claims keep out is answered with those keys alone, without a look at
-- the rows.
CREATE OR REPLACE FUNCTION {T}_acquire(
  p_keys text[], p_modes text, p_owner uuid, p_hold bigint, p_ttl_ms bigint, p_report int,
  p_ticket numeric, p_reserve_ms bigint, p_free_first boolean
) RETURNS TABLE (token bigint, conflicts int, earliest_ms bigint, named text[], upgrade boolean)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan -- see "Plans" above
-- Another call's rows are waited for at most this long: a big batch's statement holds
-- them for tens of milliseconds, a user's transaction that guards its writes with `_guard`
-- until it ends. Past it the statement fails (SQLSTATE 55P03), which the store answers as
-- a refusal: the request waits on, or gets 409, well inside the store timeout (2 s by
-- default), where a longer row wait ended as that timeout, a 503.
SET lock_timeout = '500ms'
-- Rows are found by an index scan of `key = ANY(…)`, which takes them in key order, as
-- every call takes them (see {T}_release).
SET enable_seqscan = off SET enable_bitmapscan = off
SET jit = off -- see "Plans" above
AS $$
DECLARE
  now timestamptz := clock_timestamp();
  till timestamptz := now + p_ttl_ms * interval '1 ms';
  taken text[];
  -- The keys whose rows were there before the insert below, and their modes.
  there text[];
  there_modes text;
  r record;
  live {T}_reader[];
  heads text[] := '{}';
  shared boolean;
  cur {T};
  unreserved int;
  inserted int;
  given int;
  claiming boolean := p_ticket IS NOT NULL AND p_reserve_ms > 0 AND p_modes = 'x'
                      AND cardinality(p_keys) >= 64;
  -- A waiter in line (`reserve_ms` > 0) holds no keys of its own.
  holder uuid := CASE WHEN p_reserve_ms <= 0 THEN p_owner END;
  claimed int[] := {T}_claimed(p_keys, holder, p_ticket, now);
  -- The ticket of the caller's entries in the rows' lines (a claim's waiter has none).
  entries numeric := CASE WHEN NOT claiming THEN p_ticket END;
  -- Whether the caller may be handed its key by the call that frees it ({T}_turns).
  turn boolean := p_ticket IS NOT NULL AND p_reserve_ms > 0 AND cardinality(p_keys) = 1
                  AND p_modes = 'x';
  handed bigint;
BEGIN
  conflicts := 0;
  -- Earlier waiters' claims keep the batch out of the keys they name: refused without a
  -- look at the rows.
  IF cardinality(claimed) > 0 THEN
    conflicts := cardinality(claimed);
    named := {T}_at(p_keys, claimed[:p_report]);
    upgrade := false;
  END IF;
  -- A big batch tries its keys as new rows first, with a statement that locks no row
  -- already there (`DO NOTHING`): one whose keys are all free, the rule when nothing is
  -- contended, is granted without the look below (which cost a 3,000-key acquisition a
  -- third of its time). Otherwise the rows it inserted go at once, with the
  -- subtransaction that inserted them, so that it never keeps rows of its own while it
  -- waits for another call's (two batches could then wait for each other crosswise), and
  -- it goes on as any batch.
  IF cardinality(p_keys) >= 64 AND p_free_first AND conflicts = 0 THEN
    BEGIN
      INSERT INTO {T} (key, owner, holds, modes, ends, readers)
        SELECT * FROM {T}_new_rows(p_keys, p_modes, p_owner, p_hold, till)
        ON CONFLICT (key) DO NOTHING;
      GET DIAGNOSTICS inserted = ROW_COUNT;
      IF inserted = cardinality(p_keys) THEN
        token := {T}_granted(CASE WHEN claiming THEN p_ticket END);
        RETURN NEXT;
        RETURN;
      END IF;
      RAISE SQLSTATE 'TBL02'; -- a key had a row: undo the inserts (caught below)
    EXCEPTION WHEN SQLSTATE 'TBL02' THEN NULL;
    END;
    -- The undone inserts took time (milliseconds for thousands of keys): what follows
    -- reads the rows, and a grant's ttl counts, from now.
    now := clock_timestamp();
    till := now + p_ttl_ms * interval '1 ms';
  END IF;
  -- A big batch looks without locks first: kept out, it is refused without locking, or
  -- waiting for, any row, so that its refusals queue neither behind other calls nor hold
  -- them up (a refused attempt of 2,000 keys locked 2,000 rows for its statement, and the
  -- releases of their holders waited); a waiter in line whose reservations are all there
  -- writes nothing. A small batch locks its few rows at once: the look would cost it more
  -- (0.2 ms a call) than it saves; so does the retry of a waiter whose claim is there
  -- (woken, its probe found it free: the look took 2.5 ms of its 15 ms grant).
  IF cardinality(p_keys) >= 64 AND conflicts = 0
     AND NOT (claiming AND EXISTS (SELECT 1 FROM {T}_claims c
                                   WHERE c.ticket = p_ticket AND c.ends > now)) THEN
    SELECT c.conflicts, c.named, c.upgrade, c.earliest_ms, c.unreserved
      INTO conflicts, named, upgrade, earliest_ms, unreserved
      FROM {T}_conflicts(p_keys, p_modes, p_owner, p_ticket, now, p_report) c;
  END IF;
  IF conflicts > 0 THEN
    IF p_ticket IS NULL OR p_reserve_ms <= 0 OR (unreserved = 0 AND NOT claiming) THEN
      PERFORM {T}_commit_lazily();
      RETURN NEXT;
      RETURN;
    END IF;
    IF claiming THEN
      PERFORM {T}_claim(p_keys, p_ticket, now, p_reserve_ms);
    ELSE
      PERFORM {T}_reserve(p_keys, p_ticket, now, p_reserve_ms);
    END IF;
    -- A release between the look and the reservation did not see it, and woke nobody:
    -- ask the probe again, and go on if the batch is free now. Refused, the answer is
    -- the look's: a key it names that was freed since only costs the waiter a probe. A
    -- claim behind a live claim is kept out by it (`behind` names only earlier claims
    -- that share a key): that is asked first, of two rows, where the look at every
    -- claim's keys costs a 2,000-key batch 1.9 ms (psql, three claims of 2,000 keys).
    now := clock_timestamp();
    till := now + p_ttl_ms * interval '1 ms';
    IF (claiming AND EXISTS (SELECT 1 FROM {T}_claims c JOIN {T}_claims e
                               ON e.ticket = ANY(c.behind)
                             WHERE c.ticket = p_ticket AND e.ends > now))
       OR cardinality({T}_claimed(p_keys, holder, p_ticket, now)) > 0
       OR {T}_probe_at(p_keys, p_modes, p_owner, p_ticket, now) < cardinality(p_keys) THEN
      PERFORM {T}_commit_lazily();
      RETURN NEXT;
      RETURN;
    END IF;
  END IF;
  conflicts := 0; named := '{}'; upgrade := false; earliest_ms := NULL;
  -- Free keys are taken at once; the rows of the others are locked, in key order.
  WITH inserted AS (
    INSERT INTO {T} AS l (key, owner, holds, modes, ends, readers)
      SELECT * FROM {T}_new_rows(p_keys, p_modes, p_owner, p_hold, till)
      ON CONFLICT (key) DO UPDATE SET key = excluded.key WHERE false
      RETURNING l.key
  ) SELECT coalesce(array_agg(inserted.key), '{}') INTO taken FROM inserted;
  IF cardinality(taken) = cardinality(p_keys) THEN
    token := {T}_granted(CASE WHEN claiming THEN p_ticket END);
    RETURN NEXT;
    RETURN;
  END IF;
  -- Handed its key while this attempt was on its way (the waiter polled, or its wake-up
  -- was lost): the hold is the waiter's, now under this attempt's hold id (a waiter in
  -- line holds none of its keys otherwise), unless it ended meanwhile. Asked with the
  -- key's row locked, as the hand-over and a withdrawal lock it before the turn.
  IF turn THEN
    DELETE FROM {T}_turns u WHERE u.ticket = p_ticket AND u.token IS NOT NULL
      RETURNING u.hold INTO handed;
    IF handed IS NOT NULL THEN
      UPDATE {T} l SET holds = ARRAY[p_hold], ends = till
        WHERE l.key = p_keys[1] AND l.owner = p_owner AND l.holds = ARRAY[handed]
          AND l.ends > now;
      IF FOUND THEN
        token := {T}_granted(NULL);
        RETURN NEXT;
        RETURN;
      END IF;
    END IF;
  END IF;

  -- The rows that were there, now locked: which keep it out, from now on (the rows are
  -- locked, and ends only pass: what is free now stays free), after the wait for them.
  -- Only those are read from here on: the rows it inserted hold its hold. (A waiter's
  -- 2,000-key grant with 40 of its keys reserved by later waiters read all 2,000 again,
  -- 3.2 ms of its 14-15.) `NOT IN` a subquery is looked up in a hash of it, never a
  -- comparison of every pair.
  SELECT coalesce(array_agg(u.k ORDER BY u.i), '{}'),
         CASE WHEN length(p_modes) = 1 THEN p_modes
              ELSE string_agg(substr(p_modes, u.i::int, 1), '' ORDER BY u.i) END
    INTO there, there_modes
    FROM unnest(p_keys) WITH ORDINALITY u(k, i)
    WHERE u.k NOT IN (SELECT unnest(taken));
  now := clock_timestamp();
  till := now + p_ttl_ms * interval '1 ms';
  SELECT c.conflicts, c.named, c.upgrade, c.earliest_ms
    INTO conflicts, named, upgrade, earliest_ms
    FROM {T}_conflicts(there, there_modes, p_owner, p_ticket, now, p_report) c;
  IF conflicts = 0 THEN
    -- A claim made while this call waited for the rows (up to the lock timeout) keeps it
    -- out as one made before (the rows are locked now, claims are not).
    claimed := {T}_claimed(p_keys, holder, p_ticket, now);
    IF cardinality(claimed) > 0 THEN
      conflicts := cardinality(claimed);
      named := {T}_at(p_keys, claimed[:p_report]);
    END IF;
  END IF;

  IF conflicts > 0 THEN
    IF p_ticket IS NOT NULL AND p_reserve_ms > 0 AND NOT claiming THEN
      -- A waiter in line reserves its whole batch against later arrivals: the rows it
      -- inserted hold nothing now, and every row gets its reservation (all are locked
      -- already: this waits for nobody).
      UPDATE {T} SET owner = NULL, holds = NULL, modes = NULL, ends = NULL, readers = NULL
        WHERE key = ANY(taken);
      PERFORM {T}_reserve(p_keys, p_ticket, now, p_reserve_ms);
      IF turn THEN
        INSERT INTO {T}_turns AS u (key, ticket, owner, hold, ttl_ms, ends)
          VALUES (p_keys[1], p_ticket, p_owner, p_hold, p_ttl_ms,
                  now + p_reserve_ms * interval '1 ms')
          ON CONFLICT (ticket) DO UPDATE
            SET hold = excluded.hold, ttl_ms = excluded.ttl_ms, ends = excluded.ends;
      END IF;
    ELSE
      DELETE FROM {T} WHERE key = ANY(taken);
      IF claiming THEN
        PERFORM {T}_claim(p_keys, p_ticket, now, p_reserve_ms);
      END IF;
    END IF;
    PERFORM {T}_commit_lazily();
    RETURN NEXT;
    RETURN;
  END IF;

  -- Granted. An exclusive batch takes the rows that were there but hold nothing live (its
  -- own reservations, dead rows) in one statement.
  IF p_modes = 'x' THEN
    UPDATE {T} l SET owner = p_owner, holds = ARRAY[p_hold], modes = 'x', ends = till,
        readers = NULL, line = {T}_without(l.line, entries, now)
      WHERE l.key = ANY(there)
        AND NOT (l.owner IS NOT NULL AND l.ends > now)
        AND (l.readers IS NULL
             OR NOT EXISTS (SELECT 1 FROM unnest(l.readers) x WHERE x.ends > now));
    GET DIAGNOSTICS given = ROW_COUNT;
    -- Every key inserted or given this hold: nothing is left for the loop below (a
    -- waiter's grant from under its reservations, the common one in line).
    IF given + cardinality(taken) = cardinality(p_keys) THEN
      IF turn AND given > 0 THEN
        DELETE FROM {T}_turns WHERE ticket = p_ticket;
      END IF;
      token := {T}_granted(CASE WHEN claiming THEN p_ticket END);
      RETURN NEXT;
      RETURN;
    END IF;
  END IF;
  -- The others gain this hold beside the holds there (re-entry, readers, an upgrade).
  FOR r IN
    SELECT l, u.i FROM {T} l JOIN unnest(there) WITH ORDINALITY u(k, i) ON l.key = u.k
    -- Rows that have this hold already (given it by the UPDATE) need nothing: no other
    -- acquisition has this hold id.
    WHERE NOT coalesce(l.owner = p_owner AND p_hold = ANY(l.holds), false)
      AND NOT EXISTS (SELECT 1 FROM unnest(l.readers) x
                      WHERE x.owner = p_owner AND x.hold = p_hold)
    ORDER BY u.i
  LOOP
    shared := (CASE WHEN length(there_modes) = 1 THEN there_modes
                    ELSE substr(there_modes, r.i::int, 1) END) = 's';
    cur := r.l;
      cur.line := {T}_requeue(cur.line, entries, NULL, now);
      SELECT array_agg(ROW(x.owner, x.hold, x.ends)::{T}_reader) INTO live
        FROM unnest(cur.readers) x WHERE x.ends > now;
      IF cur.owner IS NOT NULL AND cur.ends > now THEN
        -- The owner's own exclusive holds: entered again, in either mode.
        IF NOT p_hold = ANY(cur.holds) THEN
          cur.holds := cur.holds || p_hold;
          cur.modes := cur.modes || CASE WHEN shared THEN 's' ELSE 'x' END;
        END IF;
        cur.ends := greatest(cur.ends, till);
      ELSIF live IS NOT NULL AND shared THEN
        IF NOT EXISTS (SELECT 1 FROM unnest(live) x WHERE x.owner = p_owner AND x.hold = p_hold) THEN
          live := live || ROW(p_owner, p_hold, till)::{T}_reader;
        END IF;
        cur.readers := live;
      ELSIF live IS NOT NULL THEN
        -- An upgrade: the owner's shared holds, alone on the key, are carried under this
        -- exclusive one until it ends.
        cur.owner := p_owner;
        SELECT array_agg(x.hold) || p_hold, repeat('s', count(*)::int) || 'x',
               greatest(max(x.ends), till)
          INTO cur.holds, cur.modes, cur.ends
          FROM unnest(live) x WHERE x.hold <> p_hold;
        cur.readers := NULL;
      ELSIF shared THEN
        cur.owner := NULL; cur.holds := NULL; cur.modes := NULL; cur.ends := NULL;
        cur.readers := ARRAY[ROW(p_owner, p_hold, till)::{T}_reader];
      ELSE
        cur.owner := p_owner; cur.holds := ARRAY[p_hold]; cur.modes := 'x';
        cur.ends := till; cur.readers := NULL;
      END IF;
      UPDATE {T} l SET owner = cur.owner, holds = cur.holds, modes = cur.modes,
        ends = cur.ends, readers = cur.readers, line = cur.line
        WHERE l.key = cur.key;
      -- The waiter first in line on a key granted shared may be a reader too.
      IF shared AND {T}_head(cur.line, now) IS NOT NULL
         AND NOT {T}_head(cur.line, now)::text = ANY(heads) THEN
        heads := heads || {T}_head(cur.line, now)::text;
      END IF;
  END LOOP;
  -- As a release does: too many to name wakes every waiter.
  IF cardinality(heads) > 0 THEN PERFORM {T}_announce('', heads); END IF;
  token := {T}_granted(CASE WHEN claiming THEN p_ticket END);
  RETURN NEXT;
END $$;

-- How many keys of `keys`, from the first, would not keep `owner` out at `p_now` (see
-- {T}_keeps_out); it stops at the first that would. Writes nothing. The keys are read 16
-- first, then four times as many as so far, so that a probe that stops at its first keys
-- pays for those: read at once, a 2,000-key batch that its first key kept out took 1.2
-- ms, two keys 0.1.
CREATE OR REPLACE FUNCTION {T}_probe_at(
  p_keys text[], p_modes text, p_owner uuid, p_ticket numeric, p_now timestamptz
) RETURNS int
LANGUAGE plpgsql STABLE AS $$
DECLARE
  r record;
  free int := 0;
  upto int := 0;
BEGIN
  WHILE upto < cardinality(p_keys) LOOP
    upto := least(cardinality(p_keys), upto + greatest(16, 3 * upto));
    FOR r IN
      SELECT l, free + u.i AS i
      FROM unnest(p_keys[free + 1:upto]) WITH ORDINALITY u(k, i) LEFT JOIN {T} l ON l.key = u.k
      ORDER BY u.i
    LOOP
      IF {T}_keeps_out(r.l, p_owner,
          (CASE WHEN length(p_modes) = 1 THEN p_modes ELSE substr(p_modes, r.i::int, 1) END) = 's',
          p_ticket, p_now) > 0 THEN
        RETURN free;
      END IF;
      free := free + 1;
    END LOOP;
  END LOOP;
  RETURN free;
END $$;

-- {T}_probe_at, now, and no further than the first key that an earlier claim keeps the
-- caller out of: what a waiter asks of the keys that kept it out. (The owner's holds are
-- looked up from the first claimed key on, up to the first it does not hold: one row for
-- a waiter in line, which holds none.)
CREATE OR REPLACE FUNCTION {T}_probe(
  p_keys text[], p_modes text, p_owner uuid, p_ticket numeric
) RETURNS int
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan -- see "Plans" above
SET enable_seqscan = off -- see "Plans" above
SET jit = off -- see "Plans" above
AS $$
DECLARE
  now timestamptz := clock_timestamp();
  free int := {T}_probe_at(p_keys, p_modes, p_owner, p_ticket, now);
  a int;
BEGIN
  FOREACH a IN ARRAY {T}_claimed(p_keys[:free], NULL, p_ticket, now) LOOP
    IF NOT {T}_owner_holds(p_keys[a], p_owner, now) THEN
      RETURN a - 1;
    END IF;
  END LOOP;
  RETURN free;
END $$;

-- Extends the hold on every key to at least `ttl_ms` from now if every key still has it;
-- otherwise changes nothing and returns false. On a shared key only this hold moves.
CREATE OR REPLACE FUNCTION {T}_extend(
  p_keys text[], p_owner uuid, p_hold bigint, p_ttl_ms bigint
) RETURNS boolean
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan -- see "Plans" above
-- Rows are waited for at most as long as in {T}_acquire: a user's transaction that
-- guards its writes (`_guard`) keeps them until it ends. Past it the call fails, and is
-- tried again in the background (a release, a renewal, a withdrawal), where it would
-- otherwise keep a pooled connection past the store's timeout, the next call on that
-- connection queued behind it.
SET lock_timeout = '500ms'
SET enable_seqscan = off -- see "Plans" above
SET jit = off -- see "Plans" above
AS $$
DECLARE
  now timestamptz := clock_timestamp();
  till timestamptz := now + p_ttl_ms * interval '1 ms';
  held int;
BEGIN
  SELECT count(*) INTO held FROM (
    SELECT 1 FROM {T} l WHERE l.key = ANY(p_keys)
      AND ((l.owner = p_owner AND p_hold = ANY(l.holds) AND l.ends > now)
           OR EXISTS (SELECT 1 FROM unnest(l.readers) x
                      WHERE x.owner = p_owner AND x.hold = p_hold AND x.ends > now))
    ORDER BY l.key FOR UPDATE
  ) h;
  IF held < cardinality(p_keys) THEN RETURN false; END IF;
  UPDATE {T} l SET
    ends = CASE WHEN l.owner IS NOT NULL THEN greatest(l.ends, till) END,
    readers = (SELECT array_agg(ROW(x.owner, x.hold, CASE
                 WHEN x.owner = p_owner AND x.hold = p_hold THEN greatest(x.ends, till)
                 ELSE x.ends END)::{T}_reader) FROM unnest(l.readers) x)
    WHERE l.key = ANY(p_keys);
  RETURN true;
END $$;

-- Grants each key of `p_keys` whose first waiter (`p_heads`, named in `p_named`, the
-- waiters the caller wakes) has a turn ({T}_turns) to that waiter, if nothing holds it
-- now (the caller has its row locked): its name in `p_named` becomes
-- `ticket:token:hold`, the grant's fencing token and hold, which its process hands it. A
-- call that hands a key over commits as a grant does (it gave a fencing token).
CREATE OR REPLACE FUNCTION {T}_hand_over(
  p_keys text[], p_heads numeric[], p_named text[], p_now timestamptz
) RETURNS text[]
LANGUAGE plpgsql
SET enable_seqscan = off -- see "Plans" above
SET jit = off -- see "Plans" above
AS $$
DECLARE
  t record;
  given bigint;
  named text[] := p_named;
BEGIN
  -- From the waiters named (a few, where the keys may be thousands), by ticket.
  FOR t IN SELECT u.ticket, u.key, u.owner, u.hold, u.ttl_ms
           FROM {T}_turns u
           WHERE u.ticket = ANY(p_named::numeric[]) AND u.token IS NULL AND u.ends > p_now
             AND EXISTS (SELECT 1 FROM unnest(p_keys, p_heads) x(key, head)
                         WHERE x.key = u.key AND x.head = u.ticket)
           ORDER BY u.key
  LOOP
    -- Its TTL from now, not from the release's start (`p_now`): the release may have
    -- waited for rows before it came here, after the waiter's refused attempt (which left
    -- its turn) was sent, and the waiter counts its hold from that attempt.
    UPDATE {T} l SET owner = t.owner, holds = ARRAY[t.hold], modes = 'x',
        ends = clock_timestamp() + t.ttl_ms * interval '1 ms', readers = NULL,
        line = {T}_without(l.line, t.ticket, p_now)
      WHERE l.key = t.key AND NOT (l.owner IS NOT NULL AND l.ends > p_now)
        AND NOT EXISTS (SELECT 1 FROM unnest(l.readers) x WHERE x.ends > p_now);
    IF FOUND THEN
      -- The key's earlier hand-over is over: its hold was this call's, or ended.
      DELETE FROM {T}_turns u WHERE u.key = t.key AND u.token IS NOT NULL;
      given := {T}_granted(NULL);
      UPDATE {T}_turns u SET token = given WHERE u.ticket = t.ticket;
      named := array_replace(named, t.ticket::text,
                             t.ticket::text || ':' || given || ':' || t.hold);
    END IF;
  END LOOP;
  RETURN named;
END $$;

-- Ends the hold `hold` of `owner` on the keys that still have it; a key goes with its last
-- hold, and stays for the waiters that reserved it. Notifies `{C}` with `message` (the
-- wake-up slots) and the waiters first in line on the keys it freed, by a reservation (one
-- that an earlier claim keeps out of the key is left asleep: {T}_unclaimed_heads) or a
-- claim ({T}_claim_heads); a key freed from under a line whose first waiter has a turn is
-- that waiter's ({T}_hand_over). Returns how many keys had the hold, and those waiters'
-- tickets (with the grants handed over).
CREATE OR REPLACE FUNCTION {T}_release(
  p_keys text[], p_owner uuid, p_hold bigint, p_message text
) RETURNS TABLE (released int, heads text[])
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan -- see "Plans" above
SET lock_timeout = '500ms' -- see {T}_extend
-- An index scan of `key = ANY(…)` takes the rows in key order (a sequential scan would
-- take them in the table's order): each of the three statements below takes its rows in
-- key order, without an ordered `FOR UPDATE` first, which would write each row twice. The
-- three together do not: the rows without a line go first. So an attempt of another
-- batch that took a key with a line and waits for one without can keep this release
-- waiting for the first, until one of the two gives up its wait (500 ms, `lock_timeout`):
-- a stall, never a deadlock that lasts, on keys that two batches share while one of them
-- is released and waited for.
SET enable_seqscan = off SET enable_bitmapscan = off
SET jit = off -- see "Plans" above
AS $$
DECLARE
  now timestamptz := clock_timestamp();
  r {T};
  at int;
  head numeric;
  emptied text[];
  head_keys text[];
  head_tickets numeric[];
  woken text[];
BEGIN
  heads := '{}';
  -- The common case, a key with this hold alone and no line, goes at once.
  DELETE FROM {T} l WHERE l.key = ANY(p_keys) AND l.line IS NULL AND (
    (l.owner = p_owner AND l.holds = ARRAY[p_hold] AND l.ends > now)
    OR (l.owner IS NULL AND cardinality(l.readers) = 1
        AND (l.readers[1]).owner = p_owner AND (l.readers[1]).hold = p_hold));
  GET DIAGNOSTICS released = ROW_COUNT;
  -- A key with this exclusive hold alone and a line, the rule under contention, is freed
  -- for its waiters in one statement too (a loop that wrote one row a statement took a
  -- 2,000-key release from under three waiters' lines 19-23 ms, eight times a plain one).
  IF released < cardinality(p_keys) THEN
    WITH freed AS (
      UPDATE {T} l SET owner = NULL, holds = NULL, modes = NULL, ends = NULL
        WHERE l.key = ANY(p_keys) AND l.line IS NOT NULL
          AND l.owner = p_owner AND l.holds = ARRAY[p_hold] AND l.ends > now
        RETURNING l.key, {T}_head(l.line, now) AS head, l.readers IS NULL AS unread
    ) SELECT released + count(*)::int,
             coalesce(array_agg(f.key) FILTER (WHERE f.head IS NOT NULL), '{}'),
             coalesce(array_agg(f.head) FILTER (WHERE f.head IS NOT NULL), '{}'),
             coalesce(array_agg(f.key) FILTER (WHERE f.head IS NULL AND f.unread), '{}')
        INTO released, head_keys, head_tickets, emptied FROM freed f;
    woken := {T}_unclaimed_heads(head_keys, head_tickets, now);
    heads := CASE WHEN cardinality(woken) > 0
                  THEN {T}_hand_over(head_keys, head_tickets, woken, now) ELSE woken END;
    -- Lines whose every reservation had ended: the row goes (locked here already).
    IF cardinality(emptied) > 0 THEN DELETE FROM {T} l WHERE l.key = ANY(emptied); END IF;
  END IF;
  IF released < cardinality(p_keys) THEN
    FOR r IN
      SELECT * FROM {T} l WHERE l.key = ANY(p_keys) AND (
        (l.owner = p_owner AND p_hold = ANY(l.holds) AND l.ends > now)
        OR EXISTS (SELECT 1 FROM unnest(l.readers) x
                   WHERE x.owner = p_owner AND x.hold = p_hold))
      ORDER BY l.key FOR UPDATE
    LOOP
      IF r.owner IS NOT NULL AND r.ends > now THEN
        at := array_position(r.holds, p_hold);
        r.holds := r.holds[:at - 1] || r.holds[at + 1:];
        r.modes := substr(r.modes, 1, at - 1) || substr(r.modes, at + 1);
        IF cardinality(r.holds) = 0 THEN
          r.owner := NULL; r.holds := NULL; r.modes := NULL; r.ends := NULL;
        ELSIF position('x' IN r.modes) = 0 THEN
          -- Its last exclusive hold ended: the owner's shared holds under it are shared
          -- ones again, until the key's end, and other readers may come in.
          SELECT array_agg(ROW(r.owner, h, r.ends)::{T}_reader) INTO r.readers
            FROM unnest(r.holds) h;
          r.owner := NULL; r.holds := NULL; r.modes := NULL; r.ends := NULL;
        END IF;
      ELSE
        SELECT array_agg(ROW(x.owner, x.hold, x.ends)::{T}_reader) INTO r.readers
          FROM unnest(r.readers) x WHERE x.ends > now AND NOT (x.owner = p_owner AND x.hold = p_hold);
      END IF;
      released := released + 1;
      r.line := {T}_requeue(r.line, NULL, NULL, now);
      IF r.owner IS NULL THEN
        head := {T}_head(r.line, now);
        -- Each waiter once: a waiting batch is first in line on many keys of a big one,
        -- and a list of every key's head would outgrow a notification, which then wakes
        -- every waiter.
        IF head IS NOT NULL AND NOT head::text = ANY(heads) THEN heads := heads || head::text; END IF;
      END IF;
      IF r.owner IS NULL AND r.readers IS NULL AND r.line IS NULL THEN
        DELETE FROM {T} l WHERE l.key = r.key;
      ELSE
        UPDATE {T} l SET owner = r.owner, holds = r.holds, modes = r.modes, ends = r.ends,
          readers = r.readers, line = r.line WHERE l.key = r.key;
      END IF;
    END LOOP;
  END IF;
  -- The claims' waiters it may let in.
  IF released > 0 THEN
    heads := heads || {T}_claim_heads(p_keys, now);
  END IF;
  IF cardinality(heads) > 0 THEN PERFORM {T}_announce(p_message, heads); END IF;
  -- A release that handed a key over gave a fencing token: it commits as a grant does.
  IF woken IS NULL OR heads[:cardinality(woken)] = woken THEN
    PERFORM {T}_commit_lazily();
  END IF;
  RETURN NEXT;
END $$;

-- Tells the waiters of every process which slots were freed, and which waiters are now
-- first in line, with the keys handed to them (a payload has at most 8,000 bytes: past
-- that, `*,#*` wakes every waiter, those in line too, and one handed its key takes it
-- with its attempt). Only
-- calls that let a waiter in line in notify: a notification serializes the commits of every
-- transaction that sends one (a lock on the database's queue), which the uncontended path
-- must not pay for; waiters in no line poll for other processes' releases.
CREATE OR REPLACE FUNCTION {T}_announce(p_message text, p_heads text[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
  message text := p_message || coalesce((SELECT string_agg(',#' || h, '') FROM unnest(p_heads) h), '');
BEGIN
  PERFORM pg_notify('{C}', CASE WHEN length(message) < 7900 THEN message ELSE '*,#*' END);
END $$;

-- Takes the reservations of the waiter with `ticket` off the keys (a key nobody holds or
-- reserves any more goes), or ends its claim, and wakes the waiters now first in line on
-- a key not held exclusively. Returns how many keys had one, and those waiters' tickets.
CREATE OR REPLACE FUNCTION {T}_withdraw(
  p_keys text[], p_ticket numeric, p_message text
) RETURNS TABLE (withdrawn int, heads text[])
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan -- see "Plans" above
SET lock_timeout = '500ms' -- see {T}_extend
SET enable_seqscan = off -- see "Plans" above
SET jit = off -- see "Plans" above
AS $$
DECLARE
  now timestamptz := clock_timestamp();
  changed_keys text[];
  claimed text[];
  turn_owner uuid;
  turn_hold bigint;
  turn_token bigint;
BEGIN
  -- A waiter handed its key ({T}_turns) that gives up without taking it (it was out of
  -- time, or its client left) frees it: its place in line went with the hand-over.
  IF cardinality(p_keys) = 1 THEN
    -- The key's row first, as every call that changes a turn locks it.
    PERFORM 1 FROM {T} l WHERE l.key = p_keys[1] FOR UPDATE;
    DELETE FROM {T}_turns u WHERE u.ticket = p_ticket
      RETURNING u.owner, u.hold, u.token INTO turn_owner, turn_hold, turn_token;
    IF turn_token IS NOT NULL THEN
      SELECT r.released, r.heads INTO withdrawn, heads
        FROM {T}_release(p_keys, turn_owner, turn_hold, p_message) r;
      RETURN NEXT;
      RETURN;
    END IF;
  END IF;
  PERFORM {T}_commit_lazily();
  -- A claim's waiter (its batch: the claim's keys) wrote nothing into the rows.
  DELETE FROM {T}_claims c WHERE c.ticket = p_ticket AND c.ends > now RETURNING c.keys
    INTO claimed;
  IF claimed IS NOT NULL THEN
    withdrawn := cardinality(claimed);
    -- The waiters it kept out: those of later claims, and those first in line on its
    -- keys that nobody holds exclusively.
    heads := {T}_claim_heads(claimed, now) || ARRAY(
      SELECT DISTINCT {T}_head(l.line, now)::text FROM {T} l
      WHERE l.key = ANY(claimed) AND l.line IS NOT NULL
        AND NOT (l.owner IS NOT NULL AND l.ends > now)
        AND {T}_head(l.line, now) IS NOT NULL);
    IF cardinality(heads) > 0 THEN PERFORM {T}_announce(p_message, heads); END IF;
    RETURN NEXT;
    RETURN;
  END IF;
  WITH changed AS (
    UPDATE {T} l SET line = {T}_without(l.line, p_ticket, now)
    FROM (SELECT l2.key FROM {T} l2 WHERE l2.key = ANY(p_keys)
            -- A live entry: one that ended keeps nobody out (it stays until a change
            -- of the line walks it), and taking it off would wake the head for nothing.
            AND EXISTS (SELECT 1 FROM unnest(l2.line) q
                        WHERE q.ticket = p_ticket AND q.ends > now)
          ORDER BY l2.key FOR UPDATE) w
    WHERE l.key = w.key
    RETURNING l.key, CASE WHEN NOT (l.owner IS NOT NULL AND l.ends > now)
                     THEN {T}_head(l.line, now) END AS head
  ) SELECT count(*), coalesce(array_agg(DISTINCT c.head::text) FILTER (WHERE c.head IS NOT NULL), '{}'),
           coalesce(array_agg(c.key), '{}')
    INTO withdrawn, heads, changed_keys FROM changed c;
  -- Only the rows changed here, which this call has locked already.
  DELETE FROM {T} l WHERE l.key = ANY(changed_keys) AND {T}_head(l.line, now) IS NULL
    AND NOT (l.owner IS NOT NULL AND l.ends > now)
    AND NOT EXISTS (SELECT 1 FROM unnest(l.readers) x WHERE x.ends > now);
  -- The claims' waiters that its reservations kept out of its keys nobody holds.
  IF withdrawn > 0 THEN
    heads := heads || {T}_claim_heads(ARRAY(
      SELECT k FROM unnest(changed_keys) k
      WHERE NOT EXISTS (SELECT 1 FROM {T} l WHERE l.key = k
                          AND l.owner IS NOT NULL AND l.ends > now)), now);
  END IF;
  IF cardinality(heads) > 0 THEN PERFORM {T}_announce(p_message, heads); END IF;
  RETURN NEXT;
END $$;

-- Ends every hold on the keys, whoever has it; the reservations stay. Returns how many
-- keys were held, and the tickets of the waiters now first in line.
CREATE OR REPLACE FUNCTION {T}_force_release(p_keys text[], p_message text)
RETURNS TABLE (released int, heads text[])
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan -- see "Plans" above
SET lock_timeout = '500ms' -- see {T}_extend
SET enable_seqscan = off -- see "Plans" above
SET jit = off -- see "Plans" above
AS $$
DECLARE
  now timestamptz := clock_timestamp();
  changed_keys text[];
BEGIN
  WITH changed AS (
    UPDATE {T} l SET owner = NULL, holds = NULL, modes = NULL, ends = NULL, readers = NULL,
      line = {T}_requeue(l.line, NULL, NULL, now)
    FROM (SELECT l2.key FROM {T} l2 WHERE l2.key = ANY(p_keys)
            AND ((l2.owner IS NOT NULL AND l2.ends > now)
                 OR EXISTS (SELECT 1 FROM unnest(l2.readers) x WHERE x.ends > now))
          ORDER BY l2.key FOR UPDATE) f
    WHERE l.key = f.key
    RETURNING l.key, {T}_head(l.line, now) AS head
  ) SELECT count(*), coalesce(array_agg(DISTINCT c.head::text) FILTER (WHERE c.head IS NOT NULL), '{}'),
           coalesce(array_agg(c.key), '{}')
    INTO released, heads, changed_keys FROM changed c;
  DELETE FROM {T} l WHERE l.key = ANY(changed_keys) AND l.line IS NULL;
  IF released > 0 THEN
    heads := heads || {T}_claim_heads(p_keys, now);
  END IF;
  IF cardinality(heads) > 0 THEN PERFORM {T}_announce(p_message, heads); END IF;
  RETURN NEXT;
END $$;

-- What each key looks like, in the order given: its state (0 free, 1 held exclusively,
-- 3 held shared), the ms left on its holds (NULL when free), how many holds it has, and
-- how many waiters stand in line for it (live reservations and claims). Never an owner or
-- a hold id.
CREATE OR REPLACE FUNCTION {T}_inspect(p_keys text[])
RETURNS TABLE (state int, left_ms bigint, holds int, waiters int)
LANGUAGE sql STABLE AS $$
  WITH now AS (SELECT clock_timestamp() AS at)
  SELECT CASE WHEN l.owner IS NOT NULL AND l.ends > now.at THEN 1
              WHEN r.live > 0 THEN 3 ELSE 0 END,
         CASE WHEN l.owner IS NOT NULL AND l.ends > now.at
                THEN floor(extract(epoch FROM l.ends - now.at) * 1000)::bigint
              WHEN r.live > 0 THEN floor(extract(epoch FROM r.latest - now.at) * 1000)::bigint END,
         CASE WHEN l.owner IS NOT NULL AND l.ends > now.at THEN cardinality(l.holds)
              ELSE coalesce(r.live, 0) END::int,
         ((SELECT count(*) FROM unnest(l.line) q WHERE q.ends > now.at)
          + coalesce(cl.claims, 0))::int
  FROM now, unnest(p_keys) WITH ORDINALITY u(k, i)
  LEFT JOIN {T} l ON l.key = u.k
  LEFT JOIN (SELECT k.key, count(*) AS claims FROM now n, {T}_claims c, unnest(c.keys) k(key)
             WHERE c.ends > n.at GROUP BY k.key) cl ON cl.key = u.k
  LEFT JOIN LATERAL (SELECT count(*) AS live, max(x.ends) AS latest
                     FROM unnest(l.readers) x, now n WHERE x.ends > n.at) r ON true
  ORDER BY u.i
$$;

-- Deletes up to `batch` rows that hold and reserve nothing any more (their holder and
-- waiters crashed, or their release was lost), and expired answers; rows in use by a call
-- are skipped, not waited for; and the claims and turns that ended (their waiters crashed,
-- or took the key they were handed). Returns how many lock rows and answers went.
CREATE OR REPLACE FUNCTION {T}_sweep(p_batch int) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
  now timestamptz := clock_timestamp();
  gone int;
  answers int;
BEGIN
  DELETE FROM {T} l WHERE l.key IN (
    SELECT d.key FROM {T} d
    WHERE NOT (d.owner IS NOT NULL AND d.ends > now)
      AND NOT EXISTS (SELECT 1 FROM unnest(d.readers) x WHERE x.ends > now)
      AND NOT EXISTS (SELECT 1 FROM unnest(d.line) q WHERE q.ends > now)
    LIMIT p_batch FOR UPDATE SKIP LOCKED);
  GET DIAGNOSTICS gone = ROW_COUNT;
  DELETE FROM {T}_claims c WHERE c.ticket IN (
    SELECT e.ticket FROM {T}_claims e WHERE e.ends <= now FOR UPDATE SKIP LOCKED);
  DELETE FROM {T}_turns u WHERE u.ticket IN (
    SELECT e.ticket FROM {T}_turns e WHERE e.ends <= now FOR UPDATE SKIP LOCKED);
  DELETE FROM {T}_answers a WHERE a.key IN (
    SELECT e.key FROM {T}_answers e WHERE e.ends <= now LIMIT p_batch FOR UPDATE SKIP LOCKED);
  GET DIAGNOSTICS answers = ROW_COUNT;
  RETURN gone + answers;
END $$;

-- The idempotency layer's answers: the first stays until its end.
CREATE OR REPLACE FUNCTION {T}_load_answer(p_key text) RETURNS bytea
LANGUAGE sql STABLE AS $$
  SELECT a.answer FROM {T}_answers a WHERE a.key = p_key AND a.ends > clock_timestamp()
$$;

CREATE OR REPLACE FUNCTION {T}_store_answer(p_key text, p_answer bytea, p_retention_ms bigint)
RETURNS boolean
LANGUAGE sql AS $$
  INSERT INTO {T}_answers AS a (key, answer, ends)
  VALUES (p_key, p_answer, clock_timestamp() + p_retention_ms * interval '1 ms')
  ON CONFLICT (key) DO UPDATE
    SET answer = excluded.answer, ends = excluded.ends
    WHERE a.ends <= clock_timestamp()
  RETURNING true
$$;

-- Holds, until the calling transaction ends, the rows of `p_keys` (as the store keeps them,
-- prefix included) that `p_owner` (the request's owner token) holds now, in any mode; and
-- fails the transaction (SQLSTATE TBL01) unless it holds them all. A transaction that
-- writes the data the locks protect calls it first: a request whose lease ran out, whose
-- keys another request may hold now, cannot commit; and while the transaction runs, no one
-- else is granted the keys (a grant waits for the rows), so no later holder's write comes
-- between this check and the commit.
CREATE OR REPLACE FUNCTION {T}_guard(p_keys text[], p_owner uuid) RETURNS void
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan -- see "Plans" above
SET enable_seqscan = off -- see "Plans" above
SET jit = off -- see "Plans" above
AS $$
DECLARE
  now timestamptz := clock_timestamp();
  held int;
BEGIN
  SELECT count(*) INTO held FROM (
    SELECT 1 FROM {T} l WHERE l.key = ANY(p_keys)
      AND ((l.owner = p_owner AND l.ends > now)
           OR EXISTS (SELECT 1 FROM unnest(l.readers) x WHERE x.owner = p_owner AND x.ends > now))
    ORDER BY l.key FOR SHARE
  ) h;
  IF held < cardinality(p_keys) THEN
    RAISE EXCEPTION USING ERRCODE = 'TBL01',
      MESSAGE = format('the lease on %s of %s keys is lost: another request may hold them',
                       cardinality(p_keys) - held, cardinality(p_keys));
  END IF;
END $$;
