-- 0013: events retention. The outbox (fl.events) gets a row for every submission and for
-- every claim and completion batch; without a sweep it grows for ever. fl.prune_events is the
-- retention job 0008 left a contract for (fenceline/api/events.py, docs/SCHEMA.md section 5):
--   * it deletes only events whose txid is below pg_snapshot_xmin(pg_current_snapshot()),
--     so no event can later commit below what it dropped;
--   * in the same transaction it records, per project, the greatest (txid, id) it dropped in
--     fl.events_retention, never moving it back. A reader whose cursor is below that answers
--     410 cursor_too_old with it as `oldest`, instead of silently missing events.
--
-- It walks the outbox in id order from the oldest and stops at the first event that is too
-- young (created_at within p_keep) or whose writer was running when the statement began:
-- ids are taken at insert, so everything after that point is (nearly) as young, and a pass
-- never scans past the events it keeps. An event left behind by that rule goes in a later
-- pass. Deleting by id leaves the (txid, id) order of one project with holes only below the
-- recorded position, which readers treat as dropped.
--
-- Single runner: the scheduler's sweep calls it in every replica; the transaction-level
-- try-lock (26220, 22) makes the spare ones return 0 (fenceline/db/locks.py).

create function fl.prune_events(p_limit integer, p_keep interval) returns integer
language plpgsql
set enable_seqscan = off
as $$
declare
    v_cutoff timestamptz;
    v_xmin xid8 := pg_snapshot_xmin(pg_current_snapshot());
    v_count integer;
begin
    if p_limit is null or p_limit not between 1 and 100000 then
        perform fl._bad_input('FL005', format('limit must be between 1 and 100000, got %s',
                                              coalesce(p_limit::text, 'null')));
    end if;
    if p_keep is null or p_keep < interval '1 second' then
        perform fl._bad_input('FL005', format('keep must be at least 1 second, got %s',
                                              coalesce(p_keep::text, 'null')));
    end if;
    if not pg_try_advisory_xact_lock(26220, 22) then
        return 0;
    end if;
    v_cutoff := fl.now() - p_keep;

    with head as (
        select e.id, e.project_id, e.txid, e.created_at < v_cutoff and e.txid < v_xmin as old
          from fl.events e
         order by e.id
         limit p_limit
    ), kept as (
        select min(h.id) as id from head h where not h.old
    ), gone as (
        delete from fl.events e
         using head h
         where e.id = h.id
           and h.id < coalesce((select kept.id from kept), 9223372036854775807)
        returning e.project_id, e.txid, e.id
    ), marks as (
        select distinct on (g.project_id) g.project_id, g.txid, g.id
          from gone g
         order by g.project_id, g.txid desc, g.id desc
    ), recorded as (
        insert into fl.events_retention as r (project_id, txid, id, updated_at)
        select m.project_id, m.txid, m.id, fl.now() from marks m
        on conflict (project_id) do update
           set txid = excluded.txid, id = excluded.id, updated_at = excluded.updated_at
         where (excluded.txid, excluded.id) > (r.txid, r.id)
    )
    select count(*) into v_count from gone;
    return v_count;
end;
$$;
