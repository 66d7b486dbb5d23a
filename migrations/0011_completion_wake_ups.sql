-- 0011: a completion wakes workers only where it frees room under a concurrency cap; event
-- streams still hear every completion, on a channel of their own.
--
-- 0004's fl.complete called pg_notify('fl_queue', queue) for every batch it completed, and
-- every worker LISTENs on fl_queue. A completion adds no claimable work; the only worker it
-- can unblock is one refused with cap_full. On a queue without a cap each notification woke
-- every worker's listener and claim loop for nothing. In the burn-down (20,000 no-op jobs,
-- one worker at concurrency 16) that cost about 10 % of jobs/s: 1.60x pgqueuer with it,
-- 1.69x with the notification moved to a channel no worker listens on, 1.72-1.78x without
-- any (docs/DECISIONS.md R7).
--
-- The API's event streams wake on notifications so that a reader sees a completion at once
-- instead of at its next poll (up to a second later), and session 2 kept the notification
-- for that reason (D20). So it is kept, moved: an uncapped queue's completions notify
-- fl_events, which the streams LISTEN on beside fl_queue and workers do not. A capped queue's
-- completions notify fl_queue, which wakes both.
--
-- Everything else that wakes workers is unchanged: submissions, releases, promotions,
-- retries (fl._fail_running still notifies fl_queue: the reaper's retries are due at once),
-- dependents becoming queued (the jobs_settle_dependents trigger) and a breaker closing
-- (fl._breaker_successes) all still notify their queue on fl_queue.
--
-- fl.complete below is 0004's body with one line changed (fl._notify_queues ->
-- fl._notify_completed); a migration that changes a function has to restate all of it.

-- One notification per queue in the list: fl_queue where the queue has a concurrency cap
-- (a waiting worker may now fit), fl_events where it has none. A cap set concurrently with
-- the completion may miss its wake-up; the waiting worker's poll (1 s by default) covers it.
create function fl._notify_completed(p_queues uuid[]) returns void
language plpgsql as $$
declare
    r record;
begin
    for r in select x.id, x.max_concurrency is not null as capped
               from fl.queues x where x.id = any(p_queues) loop
        perform pg_notify(case when r.capped then 'fl_queue' else 'fl_events' end, r.id::text);
    end loop;
end;
$$;

create or replace function fl.complete(
    p_worker   uuid,
    p_ids      bigint[],
    p_fences   bigint[],
    p_results  jsonb[] default null)
returns table (job_id bigint, fence bigint, outcome text)
language plpgsql
set enable_seqscan = off
as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    n integer;
    v_ids bigint[];
    v_fences bigint[];
    v_queues uuid[];
    v_bad_ids bigint[];
    v_bad_fences bigint[];
    v_again bigint[];
begin
    n := fl._check_id_arrays(p_ids, p_fences);
    if p_results is not null and cardinality(p_results) <> n then
        perform fl._bad_input('FL005', 'results must be null or one entry per job');
    end if;
    if p_results is not null
       and exists (select 1 from unnest(p_results) r where pg_column_size(r) > 262144) then
        perform fl._bad_input('FL010', 'a result is larger than 262144 bytes');
    end if;
    if n = 0 then
        return;
    end if;

    with inp as (
        select * from unnest(p_ids, p_fences,
                             coalesce(p_results, array_fill(null::jsonb, array[n])))
            as t(id, fence, result)
    ), done as (
        update fl.jobs j
           set status = 'completed', finished_at = v_now, deadline_at = null,
               cancel_requested_at = null
          from inp
         where j.id = inp.id and j.fence = inp.fence and j.status = 'running'
        returning j.id, j.fence, j.queue_id, j.project_id, inp.result
    ), att as (
        update fl.attempts a
           set finished_at = v_now, outcome = 'success', result = done.result
          from done
         where a.job_id = done.id and a.fence = done.fence
    ), ls as (
        delete from fl.leases l using done where l.queue_id = done.queue_id and l.job_id = done.id
    ), ev as (
        insert into fl.events (project_id, queue_id, topic, payload, created_at)
        select done.project_id, done.queue_id, 'jobs.completed',
               jsonb_build_object('worker', p_worker,
                                  'jobs', jsonb_agg(jsonb_build_array(done.id, done.fence)
                                                    order by done.id)),
               v_now
          from done
         group by done.project_id, done.queue_id
    )
    select array_agg(done.id), array_agg(done.fence), array_agg(done.queue_id)
      into v_ids, v_fences, v_queues
      from done;

    if v_ids is not null then
        perform fl._breaker_successes(v_queues, v_ids, v_fences, v_now);
        perform fl._notify_completed(v_queues);
    end if;

    if coalesce(cardinality(v_ids), 0) < n then
        -- A retry of this worker's own completion whose acknowledgement was lost with the
        -- connection: the attempt at that fence is already this worker's success. Answer ok
        -- again and record nothing (completed jobs never change fence, so this is exact).
        select array_agg(i.id) into v_again
          from unnest(p_ids, p_fences) as i(id, fence)
          join fl.attempts a on a.job_id = i.id and a.fence = i.fence
         where (v_ids is null or not (i.id = any(v_ids)))
           and a.outcome = 'success' and a.worker_id = p_worker;
        select array_agg(i.id), array_agg(i.fence) into v_bad_ids, v_bad_fences
          from unnest(p_ids, p_fences) as i(id, fence)
         where (v_ids is null or not (i.id = any(v_ids)))
           and (v_again is null or not (i.id = any(v_again)));
        if v_bad_ids is not null then
            perform fl._record_violations(p_worker, 'complete', v_bad_ids, v_bad_fences, v_now);
        end if;
    end if;

    return query
    select i.id, i.fence,
           case when (v_ids is not null and i.id = any(v_ids))
                  or (v_again is not null and i.id = any(v_again)) then 'ok'
                else 'fenced' end
      from unnest(p_ids, p_fences) with ordinality as i(id, fence, ord)
     order by i.ord;
end;
$$;
