-- 0004: the engine. Every job state change is one of these functions, called in one round
-- trip, returning an explicit outcome. docs/SCHEMA.md lists them with their outcomes and the
-- SQLSTATEs they raise for bad input (class FL; a raised error changes nothing).
--
-- Conventions:
--   * All times come from fl.now(), read once per call.
--   * Every worker write matches id, fence and status together. A write that matches nothing
--     records a fence_violations row and returns 'fenced'; nothing retries it.
--   * Lock order, for every function that touches several: jobs -> attempts -> leases ->
--     queue_state -> dead_letters -> events. Job rows are taken in id order or SKIP LOCKED.
--   * Every state change writes its outbox row in the same transaction and calls
--     pg_notify('fl_queue', <queue id>) there, so listeners wake at commit. The one exception
--     is fl.claim: it adds no work and frees no slot, so there is nobody to wake (its outbox
--     row is still written).
--   * Advisory locks use the two-int form (fenceline/db/locks.py lists every key):
--     (26221 = 0x666D, hashtext(queue id)) serialises the claim gate of one queue until
--     commit; (26220 = 0x666C 'fl', n) makes sweep n single-runner: 10 reap, 11 promote,
--     13 breaker, 20 lease orphans, 21 worker liveness. A sweep function try-locks its own key
--     inside, so it is safe however it is called (a caller already holding the key in the
--     same session re-enters it).

-- ---------------------------------------------------------------------------------------
-- Helpers
-- ---------------------------------------------------------------------------------------

create function fl._bad_input(p_code text, p_message text) returns void
language plpgsql as $$
begin
    raise exception using message = p_message, errcode = p_code;
end;
$$;

-- Arrays of ids and fences from a worker: same length, no NULLs, no duplicate ids, <= 10,000.
create function fl._check_id_arrays(p_ids bigint[], p_fences bigint[]) returns integer
language plpgsql immutable as $$
declare
    n integer := coalesce(cardinality(p_ids), -1);
begin
    if p_ids is null or p_fences is null then
        perform fl._bad_input('FL005', 'ids and fences must not be null');
    end if;
    if n <> cardinality(p_fences) then
        perform fl._bad_input('FL005', format('ids (%s) and fences (%s) differ in length',
                                              n, cardinality(p_fences)));
    end if;
    if n > 10000 then
        perform fl._bad_input('FL005', format('at most 10000 jobs per call, got %s', n));
    end if;
    if array_position(p_ids, null) is not null or array_position(p_fences, null) is not null then
        perform fl._bad_input('FL005', 'ids and fences must not contain null');
    end if;
    if n > 1 and (select count(distinct x) from unnest(p_ids) x) <> n then
        perform fl._bad_input('FL005', 'ids must not repeat within one call');
    end if;
    return n;
end;
$$;

create function fl._check_lease(p_lease interval) returns void
language plpgsql immutable as $$
begin
    if p_lease is null or p_lease <= interval '0' or p_lease > interval '1 day' then
        perform fl._bad_input('FL008', format('lease must be > 0 and <= 1 day, got %s',
                                              coalesce(p_lease::text, 'null')));
    end if;
end;
$$;

-- Backoff for the n-th charged attempt. fixed: base; linear: base * n; exponential:
-- base * 2^(n-1); capped at max; with jitter (policy on and fl.jitter not 'off') a uniform
-- fraction of that ("full jitter").
create function fl.backoff(p_kind fl.backoff_kind, p_base_ms bigint, p_max_ms bigint,
                           p_jitter boolean, p_n integer) returns interval
language plpgsql volatile as $$
declare
    d double precision;
begin
    d := case p_kind
        when 'fixed' then p_base_ms::double precision
        when 'linear' then p_base_ms::double precision * greatest(p_n, 1)
        when 'exponential' then p_base_ms::double precision * power(2::double precision,
                                                                    least(greatest(p_n - 1, 0), 60))
    end;
    d := least(d, p_max_ms::double precision);
    if p_jitter and fl.jitter_enabled() then
        d := random() * d;
    end if;
    return make_interval(secs => d / 1000.0);
end;
$$;

-- Why a failure is terminal, from the counters after the failure is counted; NULL = retry.
create function fl._death_reason(p_kind text, p_attempts integer, p_lost integer,
                                 p_timeouts integer, p_max_attempts integer, p_max_lost integer,
                                 p_max_timeouts integer) returns text
language sql immutable parallel safe as $$
    select case
        when p_kind = 'permanent' then 'permanent_error'
        when p_kind = 'lost' and p_lost >= p_max_lost then 'lost_exhausted'
        when p_kind = 'timeout' and p_timeouts >= p_max_timeouts then 'timeout_exhausted'
        when p_attempts >= p_max_attempts then 'attempts_exhausted'
    end
$$;

-- PL/pgSQL rather than SQL: a SQL function called from PL/pgSQL is parsed and planned on
-- every call (measured 0.5 ms per fl.complete under load, against microseconds for this).
-- pg_notify drops duplicates within a transaction itself; skipping repeats of the previous
-- queue only saves it the lookup.
create function fl._notify_queues(p_queues uuid[]) returns void
language plpgsql as $$
declare
    q uuid;
    prev uuid;
begin
    foreach q in array coalesce(p_queues, '{}') loop
        if q is not null and q is distinct from prev then
            perform pg_notify('fl_queue', q::text);
            prev := q;
        end if;
    end loop;
end;
$$;

