-- 0007: what the HTTP API's job, dead-letter and worker reads need, and paced bulk replay.
--
-- One index on jobs for every job list (fenceline/api/jobs.py): (queue_id, status, id). A list
-- scoped to a queue, or to a project (its queues), is a merge of one ordered range per
-- (queue, status) wanted, each read newest id first from this index and stopped after
-- limit + 1 rows, so a page costs queues x statuses short index probes whatever the backlog,
-- and a status filter is an index condition rather than a filter over every finished job.
-- Its cost: one more b-tree entry per insert and per status change (a status change is never
-- a HOT update: status sits in the predicates of jobs_claimable and jobs_delayed, so every
-- index of jobs already gets an entry per change).
create index jobs_list on fl.jobs (queue_id, status, id);

-- Dead letters are listed newest first per queue (a project's list merges its queues).
-- Dead letters are rare writes; this index costs nothing on the claim and report paths.
create index dead_letters_list on fl.dead_letters (queue_id, id);

-- Bulk replay from the API is paced per queue: at most one call per queue per interval,
-- whoever calls. One row per queue that has ever been bulk-replayed; the row lock taken by
-- the upsert serialises two concurrent calls, and the second sees the first's time.
create table fl.bulk_replays (
    queue_id  uuid primary key references fl.queues (id) on delete cascade,
    last_at   timestamptz not null
);

-- Bulk replay with a per-queue pace and staggered start times.
--   p_rate_per_sec = 0: every replayed job is due now (fl.replay_dead as is).
--   p_rate_per_sec > 0: the k-th job replayed (k = 1.., oldest death first) gets run_at =
--   now + (k - 1) / rate seconds. The jobs are 'queued' with a future run_at (the only edge
--   out of dead_letter is to queued); every claim path reads only run_at <= now, so each
--   becomes claimable when its time comes.
--   p_min_gap: a second call for the same queue within this interval of the last accepted
--   one is refused with outcome 'rate_limited' and retry_at, and changes nothing.
-- Outcomes: one row per replayed job ('ok', job_id, run_at); or exactly one row with job_id
-- NULL: 'rate_limited' (retry_at set), 'queue_full' (the depth cap leaves no room), 'empty'
-- (no dead job to replay). Bad input raises FL005 (limit, rate) or FL001 (queue) first.
create function fl.replay_dead_paced(
    p_queue         uuid,
    p_limit         integer default 100,
    p_rate_per_sec  double precision default 0,
    p_min_gap       interval default interval '1 second')
returns table (outcome text, job_id bigint, run_at timestamptz, retry_at timestamptz)
language plpgsql as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    v_last timestamptz;
    v_ids bigint[];
    v_full boolean := false;
begin
    if p_limit is null or p_limit not between 1 and 1000 then
        perform fl._bad_input('FL005', 'limit must be between 1 and 1000');
    end if;
    if p_rate_per_sec is null or p_rate_per_sec < 0 or p_rate_per_sec = 'NaN'::float8
       or p_rate_per_sec = 'Infinity'::float8
       or (p_rate_per_sec > 0 and p_rate_per_sec < 0.001) then
        perform fl._bad_input('FL005', 'rate_per_sec must be 0 (all due now) or from 0.001 up');
    end if;
    if p_min_gap is null or p_min_gap < interval '0' then
        perform fl._bad_input('FL005', 'the minimum gap must be >= 0');
    end if;
    if not exists (select 1 from fl.queues q where q.id = p_queue) then
        perform fl._bad_input('FL001', format('queue %s does not exist', coalesce(p_queue::text, 'null')));
    end if;

    -- The pace gate: take (or refresh) the queue's row only if the last call is old enough.
    insert into fl.bulk_replays as b (queue_id, last_at) values (p_queue, v_now)
    on conflict (queue_id) do update set last_at = excluded.last_at
     where b.last_at + p_min_gap <= excluded.last_at
    returning b.last_at into v_last;
    if not found then
        return query select 'rate_limited'::text, null::bigint, null::timestamptz,
                            (select b.last_at + p_min_gap from fl.bulk_replays b
                              where b.queue_id = p_queue);
        return;
    end if;

    select array_agg(r.job_id), bool_or(r.outcome = 'queue_full')
      into v_ids, v_full
      from fl.replay_dead(p_queue, p_limit) r;
    if v_full then
        return query select 'queue_full'::text, null::bigint, null::timestamptz, null::timestamptz;
        return;
    end if;
    if v_ids is null then
        return query select 'empty'::text, null::bigint, null::timestamptz, null::timestamptz;
        return;
    end if;

    if p_rate_per_sec > 0 then
        -- Oldest death first, as fl.replay_dead chose them: the death each job was replayed
        -- from is the one of its previous generation.
        return query
        with ordered as (
            select d.job_id as id,
                   row_number() over (order by d.dead_at, d.id) - 1 as k
              from fl.dead_letters d
              join fl.jobs j on j.id = d.job_id and d.replay_generation = j.replay_generation - 1
             where d.job_id = any(v_ids)
        ), u as (
            update fl.jobs j
               set run_at = v_now + make_interval(secs => o.k / p_rate_per_sec)
              from ordered o
             where j.id = o.id and j.status = 'queued'
            returning j.id, j.run_at
        )
        select 'ok'::text, u.id, u.run_at, null::timestamptz from u order by u.run_at, u.id;
        return;
    end if;
    return query select 'ok'::text, j.id, j.run_at, null::timestamptz
                   from fl.jobs j where j.id = any(v_ids) order by j.id;
end;
$$;

comment on function fl.replay_dead_paced(uuid, integer, double precision, interval) is
    'Bulk replay of a queue''s dead jobs, at most one call per queue per p_min_gap, the k-th '
    'job due at now + (k-1)/rate (rate 0: all now). Outcomes ok (per job), rate_limited, '
    'queue_full, empty.';