-- Job rows a worker no longer owns: record one violation each, in the caller's transaction.
-- The second snapshot (this statement's) sees what the refused write raced with.
create function fl._record_violations(p_worker uuid, p_attempted text, p_ids bigint[],
                                      p_fences bigint[], p_now timestamptz) returns void
language plpgsql as $$
begin
    insert into fl.fence_violations (job_id, worker_id, attempted, held_fence, actual_fence,
                                     actual_status, noticed_at)
    select i.id, p_worker, p_attempted, i.fence, j.fence, j.status, p_now
      from unnest(p_ids, p_fences) as i(id, fence)
      left join fl.jobs j on j.id = i.id;
end;
$$;

-- ---------------------------------------------------------------------------------------
-- Circuit breaker bookkeeping
-- ---------------------------------------------------------------------------------------

-- A probe that stopped without a verdict (snoozed, released, cancelled): free the slot so the
-- next claim can send another probe (reference W2: the probe budget was never given back).
create function fl._breaker_free_probe(p_queues uuid[], p_ids bigint[], p_fences bigint[])
returns void
language plpgsql as $$
begin
    update fl.queue_state s
       set probe_job_id = null, probe_fence = null
      from unnest(p_queues, p_ids, p_fences) as i(queue_id, id, fence)
     where s.queue_id = i.queue_id and s.probe_job_id = i.id and s.probe_fence = i.fence;
end;
$$;

-- Successes: a successful probe closes the breaker; while a failure window is open,
-- successes are counted in it. The common case (closed, no window) writes nothing.
create function fl._breaker_successes(p_queues uuid[], p_ids bigint[], p_fences bigint[],
                                      p_now timestamptz) returns void
language plpgsql as $$
declare
    r record;
begin
    if not exists (select 1 from fl.queue_state
                    where queue_id = any(p_queues)
                      and (breaker_state = 'half_open' or win_failures > 0)) then
        return;
    end if;
    for r in
        update fl.queue_state s
           set breaker_state = 'closed', breaker_changed_at = p_now, probe_job_id = null,
               probe_fence = null, win_started_at = null, win_failures = 0, win_successes = 0
          from unnest(p_queues, p_ids, p_fences) as i(queue_id, id, fence)
         where s.queue_id = i.queue_id and s.breaker_state = 'half_open'
           and s.probe_job_id = i.id and s.probe_fence = i.fence
        returning s.queue_id
    loop
        insert into fl.events (project_id, queue_id, topic, payload)
        select q.project_id, q.id, 'queue.breaker_closed', '{}'::jsonb
          from fl.queues q where q.id = r.queue_id;
        perform pg_notify('fl_queue', r.queue_id::text);
    end loop;
    update fl.queue_state s
       set win_successes = s.win_successes + d.n
      from (select q, count(*)::integer as n from unnest(p_queues) q group by q) d, fl.queues cfg
     where s.queue_id = d.q and cfg.id = d.q
       and s.breaker_state = 'closed' and s.win_failures > 0
       and s.win_started_at > p_now - make_interval(secs => cfg.breaker_window_ms / 1000.0);
end;
$$;

-- Failures: a failed probe reopens the breaker; while closed, failures open or extend the
-- window and trip it when failures >= min volume and failures / outcomes >= ratio. The window
-- starts at the first failure and is reset by every state change, so outcomes from before the
-- breaker closed never count again (reference W3/W13).
create function fl._breaker_failures(p_queues uuid[], p_ids bigint[], p_fences bigint[],
                                     p_now timestamptz) returns void
language plpgsql as $$
declare
    v_q uuid;
    r record;
    n integer;
    v_topic text;
    v_window interval;
begin
    for v_q in select distinct x from unnest(p_queues) x where x is not null order by 1 loop
        select s.breaker_state, s.probe_job_id, s.probe_fence, s.win_started_at, s.win_failures,
               s.win_successes, cfg.project_id, cfg.breaker_enabled, cfg.breaker_failure_ratio,
               cfg.breaker_min_volume, cfg.breaker_window_ms, cfg.breaker_cooldown_ms
          into r
          from fl.queue_state s join fl.queues cfg on cfg.id = s.queue_id
         where s.queue_id = v_q
           for update of s;
        continue when not found;
        n := (select count(*) from unnest(p_queues) x where x = v_q);
        v_topic := null;
        if r.breaker_state = 'half_open' then
            if exists (select 1 from unnest(p_queues, p_ids, p_fences) as k(q, id, fence)
                        where k.q = v_q and k.id = r.probe_job_id and k.fence = r.probe_fence) then
                update fl.queue_state
                   set breaker_state = 'open', breaker_changed_at = p_now,
                       breaker_open_until = p_now + make_interval(secs => r.breaker_cooldown_ms / 1000.0),
                       probe_job_id = null, probe_fence = null,
                       win_started_at = null, win_failures = 0, win_successes = 0
                 where queue_id = v_q;
                v_topic := 'queue.breaker_reopened';
            end if;
        elsif r.breaker_state = 'closed' and r.breaker_enabled then
            v_window := make_interval(secs => r.breaker_window_ms / 1000.0);
            if r.win_failures = 0 or r.win_started_at is null or r.win_started_at <= p_now - v_window then
                r.win_started_at := p_now;
                r.win_failures := n;
                r.win_successes := 0;
            else
                r.win_failures := r.win_failures + n;
            end if;
            if r.win_failures >= r.breaker_min_volume
               and r.win_failures >= r.breaker_failure_ratio * (r.win_failures + r.win_successes) then
                update fl.queue_state
                   set breaker_state = 'open', breaker_changed_at = p_now,
                       breaker_open_until = p_now + make_interval(secs => r.breaker_cooldown_ms / 1000.0),
                       win_started_at = null, win_failures = 0, win_successes = 0
                 where queue_id = v_q;
                v_topic := 'queue.breaker_opened';
            else
                update fl.queue_state
                   set win_started_at = r.win_started_at, win_failures = r.win_failures,
                       win_successes = r.win_successes
                 where queue_id = v_q;
            end if;
        end if;
        if v_topic is not null then
            insert into fl.events (project_id, queue_id, topic, payload, created_at)
            values (r.project_id, v_q, v_topic,
                    jsonb_build_object('failures', r.win_failures, 'successes', r.win_successes),
                    p_now);
            perform pg_notify('fl_queue', v_q::text);
        end if;
    end loop;
end;
$$;

-- ---------------------------------------------------------------------------------------
-- Submit
-- ---------------------------------------------------------------------------------------

-- Jobs waiting in a queue (queued + delayed), counted up to p_cap: the advisory depth cap.
create function fl._queue_depth(p_queue uuid, p_cap integer) returns integer
language plpgsql stable as $$
declare
    n integer;
begin
    select count(*) into n from (
        select 1 from fl.jobs where queue_id = p_queue and status = 'queued' limit p_cap) s;
    if n < p_cap then
        n := n + (select count(*) from (
            select 1 from fl.jobs
             where queue_id = p_queue and status in ('scheduled', 'retry_wait') and pending_deps = 0
             limit p_cap - n) s);
    end if;
    return n;
end;
$$;

create function fl.submit(
    p_queue        uuid,
    p_type         text,
    p_payload      jsonb default '{}',
    p_priority     integer default null,
    p_run_at       timestamptz default null,
    p_delay_s      double precision default null,
    p_timeout_ms   integer default null,
    p_retry_policy uuid default null)
returns table (outcome text, job_id bigint, status fl.job_status, run_at timestamptz)
language plpgsql as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    q record;
    v_run_at timestamptz;
    v_status fl.job_status;
    v_id bigint;
begin
    if p_type is null or length(p_type) not between 1 and 200 then
        perform fl._bad_input('FL009', 'job type must be 1 to 200 characters');
    end if;
    if p_payload is null then
        perform fl._bad_input('FL005', 'payload must not be null (use {} for none)');
    end if;
    if pg_column_size(p_payload) > 262144 then
        perform fl._bad_input('FL002', format('payload is %s bytes, the limit is 262144',
                                              pg_column_size(p_payload)));
    end if;
    if p_delay_s is not null and (p_delay_s < 0 or p_delay_s = 'NaN'::float8
                                  or p_delay_s > 315360000) then
        perform fl._bad_input('FL003', format('delay must be between 0 and 315360000 s, got %s',
                                              p_delay_s));
    end if;
    if p_run_at is not null and not isfinite(p_run_at) then
        perform fl._bad_input('FL003', 'run_at must be a finite time');
    end if;
    if p_run_at is not null and p_delay_s is not null then
        perform fl._bad_input('FL005', 'give run_at or a delay, not both');
    end if;
    if p_timeout_ms is not null and p_timeout_ms <= 0 then
        perform fl._bad_input('FL005', format('timeout_ms must be positive, got %s', p_timeout_ms));
    end if;

    select qq.project_id, qq.retry_policy_id, qq.default_priority, qq.default_timeout_ms,
           qq.max_depth
      into q from fl.queues qq where qq.id = p_queue;
    if not found then
        perform fl._bad_input('FL001', format('queue %s does not exist', coalesce(p_queue::text, 'null')));
    end if;
    if p_retry_policy is not null
       and not exists (select 1 from fl.retry_policies rp
                        where rp.id = p_retry_policy and rp.project_id = q.project_id) then
        perform fl._bad_input('FL007', format('retry policy %s does not exist in the queue''s project',
                                              p_retry_policy));
    end if;

    v_run_at := coalesce(p_run_at, v_now + make_interval(secs => coalesce(p_delay_s, 0)));
    v_status := case when v_run_at > v_now then 'scheduled' else 'queued' end;

    if q.max_depth is not null and fl._queue_depth(p_queue, q.max_depth) >= q.max_depth then
        return query select 'queue_full'::text, null::bigint, null::fl.job_status, null::timestamptz;
        return;
    end if;

    insert into fl.jobs (project_id, queue_id, type, payload, status, priority, run_at,
                         timeout_ms, retry_policy_id, created_at)
    values (q.project_id, p_queue, p_type, p_payload, v_status,
            coalesce(p_priority, q.default_priority), v_run_at,
            coalesce(p_timeout_ms, q.default_timeout_ms),
            coalesce(p_retry_policy, q.retry_policy_id), v_now)
    returning id into v_id;

    insert into fl.events (project_id, queue_id, job_id, topic, payload, created_at)
    values (q.project_id, p_queue, v_id, 'job.submitted',
            jsonb_build_object('type', p_type, 'status', v_status, 'run_at', v_run_at), v_now);
    perform pg_notify('fl_queue', p_queue::text);

    return query select 'ok'::text, v_id, v_status, v_run_at;
end;
$$;

-- ---------------------------------------------------------------------------------------
-- Promotion: delayed jobs whose time has come become queued
-- ---------------------------------------------------------------------------------------

create function fl._promote_queue(p_queue uuid, p_now timestamptz, p_limit integer)
returns integer
language plpgsql as $$
declare
    v_ids bigint[];
begin
    v_ids := array(
        select id from fl.jobs
         where queue_id = p_queue and status in ('scheduled', 'retry_wait') and pending_deps = 0
           and run_at <= p_now
         order by run_at
         limit p_limit
           for update skip locked);
    if cardinality(v_ids) = 0 then
        return 0;
    end if;
    update fl.jobs set status = 'queued' where id = any(v_ids);
    insert into fl.events (project_id, queue_id, topic, payload, created_at)
    select q.project_id, q.id, 'jobs.promoted', jsonb_build_object('jobs', to_jsonb(v_ids)), p_now
      from fl.queues q where q.id = p_queue;
    perform pg_notify('fl_queue', p_queue::text);
    return cardinality(v_ids);
end;
$$;

-- Promoter sweep over every queue. fl.claim promotes the due jobs of its own queue before it
-- claims, so a worker never waits for this sweep; it exists so due jobs of queues nobody is
-- claiming show as queued, and so listeners wake when a delayed job comes due.
create function fl.promote(p_limit integer default 1000) returns integer
language plpgsql as $$
declare
    v_now timestamptz := fl.now();
    v_total integer := 0;
    v_q uuid;
begin
    if p_limit is null or p_limit not between 1 and 100000 then
        perform fl._bad_input('FL005', 'limit must be between 1 and 100000');
    end if;
    if not pg_try_advisory_xact_lock(26220, 11) then
        return 0;
    end if;
    for v_q in
        select q.id from fl.queues q
         where exists (select 1 from fl.jobs j
                        where j.queue_id = q.id and j.status in ('scheduled', 'retry_wait')
                          and j.pending_deps = 0 and j.run_at <= v_now)
         order by q.id
    loop
        v_total := v_total + fl._promote_queue(v_q, v_now, p_limit - v_total);
        exit when v_total >= p_limit;
    end loop;
    return v_total;
end;
$$;

-- ---------------------------------------------------------------------------------------
-- Claim
-- ---------------------------------------------------------------------------------------

-- The distinct types queued in a queue (a loose index scan over jobs_claimable).
create function fl.queued_types(p_queue uuid) returns text[]
language plpgsql stable as $$
begin
    return (with recursive t(type) as (
        (select type from fl.jobs where queue_id = p_queue and status = 'queued'
          order by type limit 1)
        union all
        select (select j.type from fl.jobs j
                 where j.queue_id = p_queue and j.status = 'queued' and j.type > t.type
                 order by j.type limit 1)
          from t where t.type is not null
    )
    select coalesce(array_agg(type order by type), '{}') from t where type is not null);
end;
$$;

-- Priority aging (reference W16, done at claim time instead of by a sweep that rewrites
-- stored priority): a job's effective priority is its priority plus one level per p_step_ms
-- it has waited since run_at (when it became due), at most p_max_boost levels. NULL step =
-- aging off: the priority itself. Nothing is written, so the claimable index never churns and
-- a job that is retried starts waiting again from its new run_at. Inlined into the claim.
create function fl.effective_priority(
    p_priority   integer,
    p_run_at     timestamptz,
    p_now        timestamptz,
    p_step_ms    integer,
    p_max_boost  integer)
returns bigint
language sql immutable parallel safe as $$
    select p_priority::bigint
           + case when p_step_ms is null then 0
                  else least(p_max_boost,
                             div(greatest(extract(epoch from p_now - p_run_at), 0) * 1000,
                                 p_step_ms))::bigint
             end
$$;

comment on function fl.effective_priority(integer, timestamptz, timestamptz, integer, integer) is
    'priority + least(max_boost, floor(ms waited since run_at / step_ms)); the priority when step_ms is NULL.';

-- Claims up to p_n due jobs of p_queue whose type is in p_types (NULL = any) for p_worker:
-- straight into 'running', fence + 1, one attempt charged, a lease of p_lease, an open ledger
-- row. Order: priority desc, run_at, id; on a queue with aging (aging_step_ms set), effective
-- priority (fl.effective_priority) desc, run_at, id. Gates, in order: worker active, queue not
-- paused, concurrency cap, breaker, token bucket.
--
-- Returns the claimed jobs with outcome 'ok', or exactly one row with job_id NULL whose
-- outcome says why nothing was claimed and retry_at, when known, says when to try again:
--   worker_inactive, paused, cap_full, breaker_open (retry_at = end of cooldown),
--   probe_in_flight, rate_limited (retry_at = next token), empty (retry_at = next delayed job).
create function fl.claim(
    p_queue   uuid,
    p_worker  uuid,
    p_types   text[],
    p_n       integer,
    p_lease   interval)
returns table (outcome text, job_id bigint, fence bigint, attempt integer, type text,
               payload jsonb, priority integer, replay_generation integer,
               deadline_at timestamptz, lease_expires_at timestamptz, retry_at timestamptz)
language plpgsql
-- Generic plans: the claim's statements are written so that their generic plans are index
-- scans (ids picked into an array, LIMIT inside it; tests/engine/test_type_routing.py checks
-- the plans), which spares re-planning the candidate query on every call. No sequential
-- scans: see the note on fl.complete.
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    q record;
    s record;
    v_wstate text;
    v_k integer := p_n;
    v_inflight integer;
    v_tokens double precision;
    v_probe boolean := false;
    v_types text[] := p_types;
    v_ids bigint[];
    v_cand bigint[];
    v_count integer;
begin
    if p_n is null or p_n not between 1 and 1000 then
        perform fl._bad_input('FL005', format('n must be between 1 and 1000, got %s',
                                              coalesce(p_n::text, 'null')));
    end if;
    perform fl._check_lease(p_lease);
    if p_types is not null and (cardinality(p_types) = 0 or array_position(p_types, null) is not null) then
        perform fl._bad_input('FL005', 'types must be NULL (any) or a non-empty list without nulls');
    end if;

    select qq.project_id, qq.paused, qq.max_concurrency, qq.rl_rate, qq.rl_burst,
           qq.breaker_enabled, qq.aging_step_ms, qq.aging_max_boost
      into q from fl.queues qq where qq.id = p_queue;
    if not found then
        perform fl._bad_input('FL001', format('queue %s does not exist', coalesce(p_queue::text, 'null')));
    end if;
    select w.state into v_wstate from fl.workers w where w.id = p_worker;
    if not found then
        perform fl._bad_input('FL006', format('worker %s is not registered', coalesce(p_worker::text, 'null')));
    end if;
    if v_wstate <> 'active' then
        return query select 'worker_inactive'::text, null::bigint, null::bigint, null::integer,
            null::text, null::jsonb, null::integer, null::integer, null::timestamptz,
            null::timestamptz, null::timestamptz;
        return;
    end if;
    if q.paused then
        return query select 'paused'::text, null::bigint, null::bigint, null::integer,
            null::text, null::jsonb, null::integer, null::integer, null::timestamptz,
            null::timestamptz, null::timestamptz;
        return;
    end if;

    select case when q.breaker_enabled then st.breaker_state else 'closed' end as breaker_state,
           st.breaker_open_until, st.probe_job_id, st.rl_tokens, st.rl_refilled_at
      into s from fl.queue_state st where st.queue_id = p_queue;

    if q.max_concurrency is not null or q.rl_rate is not null or s.breaker_state <> 'closed' then
        -- Serialise the gate of this queue until commit. The count below runs in a later
        -- statement, so its snapshot includes every claim committed before we got the lock.
        perform pg_advisory_xact_lock(26221, hashtext(p_queue::text));
        select case when q.breaker_enabled then st.breaker_state else 'closed' end as breaker_state,
               st.breaker_open_until, st.probe_job_id, st.rl_tokens,
               st.rl_refilled_at
          into s from fl.queue_state st where st.queue_id = p_queue;

        if q.max_concurrency is not null then
            select count(*) into v_inflight from fl.leases l where l.queue_id = p_queue;
            v_k := least(v_k, q.max_concurrency - v_inflight);
            if v_k <= 0 then
                return query select 'cap_full'::text, null::bigint, null::bigint, null::integer,
                    null::text, null::jsonb, null::integer, null::integer, null::timestamptz,
                    null::timestamptz, null::timestamptz;
                return;
            end if;
        end if;

        if s.breaker_state = 'open' then
            if v_now < s.breaker_open_until then
                return query select 'breaker_open'::text, null::bigint, null::bigint,
                    null::integer, null::text, null::jsonb, null::integer, null::integer,
                    null::timestamptz, null::timestamptz, s.breaker_open_until;
                return;
            end if;
            update fl.queue_state
               set breaker_state = 'half_open', breaker_changed_at = v_now,
                   breaker_open_until = null, probe_job_id = null, probe_fence = null
             where queue_id = p_queue;
            insert into fl.events (project_id, queue_id, topic, created_at)
            values (q.project_id, p_queue, 'queue.breaker_half_open', v_now);
            perform pg_notify('fl_queue', p_queue::text);
            s.breaker_state := 'half_open';
            s.probe_job_id := null;
        end if;
        if s.breaker_state = 'half_open' then
            if s.probe_job_id is not null then
                return query select 'probe_in_flight'::text, null::bigint, null::bigint,
                    null::integer, null::text, null::jsonb, null::integer, null::integer,
                    null::timestamptz, null::timestamptz, null::timestamptz;
                return;
            end if;
            v_k := 1;
            v_probe := true;
        end if;

        if q.rl_rate is not null then
            v_tokens := least(q.rl_burst,
                              s.rl_tokens + greatest(0, extract(epoch from v_now - s.rl_refilled_at))
                                            * q.rl_rate);
            if v_tokens < 1 then
                return query select 'rate_limited'::text, null::bigint, null::bigint,
                    null::integer, null::text, null::jsonb, null::integer, null::integer,
                    null::timestamptz, null::timestamptz,
                    v_now + make_interval(secs => (1 - v_tokens) / q.rl_rate);
                return;
            end if;
            v_k := least(v_k, floor(v_tokens)::integer);
        end if;
    end if;

    -- Delayed jobs of this queue that are due become claimable now, in this call: no job
    -- waits for a promoter sweep.
    if exists (select 1 from fl.jobs j
                where j.queue_id = p_queue and j.status in ('scheduled', 'retry_wait')
                  and j.pending_deps = 0 and j.run_at <= v_now) then
        perform fl._promote_queue(p_queue, v_now, 1000);
    end if;

    if v_types is null then
        v_types := fl.queued_types(p_queue);
    end if;

    -- Pick the ids (array-of-ids form: with LIMIT inside array(), generic plans stay index
    -- scans). One type: one ordered index range. Several: the head of each type's range,
    -- merged, then locked in order with SKIP LOCKED.
    --
    -- Aging on: the index order (priority desc, run_at, id) is no longer the claim order, but
    -- within one priority level it still is (older = more boost). So, per type, a skip scan
    -- finds the distinct priority levels queued (each step one index probe: the highest
    -- priority below the last), the head of each level is read as an ordered index range
    -- (its first 2k by run_at, id, due ones only), and the heads are merged by effective
    -- priority and locked in that order with SKIP LOCKED. Cost: types x levels probes plus
    -- at most types x levels x 2k index entries, whatever the backlog.
    if q.aging_step_ms is not null and cardinality(v_types) > 0 then
        v_cand := array(
            with recursive lv(tp, p) as (
                select t.tp,
                       (select x.priority from fl.jobs x
                         where x.queue_id = p_queue and x.type = t.tp and x.status = 'queued'
                         order by x.priority desc limit 1)
                  from unnest(v_types) as t(tp)
                union all
                select lv.tp,
                       (select x.priority from fl.jobs x
                         where x.queue_id = p_queue and x.type = lv.tp and x.status = 'queued'
                           and x.priority < lv.p
                         order by x.priority desc limit 1)
                  from lv where lv.p is not null
            )
            select c.id
              from lv
             cross join lateral (
                   select x.id, x.priority, x.run_at from fl.jobs x
                    where x.queue_id = p_queue and x.type = lv.tp and x.status = 'queued'
                      and x.priority = lv.p and x.run_at <= v_now
                    order by x.run_at, x.id
                    limit v_k * 2) c
             where lv.p is not null
             order by fl.effective_priority(c.priority, c.run_at, v_now, q.aging_step_ms,
                                            q.aging_max_boost) desc, c.run_at, c.id
             limit v_k * 2);
        v_ids := array(
            select j.id from fl.jobs j
             where j.id = any(v_cand) and j.status = 'queued' and j.run_at <= v_now
             order by fl.effective_priority(j.priority, j.run_at, v_now, q.aging_step_ms,
                                            q.aging_max_boost) desc, j.run_at, j.id
             limit v_k
               for update skip locked);
    elsif cardinality(v_types) = 1 then
        v_ids := array(
            select j.id from fl.jobs j
             where j.queue_id = p_queue and j.type = v_types[1] and j.status = 'queued'
               and j.run_at <= v_now
             order by j.priority desc, j.run_at, j.id
             limit v_k
               for update skip locked);
    elsif cardinality(v_types) > 1 then
        v_ids := array(
            select j.id from fl.jobs j
             where j.id = any(array(
                       select c.id
                         from unnest(v_types) as t(tp)
                        cross join lateral (
                              select x.id, x.priority, x.run_at from fl.jobs x
                               where x.queue_id = p_queue and x.type = t.tp
                                 and x.status = 'queued' and x.run_at <= v_now
                               order by x.priority desc, x.run_at, x.id
                               limit v_k * 2) c
                        order by c.priority desc, c.run_at, c.id
                        limit v_k * 2))
               and j.status = 'queued'
             order by j.priority desc, j.run_at, j.id
             limit v_k
               for update skip locked);
    else
        v_ids := '{}';
    end if;

    if cardinality(v_ids) = 0 then
        return query select 'empty'::text, null::bigint, null::bigint, null::integer,
            null::text, null::jsonb, null::integer, null::integer, null::timestamptz,
            null::timestamptz,
            (select min(j.run_at) from fl.jobs j
              where j.queue_id = p_queue and j.status in ('scheduled', 'retry_wait')
                and j.pending_deps = 0);
        return;
    end if;

    return query
    with u as (
        update fl.jobs j
           set status = 'running', fence = j.fence + 1, attempts = j.attempts + 1,
               claimed_at = v_now,
               deadline_at = v_now + make_interval(secs => j.timeout_ms / 1000.0)
         where j.id = any(v_ids) and j.status = 'queued'
        returning j.id, j.fence, j.attempts, j.type, j.payload, j.priority, j.run_at,
                  j.replay_generation, j.deadline_at
    ), a as (
        insert into fl.attempts (job_id, fence, replay_generation, attempt, queue_id, worker_id,
                                 started_at, deadline_at)
        select u.id, u.fence, u.replay_generation, u.attempts, p_queue, p_worker, v_now,
               u.deadline_at
          from u
    ), l as (
        insert into fl.leases (job_id, queue_id, worker_id, fence, expires_at, heartbeat_at)
        select u.id, p_queue, p_worker, u.fence, v_now + p_lease, v_now from u
    ), e as (
        insert into fl.events (project_id, queue_id, topic, payload, created_at)
        select q.project_id, p_queue, 'jobs.claimed',
               jsonb_build_object('worker', p_worker,
                                  'jobs', jsonb_agg(jsonb_build_array(u.id, u.fence) order by u.id)),
               v_now
          from u
    )
    select 'ok'::text, u.id, u.fence, u.attempts, u.type, u.payload, u.priority,
           u.replay_generation, u.deadline_at, v_now + p_lease, null::timestamptz
      from u
     order by fl.effective_priority(u.priority, u.run_at, v_now, q.aging_step_ms,
                                    q.aging_max_boost) desc, u.run_at, u.id;
    get diagnostics v_count = row_count;

    if v_probe then
        update fl.queue_state st
           set probe_job_id = v_ids[1],
               probe_fence = (select j.fence from fl.jobs j where j.id = v_ids[1])
         where st.queue_id = p_queue;
    end if;
    if q.rl_rate is not null then
        update fl.queue_state st
           set rl_tokens = v_tokens - v_count, rl_refilled_at = v_now
         where st.queue_id = p_queue;
    end if;
end;
$$;

-- ---------------------------------------------------------------------------------------
-- Heartbeat: extend leases
-- ---------------------------------------------------------------------------------------

-- Extends every lease in the list that p_worker still holds (same fence, job running), to
-- min(now + lease, deadline + lease): a live worker always keeps one lease of grace to report
-- a timeout itself. Marks the worker seen. Returns only the jobs that need attention:
--   cancel_requested  still yours and extended, but fl.cancel asked you to stop it;
--   finished          you already reported it (this heartbeat raced your own report);
--   fenced            not yours any more: stop it (a violation is recorded).
create function fl.extend_leases(
    p_worker    uuid,
    p_ids       bigint[],
    p_fences    bigint[],
    p_lease     interval,
    p_progress  jsonb[] default null)
returns table (job_id bigint, fence bigint, outcome text)
language plpgsql
set enable_seqscan = off
as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    n integer;
    v_ext bigint[];
    v_cancel bigint[];
    v_bad_ids bigint[];
    v_bad_fences bigint[];
begin
    n := fl._check_id_arrays(p_ids, p_fences);
    perform fl._check_lease(p_lease);
    if p_progress is not null and cardinality(p_progress) <> n then
        perform fl._bad_input('FL005', 'progress must be null or one entry per job');
    end if;
    update fl.workers w set last_seen_at = v_now where w.id = p_worker;
    if not found then
        perform fl._bad_input('FL006', format('worker %s is not registered',
                                              coalesce(p_worker::text, 'null')));
    end if;
    if n = 0 then
        return;
    end if;

    with inp as (
        select * from unnest(p_ids, p_fences,
                             coalesce(p_progress, array_fill(null::jsonb, array[n])))
            as t(id, fence, progress)
    ), ext as (
        update fl.leases l
           set expires_at = least(v_now + p_lease, j.deadline_at + p_lease),
               heartbeat_at = v_now,
               progress = coalesce(inp.progress, l.progress)
          from inp join fl.jobs j on j.id = inp.id
         where l.queue_id = j.queue_id and l.job_id = inp.id and l.fence = inp.fence
           and l.worker_id = p_worker and j.fence = inp.fence and j.status = 'running'
        returning l.job_id, j.cancel_requested_at is not null as cancel
    )
    select coalesce(array_agg(ext.job_id), '{}'),
           coalesce(array_agg(ext.job_id) filter (where ext.cancel), '{}')
      into v_ext, v_cancel
      from ext;

    return query
    select i.id, i.fence, 'cancel_requested'::text
      from unnest(p_ids, p_fences) as i(id, fence)
     where i.id = any(v_cancel);

    if cardinality(v_ext) = n then
        return;
    end if;
    -- Not extended. A fresh snapshot tells a heartbeat that raced its own report (same fence,
    -- job no longer running) from one whose job moved on (fence moved: a violation).
    return query
    select i.id, i.fence, 'finished'::text
      from unnest(p_ids, p_fences) as i(id, fence)
      join fl.jobs j on j.id = i.id
     where not (i.id = any(v_ext)) and j.fence = i.fence and j.status <> 'running';

    select array_agg(i.id), array_agg(i.fence) into v_bad_ids, v_bad_fences
      from unnest(p_ids, p_fences) as i(id, fence)
      left join fl.jobs j on j.id = i.id
     where not (i.id = any(v_ext))
       and not (j.id is not null and j.fence = i.fence and j.status <> 'running');
    if v_bad_ids is not null then
        perform fl._record_violations(p_worker, 'heartbeat', v_bad_ids, v_bad_fences, v_now);
        return query select b.id, b.fence, 'fenced'::text
                       from unnest(v_bad_ids, v_bad_fences) as b(id, fence);
    end if;
end;
$$;

-- ---------------------------------------------------------------------------------------
-- Complete (batched)
-- ---------------------------------------------------------------------------------------

-- Why `set enable_seqscan = off` on this and the other hot functions: fl.leases churns (a row
-- in and out per job), so between two vacuums its heap holds thousands of dead rows, while a
-- plan made when it looked like one page -- and cached, since these plans are generic --
-- keeps reading it sequentially. Measured with perf: a quarter of the backend's CPU went to
-- that scan. Every table access in these functions is by key, so an index is always there.
--
-- Completes every job in the list that is running at the given fence, in one statement:
-- status, ledger row (with the result), lease, one outbox row per queue. Returns one row per
-- input, in input order: ok, or fenced (a violation is recorded).
create function fl.complete(
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
        perform fl._notify_queues(v_queues);
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

-- ---------------------------------------------------------------------------------------
-- Failure (worker report and reaper) and the dead letter
-- ---------------------------------------------------------------------------------------

-- Ends attempts that failed. Internal: callers have checked input. Jobs are matched on id,
-- fence and status running, locked in id order. Per job, with its retry policy:
--   cancel requested           -> cancelled (fence + 1; not a breaker failure);
--   permanent, or a ceiling hit -> dead_letter with a dead_letters row holding the history;
--   otherwise                  -> retry_wait, run_at = now + backoff(charged attempts).
-- p_bump raises the fence (the reaper takes the job from its holder). Returns the jobs it
-- changed; inputs it did not match are the caller's to call fenced.
create function fl._fail_running(
    p_ids       bigint[],
    p_fences    bigint[],
    p_kinds     text[],
    p_classes   text[],
    p_messages  text[],
    p_bump      boolean,
    p_now       timestamptz)
returns table (job_id bigint, fence bigint, status fl.job_status, run_at timestamptz,
               reason text)
language plpgsql as $$
#variable_conflict use_column
declare
    v_locked bigint[];
    v_ids bigint[];
    v_old_fences bigint[];
    v_fences bigint[];
    v_statuses fl.job_status[];
    v_run_ats timestamptz[];
    v_reasons text[];
    v_queues uuid[];
begin
    v_locked := array(
        select j.id from fl.jobs j
          join unnest(p_ids, p_fences) as i(id, fence) on i.id = j.id
         where j.fence = i.fence and j.status = 'running'
         order by j.id
           for update of j);
    if cardinality(v_locked) = 0 then
        return;
    end if;

    with d as (
        select j.id, j.fence as old_fence, i.kind, i.cls, i.msg, j.attempts,
               j.cancel_requested_at is not null as cancel,
               j.lost_count + (i.kind = 'lost')::integer as lost_new,
               j.timeout_count + (i.kind = 'timeout')::integer as timeouts_new,
               case when j.cancel_requested_at is null then
                   fl._death_reason(i.kind, j.attempts, j.lost_count + (i.kind = 'lost')::integer,
                                    j.timeout_count + (i.kind = 'timeout')::integer,
                                    p.max_attempts, p.max_lost, p.max_timeouts)
               end as reason,
               p.kind as backoff_kind, p.base_delay_ms, p.max_delay_ms, p.jitter
          from fl.jobs j
          join unnest(p_ids, p_fences, p_kinds, p_classes, p_messages)
               as i(id, fence, kind, cls, msg) on i.id = j.id
          join fl.retry_policies p on p.id = j.retry_policy_id
         where j.id = any(v_locked)
    ), upd as (
        update fl.jobs j
           set status = (case when d.cancel then 'cancelled'
                              when d.reason is not null then 'dead_letter'
                              else 'retry_wait' end)::fl.job_status,
               fence = j.fence + case when p_bump or d.cancel then 1 else 0 end,
               lost_count = case when d.cancel then j.lost_count else d.lost_new end,
               timeout_count = case when d.cancel then j.timeout_count else d.timeouts_new end,
               -- A lost attempt (the worker died or went silent) is due again at once: the
               -- lease it outlived was its backoff, and recovery stays within lease + one
               -- reaper pass (bench: recovery). max_lost still bounds a job that kills workers.
               run_at = case when not d.cancel and d.reason is null and d.kind = 'lost'
                             then p_now
                             when not d.cancel and d.reason is null
                             then p_now + fl.backoff(d.backoff_kind, d.base_delay_ms,
                                                     d.max_delay_ms, d.jitter, d.attempts)
                             else j.run_at end,
               finished_at = case when d.cancel or d.reason is not null then p_now end,
               deadline_at = null,
               cancel_requested_at = null
          from d
         where j.id = d.id
        returning j.id, d.old_fence, j.fence, j.status, j.run_at, j.queue_id, j.project_id,
                  d.reason, d.kind, d.cls, d.msg, d.cancel
    ), att as (
        update fl.attempts a
           set finished_at = p_now,
               outcome = (case when upd.cancel then 'cancelled'
                               when upd.kind = 'retryable' then 'retryable_error'
                               when upd.kind = 'permanent' then 'permanent_error'
                               when upd.kind = 'timeout' then 'timeout'
                               else 'lost' end)::fl.attempt_outcome,
               error_class = upd.cls,
               error_message = upd.msg
          from upd
         where a.job_id = upd.id and a.fence = upd.old_fence and a.finished_at is null
    ), ls as (
        delete from fl.leases l using upd where l.queue_id = upd.queue_id and l.job_id = upd.id
    ), ev as (
        insert into fl.events (project_id, queue_id, job_id, topic, payload, created_at)
        select upd.project_id, upd.queue_id, upd.id,
               case upd.status when 'retry_wait' then 'job.retrying'
                               when 'dead_letter' then 'job.dead_lettered'
                               else 'job.cancelled' end,
               jsonb_strip_nulls(jsonb_build_object(
                   'kind', upd.kind, 'fence', upd.fence, 'run_at', upd.run_at,
                   'reason', upd.reason, 'error_class', upd.cls,
                   'from', case when upd.cancel then 'running' end)),
               p_now
          from upd
    )
    select array_agg(upd.id order by upd.id), array_agg(upd.old_fence order by upd.id),
           array_agg(upd.fence order by upd.id), array_agg(upd.status order by upd.id),
           array_agg(upd.run_at order by upd.id), array_agg(upd.reason order by upd.id),
           array_agg(upd.queue_id order by upd.id)
      into v_ids, v_old_fences, v_fences, v_statuses, v_run_ats, v_reasons, v_queues
      from upd;

    -- The dead letter, with the whole history; the ledger rows closed above are visible now.
    insert into fl.dead_letters (job_id, replay_generation, project_id, queue_id, reason,
                                 error_class, error_message, attempt_history, dead_at)
    select j.id, j.replay_generation, j.project_id, j.queue_id, x.reason,
           a_last.error_class, a_last.error_message,
           (select coalesce(jsonb_agg(jsonb_build_object(
                        'fence', a.fence, 'generation', a.replay_generation,
                        'attempt', a.attempt, 'worker', a.worker_id,
                        'started_at', a.started_at, 'finished_at', a.finished_at,
                        'outcome', a.outcome, 'error_class', a.error_class,
                        'error_message', a.error_message) order by a.fence), '[]')
              from fl.attempts a where a.job_id = j.id),
           p_now
      from unnest(v_ids, v_old_fences, v_statuses, v_reasons) as x(id, old_fence, status, reason)
      join fl.jobs j on j.id = x.id
      left join fl.attempts a_last on a_last.job_id = x.id and a_last.fence = x.old_fence
     where x.status = 'dead_letter';

    -- Breaker: real failures count; a cancelled probe just frees the probe slot.
    perform fl._breaker_failures(
        array(select q from unnest(v_queues, v_statuses) as x(q, st) where st <> 'cancelled'),
        array(select id from unnest(v_ids, v_statuses) as x(id, st) where st <> 'cancelled'),
        array(select f from unnest(v_old_fences, v_statuses) as x(f, st) where st <> 'cancelled'),
        p_now);
    perform fl._breaker_free_probe(
        array(select q from unnest(v_queues, v_statuses) as x(q, st) where st = 'cancelled'),
        array(select id from unnest(v_ids, v_statuses) as x(id, st) where st = 'cancelled'),
        array(select f from unnest(v_old_fences, v_statuses) as x(f, st) where st = 'cancelled'));
    perform fl._notify_queues(v_queues);

    return query select * from unnest(v_ids, v_fences, v_statuses, v_run_ats, v_reasons);
end;
$$;

create function fl._fail_outcome(p_status fl.job_status, p_reason text) returns text
language sql immutable as $$
    select case
        when p_status = 'retry_wait' then 'retry'
        when p_status = 'cancelled' then 'cancelled'
        when p_reason = 'permanent_error' then 'dead'
        else 'exhausted'
    end
$$;

-- A worker reports a failed attempt. p_kind: retryable | permanent | timeout | lost.
-- Outcomes: retry (retry_wait, run_at = when), exhausted (a ceiling was hit: dead letter),
-- dead (permanent: dead letter), cancelled (fl.cancel had asked it to stop), fenced.
create function fl.fail(
    p_worker         uuid,
    p_job            bigint,
    p_fence          bigint,
    p_kind           text,
    p_error_message  text default null,
    p_error_class    text default null)
returns table (outcome text, status fl.job_status, run_at timestamptz, reason text)
language plpgsql
set enable_seqscan = off
as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    r record;
begin
    if p_kind is null or p_kind not in ('retryable', 'permanent', 'timeout', 'lost') then
        perform fl._bad_input('FL004', format('unknown failure kind %s (retryable, permanent, timeout, lost)',
                                              coalesce(p_kind, 'null')));
    end if;
    if p_job is null or p_fence is null then
        perform fl._bad_input('FL005', 'job and fence must not be null');
    end if;
    select * into r
      from fl._fail_running(array[p_job], array[p_fence], array[p_kind],
                            array[left(p_error_class, 200)], array[left(p_error_message, 65536)],
                            false, v_now);
    if r.job_id is null then
        perform fl._record_violations(p_worker, 'fail', array[p_job], array[p_fence], v_now);
        return query select 'fenced'::text, null::fl.job_status, null::timestamptz, null::text;
        return;
    end if;
    return query select fl._fail_outcome(r.status, r.reason), r.status, r.run_at, r.reason;
end;
$$;

-- ---------------------------------------------------------------------------------------
-- Snooze and release: the job goes back without using an attempt
-- ---------------------------------------------------------------------------------------

-- The handler asks to run again in p_seconds: running -> scheduled, fence + 1, the attempt
-- given back, snooze_count + 1. Outcomes: ok; exhausted (max_snoozes reached: dead letter,
-- reason snoozes_exhausted, instead of the reference's silent fence, W9); cancelled; fenced.
create function fl.snooze(
    p_worker   uuid,
    p_job      bigint,
    p_fence    bigint,
    p_seconds  double precision)
returns table (outcome text, status fl.job_status, run_at timestamptz)
language plpgsql
set enable_seqscan = off
as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    r record;
    v_run_at timestamptz;
begin
    if p_seconds is null or p_seconds < 0 or p_seconds = 'NaN'::float8 or p_seconds > 315360000 then
        perform fl._bad_input('FL003', format('snooze must be between 0 and 315360000 s, got %s',
                                              coalesce(p_seconds::text, 'null')));
    end if;
    if p_job is null or p_fence is null then
        perform fl._bad_input('FL005', 'job and fence must not be null');
    end if;

    select j.id, j.queue_id, j.project_id, j.snooze_count, j.cancel_requested_at,
           j.replay_generation, p.max_snoozes
      into r
      from fl.jobs j join fl.retry_policies p on p.id = j.retry_policy_id
     where j.id = p_job and j.fence = p_fence and j.status = 'running'
       for update of j;
    if not found then
        perform fl._record_violations(p_worker, 'snooze', array[p_job], array[p_fence], v_now);
        return query select 'fenced'::text, null::fl.job_status, null::timestamptz;
        return;
    end if;

    if r.cancel_requested_at is not null then
        return query select 'cancelled'::text, f.status, f.run_at
                       from fl._fail_running(array[p_job], array[p_fence], array['retryable'],
                                             array[null::text], array[null::text], false, v_now) f;
        return;
    end if;

    if r.snooze_count >= r.max_snoozes then
        update fl.jobs
           set status = 'dead_letter', finished_at = v_now, deadline_at = null
         where id = p_job;
        update fl.attempts
           set finished_at = v_now, outcome = 'snoozed'
         where job_id = p_job and fence = p_fence;
        delete from fl.leases where queue_id = r.queue_id and job_id = p_job;
        insert into fl.dead_letters (job_id, replay_generation, project_id, queue_id, reason,
                                     attempt_history, dead_at)
        select p_job, r.replay_generation, r.project_id, r.queue_id, 'snoozes_exhausted',
               (select coalesce(jsonb_agg(jsonb_build_object(
                            'fence', a.fence, 'generation', a.replay_generation,
                            'attempt', a.attempt, 'worker', a.worker_id,
                            'started_at', a.started_at, 'finished_at', a.finished_at,
                            'outcome', a.outcome, 'error_class', a.error_class,
                            'error_message', a.error_message) order by a.fence), '[]')
                  from fl.attempts a where a.job_id = p_job),
               v_now;
        perform fl._breaker_free_probe(array[r.queue_id], array[p_job], array[p_fence]);
        insert into fl.events (project_id, queue_id, job_id, topic, payload, created_at)
        values (r.project_id, r.queue_id, p_job, 'job.dead_lettered',
                jsonb_build_object('reason', 'snoozes_exhausted', 'fence', p_fence), v_now);
        perform pg_notify('fl_queue', r.queue_id::text);
        return query select 'exhausted'::text, 'dead_letter'::fl.job_status, null::timestamptz;
        return;
    end if;

    v_run_at := v_now + make_interval(secs => p_seconds);
    update fl.jobs
       set status = 'scheduled', fence = fence + 1, attempts = attempts - 1,
           snooze_count = snooze_count + 1, run_at = v_run_at, deadline_at = null
     where id = p_job;
    update fl.attempts
       set finished_at = v_now, outcome = 'snoozed'
     where job_id = p_job and fence = p_fence;
    delete from fl.leases where queue_id = r.queue_id and job_id = p_job;
    perform fl._breaker_free_probe(array[r.queue_id], array[p_job], array[p_fence]);
    insert into fl.events (project_id, queue_id, job_id, topic, payload, created_at)
    values (r.project_id, r.queue_id, p_job, 'job.snoozed',
            jsonb_build_object('run_at', v_run_at, 'fence', p_fence + 1), v_now);
    perform pg_notify('fl_queue', r.queue_id::text);
    return query select 'ok'::text, 'scheduled'::fl.job_status, v_run_at;
end;
$$;

-- Graceful drain: jobs a worker holds but will not finish go back to queued at once, in
-- their old place (priority, run_at), fence + 1, attempt given back. Outcomes per input, in
-- input order: ok, cancelled (fl.cancel had asked: the job is cancelled now), fenced.
create function fl.release(
    p_worker  uuid,
    p_ids     bigint[],
    p_fences  bigint[])
returns table (job_id bigint, fence bigint, outcome text)
language plpgsql
set enable_seqscan = off
as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    n integer;
    v_locked bigint[];
    v_cancel bigint[];
    v_cancel_fences bigint[];
    v_ids bigint[];
    v_fences bigint[];
    v_queues uuid[];
    v_bad_ids bigint[];
    v_bad_fences bigint[];
begin
    n := fl._check_id_arrays(p_ids, p_fences);
    if n = 0 then
        return;
    end if;
    select array_agg(x.id), array_agg(x.fence) filter (where x.cancel),
           array_agg(x.id) filter (where x.cancel)
      into v_locked, v_cancel_fences, v_cancel
      from (select j.id, j.fence, j.cancel_requested_at is not null as cancel
              from fl.jobs j join unnest(p_ids, p_fences) as i(id, fence) on i.id = j.id
             where j.fence = i.fence and j.status = 'running'
             order by j.id
               for update of j) x;

    if v_cancel is not null then
        perform fl._fail_running(v_cancel, v_cancel_fences,
                                 array_fill('retryable'::text, array[cardinality(v_cancel)]),
                                 array_fill(null::text, array[cardinality(v_cancel)]),
                                 array_fill(null::text, array[cardinality(v_cancel)]),
                                 false, v_now);
    end if;

    with rel as (
        update fl.jobs j
           set status = 'queued', fence = j.fence + 1, attempts = j.attempts - 1,
               deadline_at = null
         where j.id = any(v_locked) and j.status = 'running'
           and not (j.id = any(coalesce(v_cancel, '{}')))
        returning j.id, j.fence - 1 as old_fence, j.queue_id, j.project_id
    ), att as (
        update fl.attempts a
           set finished_at = v_now, outcome = 'released'
          from rel
         where a.job_id = rel.id and a.fence = rel.old_fence
    ), ls as (
        delete from fl.leases l using rel where l.queue_id = rel.queue_id and l.job_id = rel.id
    ), ev as (
        insert into fl.events (project_id, queue_id, topic, payload, created_at)
        select rel.project_id, rel.queue_id, 'jobs.released',
               jsonb_build_object('worker', p_worker,
                                  'jobs', jsonb_agg(jsonb_build_array(rel.id, rel.old_fence + 1)
                                                    order by rel.id)),
               v_now
          from rel
         group by rel.project_id, rel.queue_id
    )
    select array_agg(rel.id), array_agg(rel.old_fence), array_agg(rel.queue_id)
      into v_ids, v_fences, v_queues
      from rel;

    if v_ids is not null then
        perform fl._breaker_free_probe(v_queues, v_ids, v_fences);
        perform fl._notify_queues(v_queues);
    end if;

    select array_agg(i.id), array_agg(i.fence) into v_bad_ids, v_bad_fences
      from unnest(p_ids, p_fences) as i(id, fence)
     where v_locked is null or not (i.id = any(v_locked));
    if v_bad_ids is not null then
        perform fl._record_violations(p_worker, 'release', v_bad_ids, v_bad_fences, v_now);
    end if;

    return query
    select i.id, i.fence,
           case when v_cancel is not null and i.id = any(v_cancel) then 'cancelled'
                when v_ids is not null and i.id = any(v_ids) then 'ok'
                else 'fenced' end
      from unnest(p_ids, p_fences) with ordinality as i(id, fence, ord)
     order by i.ord;
end;
$$;

-- ---------------------------------------------------------------------------------------
-- Cancel, retry, replay (API side)
-- ---------------------------------------------------------------------------------------

-- Waiting jobs (scheduled, queued, retry_wait) are cancelled at once (fence + 1). A running
-- job is asked to stop: cancel_requested_at is set, pg_notify('fl_cancel', job id) tells its
-- worker now and its next heartbeat says so too; the job keeps its lease, and so its slot
-- under the cap, until the worker reports (the report ends it as cancelled) or the lease
-- lapses and the reaper cancels it (reference W13: the slot was freed while the handler ran).
-- Outcomes: ok, cancel_requested, conflict (already terminal), not_found.
create function fl.cancel(p_job bigint)
returns table (outcome text, status fl.job_status)
language plpgsql as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    r record;
begin
    if p_job is null then
        perform fl._bad_input('FL005', 'job must not be null');
    end if;
    select j.status, j.queue_id, j.project_id, j.cancel_requested_at, j.fence
      into r from fl.jobs j where j.id = p_job for update;
    if not found then
        return query select 'not_found'::text, null::fl.job_status;
        return;
    end if;
    if r.status in ('completed', 'dead_letter', 'cancelled') then
        return query select 'conflict'::text, r.status;
        return;
    end if;
    if r.status = 'running' then
        if r.cancel_requested_at is null then
            update fl.jobs set cancel_requested_at = v_now where id = p_job;
            insert into fl.events (project_id, queue_id, job_id, topic, payload, created_at)
            values (r.project_id, r.queue_id, p_job, 'job.cancel_requested',
                    jsonb_build_object('fence', r.fence), v_now);
            perform pg_notify('fl_cancel', p_job::text);
            perform pg_notify('fl_queue', r.queue_id::text);
        end if;
        return query select 'cancel_requested'::text, r.status;
        return;
    end if;
    update fl.jobs
       set status = 'cancelled', fence = fence + 1, finished_at = v_now, pending_deps = 0
     where id = p_job;
    insert into fl.events (project_id, queue_id, job_id, topic, payload, created_at)
    values (r.project_id, r.queue_id, p_job, 'job.cancelled',
            jsonb_build_object('from', r.status), v_now);
    perform pg_notify('fl_queue', r.queue_id::text);
    return query select 'ok'::text, 'cancelled'::fl.job_status;
end;
$$;

-- Run a waiting job now: retry_wait, or scheduled with no unfinished parents -> queued,
-- run_at = now. Outcomes: ok, dead (it is in the dead letter: use fl.replay), conflict,
-- not_found.
create function fl.retry(p_job bigint)
returns table (outcome text, status fl.job_status)
language plpgsql as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    r record;
begin
    if p_job is null then
        perform fl._bad_input('FL005', 'job must not be null');
    end if;
    select j.status, j.queue_id, j.project_id, j.pending_deps
      into r from fl.jobs j where j.id = p_job for update;
    if not found then
        return query select 'not_found'::text, null::fl.job_status;
        return;
    end if;
    if r.status = 'dead_letter' then
        return query select 'dead'::text, r.status;
        return;
    end if;
    if not (r.status = 'retry_wait' or (r.status = 'scheduled' and r.pending_deps = 0)) then
        return query select 'conflict'::text, r.status;
        return;
    end if;
    update fl.jobs set status = 'queued', run_at = v_now where id = p_job;
    insert into fl.events (project_id, queue_id, job_id, topic, payload, created_at)
    values (r.project_id, r.queue_id, p_job, 'job.retried', jsonb_build_object('from', r.status),
            v_now);
    perform pg_notify('fl_queue', r.queue_id::text);
    return query select 'ok'::text, 'queued'::fl.job_status;
end;
$$;

-- Shared by single and bulk replay: dead_letter -> queued with fresh counters, a new replay
-- generation and fence + 1. The ledger and the old dead_letters row stay (history); the row
-- is marked replayed.
create function fl._replay_jobs(p_ids bigint[], p_now timestamptz, p_topic text)
returns table (job_id bigint, queue_id uuid)
language plpgsql as $$
#variable_conflict use_column
begin
    return query
    with rep as (
        update fl.jobs j
           set status = 'queued', fence = j.fence + 1, attempts = 0, lost_count = 0,
               timeout_count = 0, snooze_count = 0, replay_generation = j.replay_generation + 1,
               run_at = p_now, finished_at = null
         where j.id = any(p_ids) and j.status = 'dead_letter'
        returning j.id, j.queue_id, j.project_id, j.replay_generation, j.fence
    ), dl as (
        update fl.dead_letters d
           set replayed_at = p_now
          from rep
         where d.job_id = rep.id and d.replay_generation = rep.replay_generation - 1
           and d.replayed_at is null
    ), ev_one as (
        insert into fl.events (project_id, queue_id, job_id, topic, payload, created_at)
        select rep.project_id, rep.queue_id, rep.id, p_topic,
               jsonb_build_object('generation', rep.replay_generation, 'fence', rep.fence), p_now
          from rep
         where p_topic = 'job.replayed'
    ), ev_bulk as (
        insert into fl.events (project_id, queue_id, topic, payload, created_at)
        select rep.project_id, rep.queue_id, p_topic,
               jsonb_build_object('jobs', jsonb_agg(jsonb_build_array(rep.id, rep.fence)
                                                    order by rep.id)),
               p_now
          from rep
         where p_topic <> 'job.replayed'
         group by rep.project_id, rep.queue_id
    )
    select rep.id, rep.queue_id from rep;
end;
$$;

-- Replay one dead job. Outcomes: ok, queue_full (depth cap), conflict (not dead), not_found.
create function fl.replay(p_job bigint)
returns table (outcome text, status fl.job_status)
language plpgsql as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    r record;
begin
    if p_job is null then
        perform fl._bad_input('FL005', 'job must not be null');
    end if;
    select j.status, j.queue_id, q.max_depth
      into r from fl.jobs j join fl.queues q on q.id = j.queue_id
     where j.id = p_job for update of j;
    if not found then
        return query select 'not_found'::text, null::fl.job_status;
        return;
    end if;
    if r.status <> 'dead_letter' then
        return query select 'conflict'::text, r.status;
        return;
    end if;
    if r.max_depth is not null and fl._queue_depth(r.queue_id, r.max_depth) >= r.max_depth then
        return query select 'queue_full'::text, r.status;
        return;
    end if;
    perform fl._replay_jobs(array[p_job], v_now, 'job.replayed');
    perform pg_notify('fl_queue', r.queue_id::text);
    return query select 'ok'::text, 'queued'::fl.job_status;
end;
$$;

-- Replay up to p_limit dead jobs of a queue that are still dead, oldest death first, within
-- the room the depth cap leaves. Pacing them is the queue's rate limit's job. Returns one row
-- per replayed job (outcome ok), or one row (NULL, queue_full) when the cap leaves no room.
create function fl.replay_dead(p_queue uuid, p_limit integer default 100)
returns table (job_id bigint, outcome text)
language plpgsql as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    v_room integer := p_limit;
    v_max_depth integer;
    v_ids bigint[];
begin
    if p_limit is null or p_limit not between 1 and 1000 then
        perform fl._bad_input('FL005', 'limit must be between 1 and 1000');
    end if;
    select q.max_depth into v_max_depth from fl.queues q where q.id = p_queue;
    if not found then
        perform fl._bad_input('FL001', format('queue %s does not exist', coalesce(p_queue::text, 'null')));
    end if;
    if v_max_depth is not null then
        v_room := least(v_room, v_max_depth - fl._queue_depth(p_queue, v_max_depth));
        if v_room <= 0 then
            return query select null::bigint, 'queue_full'::text;
            return;
        end if;
    end if;
    v_ids := array(
        select j.id
          from fl.dead_letters d
          join fl.jobs j on j.id = d.job_id and j.replay_generation = d.replay_generation
         where d.queue_id = p_queue and d.replayed_at is null and j.status = 'dead_letter'
         order by d.dead_at, d.id
         limit v_room
           for update of j skip locked);
    if cardinality(v_ids) = 0 then
        return;
    end if;
    perform fl._replay_jobs(v_ids, v_now, 'jobs.replayed');
    perform pg_notify('fl_queue', p_queue::text);
    return query select x, 'ok'::text from unnest(v_ids) x;
end;
$$;

-- ---------------------------------------------------------------------------------------
-- Sweeps: reaper, breaker, orphans, worker liveness
-- ---------------------------------------------------------------------------------------

-- The reaper (reference W1 fixed). Set-based and race-free:
--   1. read up to p_limit expired leases, oldest first (per queue, on the leases key);
--   2. lock the jobs that are still running at the fence the lease carries, SKIP LOCKED (a
--      job being reported or claimed right now is not the reaper's to judge);
--   3. delete those leases re-checking expires_at < now on the row itself: a lease extended
--      since step 1 is kept (the delete waits for the extension and re-reads the row);
--   4. fail exactly those (job, fence) pairs, fence + 1: 'timeout' if the job's deadline has
--      passed, else 'lost' (either uses the attempt it was charged at claim, so a job lost
--      before its handler ran still counts, and a poison job dies at its ceiling).
-- Expired leases whose job is not running at their fence are deleted as 'orphan'.
-- Outcomes per job: retry, exhausted, cancelled (a cancel was pending), orphan.
create function fl.reap(p_limit integer default 100)
returns table (job_id bigint, fence bigint, outcome text)
language plpgsql
set enable_seqscan = off
as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    v_cqueues uuid[];
    v_cids bigint[];
    v_cfences bigint[];
    v_queues uuid[];
    v_ids bigint[];
    v_fences bigint[];
    v_kinds text[];
    v_rids bigint[];
    v_rfences bigint[];
    v_rkinds text[];
begin
    if p_limit is null or p_limit not between 1 and 10000 then
        perform fl._bad_input('FL005', 'limit must be between 1 and 10000');
    end if;
    if not pg_try_advisory_xact_lock(26220, 10) then
        return;
    end if;

    select array_agg(c.queue_id), array_agg(c.job_id), array_agg(c.fence)
      into v_cqueues, v_cids, v_cfences
      from (select l.queue_id, l.job_id, l.fence
              from fl.queues q
             cross join lateral (
                   select l.queue_id, l.job_id, l.fence, l.expires_at from fl.leases l
                    where l.queue_id = q.id and l.expires_at < v_now
                    order by l.expires_at
                    limit p_limit) l
             order by l.expires_at
             limit p_limit) c;
    if v_cids is null then
        return;
    end if;

    select array_agg(x.queue_id), array_agg(x.id), array_agg(x.fence), array_agg(x.kind)
      into v_queues, v_ids, v_fences, v_kinds
      from (select j.queue_id, j.id, j.fence,
                   case when j.deadline_at <= v_now then 'timeout' else 'lost' end as kind
              from fl.jobs j join unnest(v_cids, v_cfences) as c(id, fence) on c.id = j.id
             where j.fence = c.fence and j.status = 'running'
             order by j.id
               for update of j skip locked) x;

    if v_ids is not null then
        with gone as (
            delete from fl.leases l
             using unnest(v_queues, v_ids, v_fences, v_kinds) as k(queue_id, id, fence, kind)
             where l.queue_id = k.queue_id and l.job_id = k.id and l.fence = k.fence
               and l.expires_at < v_now
            returning l.job_id, l.fence, k.kind
        )
        select array_agg(gone.job_id), array_agg(gone.fence), array_agg(gone.kind)
          into v_rids, v_rfences, v_rkinds
          from gone;
    end if;

    if v_rids is not null then
        return query
        select f.job_id, f.fence, fl._fail_outcome(f.status, f.reason)
          from fl._fail_running(v_rids, v_rfences, v_rkinds,
                                array_fill('lease_expired'::text, array[cardinality(v_rids)]),
                                array_fill(null::text, array[cardinality(v_rids)]),
                                true, v_now) f;
    end if;

    return query
    with orphan as (
        delete from fl.leases l
         using unnest(v_cqueues, v_cids, v_cfences) as c(queue_id, id, fence)
         where l.queue_id = c.queue_id and l.job_id = c.id and l.fence = c.fence
           and l.expires_at < v_now
           and not exists (select 1 from fl.jobs j
                            where j.id = l.job_id and j.fence = l.fence and j.status = 'running')
        returning l.job_id, l.fence
    )
    select orphan.job_id, orphan.fence, 'orphan'::text from orphan;
end;
$$;

-- Breaker sweep. The probe slot is settled by every report (complete closes, fail and reap
-- reopen, snooze, release and cancel free it), so this is the safety net: it frees a probe
-- whose job is no longer running at the probe's fence, and closes the breaker of a queue
-- whose breaker was switched off. Returns the number of queues changed.
create function fl.breaker_sweep() returns integer
language plpgsql as $$
declare
    v_now timestamptz := fl.now();
    v_freed integer;
    v_closed integer;
begin
    if not pg_try_advisory_xact_lock(26220, 13) then
        return 0;
    end if;
    update fl.queue_state s
       set probe_job_id = null, probe_fence = null
     where s.probe_job_id is not null
       and not exists (select 1 from fl.jobs j
                        where j.id = s.probe_job_id and j.fence = s.probe_fence
                          and j.status = 'running');
    get diagnostics v_freed = row_count;
    with closed as (
        update fl.queue_state s
           set breaker_state = 'closed', breaker_changed_at = v_now, breaker_open_until = null,
               probe_job_id = null, probe_fence = null, win_started_at = null,
               win_failures = 0, win_successes = 0
          from fl.queues q
         where q.id = s.queue_id and not q.breaker_enabled and s.breaker_state <> 'closed'
        returning s.queue_id, q.project_id
    ), ev as (
        insert into fl.events (project_id, queue_id, topic, created_at)
        select closed.project_id, closed.queue_id, 'queue.breaker_closed', v_now from closed
    )
    select count(*), fl._notify_queues(array_agg(closed.queue_id)) is null
      into v_closed from closed;
    return v_freed + v_closed;
end;
$$;

-- Leases whose job is not running at their fence. No fl.* function leaves one behind (each
-- state change deletes the lease in the same statement); this repairs hand edits. Their open
-- ledger rows are closed as lost. Returns the number of leases removed.
create function fl.sweep_orphans(p_limit integer default 1000) returns integer
language plpgsql as $$
declare
    v_now timestamptz := fl.now();
    v_n integer;
begin
    if p_limit is null or p_limit not between 1 and 100000 then
        perform fl._bad_input('FL005', 'limit must be between 1 and 100000');
    end if;
    if not pg_try_advisory_xact_lock(26220, 20) then
        return 0;
    end if;
    with orphan as (
        delete from fl.leases l
         where (l.queue_id, l.job_id) in (
                   select l2.queue_id, l2.job_id from fl.leases l2
                    where not exists (select 1 from fl.jobs j
                                       where j.id = l2.job_id and j.fence = l2.fence
                                         and j.status = 'running')
                    limit p_limit
                      for update skip locked)
           and not exists (select 1 from fl.jobs j
                            where j.id = l.job_id and j.fence = l.fence and j.status = 'running')
        returning l.job_id, l.fence
    ), att as (
        update fl.attempts a
           set finished_at = v_now, outcome = 'lost', error_class = 'orphan_lease'
          from orphan
         where a.job_id = orphan.job_id and a.fence = orphan.fence and a.finished_at is null
    )
    select count(*) into v_n from orphan;
    return v_n;
end;
$$;

-- ---------------------------------------------------------------------------------------
-- Workers
-- ---------------------------------------------------------------------------------------

-- Register a worker for its queues, with the job types it handles (NULL = any). Raises FL001
-- if any queue does not exist (a worker started for a queue that does not exist).
create function fl.register_worker(
    p_queues       uuid[],
    p_handlers     text[],
    p_hostname     text,
    p_pid          integer,
    p_concurrency  integer,
    p_meta         jsonb default null)
returns uuid
language plpgsql as $$
declare
    v_now timestamptz := fl.now();
    v_id uuid;
    v_missing uuid;
begin
    if p_queues is null or cardinality(p_queues) = 0 or array_position(p_queues, null) is not null then
        perform fl._bad_input('FL005', 'queues must be a non-empty list without nulls');
    end if;
    select x into v_missing from unnest(p_queues) x
     where not exists (select 1 from fl.queues q where q.id = x) limit 1;
    if found then
        perform fl._bad_input('FL001', format('queue %s does not exist', v_missing));
    end if;
    if p_handlers is not null and (cardinality(p_handlers) = 0
                                   or array_position(p_handlers, null) is not null
                                   or exists (select 1 from unnest(p_handlers) h
                                               where length(h) not between 1 and 200)) then
        perform fl._bad_input('FL005', 'handlers must be NULL (any) or a non-empty list of 1-200 character types');
    end if;
    if p_hostname is null or length(p_hostname) not between 1 and 255 then
        perform fl._bad_input('FL005', 'hostname must be 1 to 255 characters');
    end if;
    if p_pid is null or p_pid <= 0 then
        perform fl._bad_input('FL005', 'pid must be positive');
    end if;
    if p_concurrency is null or p_concurrency not between 1 and 100000 then
        perform fl._bad_input('FL005', 'concurrency must be between 1 and 100000');
    end if;
    insert into fl.workers (hostname, pid, handlers, concurrency, started_at, last_seen_at, meta)
    values (p_hostname, p_pid, (select array_agg(distinct h order by h) from unnest(p_handlers) h),
            p_concurrency, v_now, v_now, p_meta)
    returning id into v_id;
    insert into fl.worker_queues (worker_id, queue_id)
    select v_id, q from (select distinct unnest(p_queues) as q) s;
    return v_id;
end;
$$;

-- Liveness and state: active (claims), draining (no claims; reports and heartbeats go on),
-- stopped. A worker marked dead by fl.mark_dead_workers that is heard from again is active.
-- Outcomes: ok. Unknown worker: FL006; unknown state: FL005.
create function fl.worker_heartbeat(p_worker uuid, p_state text default null)
returns text
language plpgsql as $$
declare
    v_now timestamptz := fl.now();
begin
    if p_state is not null and p_state not in ('active', 'draining', 'stopped') then
        perform fl._bad_input('FL005', format('unknown worker state %s (active, draining, stopped)', p_state));
    end if;
    update fl.workers w
       set last_seen_at = v_now,
           state = coalesce(p_state, case when w.state = 'dead' then 'active' else w.state end)
     where w.id = p_worker;
    if not found then
        perform fl._bad_input('FL006', format('worker %s is not registered',
                                              coalesce(p_worker::text, 'null')));
    end if;
    return 'ok';
end;
$$;

-- Workers not heard from for p_silent_for are marked dead (their leases lapse on their own
-- and the reaper recovers the jobs). Returns how many were marked.
create function fl.mark_dead_workers(p_silent_for interval default interval '60 seconds')
returns integer
language plpgsql as $$
declare
    v_n integer;
begin
    if p_silent_for is null or p_silent_for <= interval '0' then
        perform fl._bad_input('FL005', 'silent_for must be positive');
    end if;
    if not pg_try_advisory_xact_lock(26220, 21) then
        return 0;
    end if;
    update fl.workers
       set state = 'dead'
     where state in ('active', 'draining') and last_seen_at < fl.now() - p_silent_for;
    get diagnostics v_n = row_count;
    return v_n;
end;
$$;

-- Log lines of one attempt, written by the worker that ran it (any time, also after its
-- report). Outcomes: ok, not_found (no such attempt of this worker). Bad level: FL005.
create function fl.append_logs(
    p_worker    uuid,
    p_job       bigint,
    p_fence     bigint,
    p_levels    text[],
    p_messages  text[],
    p_times     timestamptz[] default null)
returns text
language plpgsql as $$
declare
    v_now timestamptz := fl.now();
    n integer := coalesce(cardinality(p_messages), -1);
begin
    if p_levels is null or p_messages is null or cardinality(p_levels) <> n
       or (p_times is not null and cardinality(p_times) <> n) then
        perform fl._bad_input('FL005', 'levels, messages (and times) must be lists of one length');
    end if;
    if n > 1000 then
        perform fl._bad_input('FL005', 'at most 1000 log lines per call');
    end if;
    if exists (select 1 from unnest(p_levels, p_messages) as x(lv, msg)
                where lv is null or lv not in ('debug', 'info', 'warn', 'error') or msg is null) then
        perform fl._bad_input('FL005', 'log level must be debug, info, warn or error, and messages not null');
    end if;
    if not exists (select 1 from fl.attempts a
                    where a.job_id = p_job and a.fence = p_fence and a.worker_id = p_worker) then
        return 'not_found';
    end if;
    insert into fl.attempt_logs (job_id, fence, ts, level, message)
    select p_job, p_fence, coalesce(t, v_now), lv, left(msg, 16384)
      from unnest(p_levels, p_messages, coalesce(p_times, array_fill(null::timestamptz, array[n])))
           as x(lv, msg, t);
    return 'ok';
end;
$$;

-- ---------------------------------------------------------------------------------------
-- Views
-- ---------------------------------------------------------------------------------------

-- Queued jobs per queue and type, and whether a live worker (seen in the last minute,
-- subscribed to the queue) handles the type. Jobs of a type nobody handles wait here,
-- visible as such, and do not slow claims of other types (the claim reads per type).
create view fl.queue_backlog as
select q.id as queue_id, t.type,
       (select count(*) from fl.jobs j
         where j.queue_id = q.id and j.status = 'queued' and j.type = t.type) as queued,
       (select min(j.run_at) from fl.jobs j
         where j.queue_id = q.id and j.status = 'queued' and j.type = t.type) as oldest_run_at,
       exists (select 1 from fl.worker_queues wq join fl.workers w on w.id = wq.worker_id
                where wq.queue_id = q.id and w.state in ('active', 'draining')
                  and w.last_seen_at > fl.now() - interval '60 seconds'
                  and (w.handlers is null or t.type = any(w.handlers))) as handled
  from fl.queues q
 cross join lateral unnest(fl.queued_types(q.id)) as t(type);

-- Jobs running per queue against the cap (count of leases, as the claim gate counts).
create view fl.queue_in_flight as
select q.id as queue_id, q.max_concurrency,
       (select count(*) from fl.leases l where l.queue_id = q.id) as in_flight
  from fl.queues q;
