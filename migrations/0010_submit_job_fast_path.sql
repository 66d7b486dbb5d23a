-- 0010: fl.submit_job without dependencies or an idempotency key takes a direct path.
--
-- fl.submit_job (0006) builds a JSON spec and hands it to fl._submit_jobs, the batch
-- implementation, which validates it field by field through jsonb and runs about fifteen
-- small queries per job (unnest, jsonb_array_elements, count(distinct) ...) before it inserts
-- anything. For the common single submission (no depends_on, no key) that cost about 440 us
-- of PostgreSQL CPU per call, against 130 us for 0004's lean fl.submit, and it was the largest
-- single cost of POST /queues/{id}/jobs (docs/DECISIONS.md A8).
--
-- The direct path below gives exactly what fl._submit_jobs gives one such job: the same
-- checks in the same order with the same SQLSTATEs and messages (queue FL001; type FL009;
-- payload null FL005; payload size FL002; timeout_ms, delay_ms FL005; run_at FL003; run_at with
-- delay_ms FL005; retry policy FL007), the same depth cap (queued + delayed jobs, any run_at)
-- and refusal row, the same job row, job.submitted event and fl_queue notification, and the
-- same answer. A submission with parents or an Idempotency-Key still goes through
-- fl._submit_jobs, unchanged.

create or replace function fl.submit_job(
    p_queue            uuid,
    p_type             text,
    p_payload          jsonb default '{}',
    p_priority         integer default null,
    p_run_at           timestamptz default null,
    p_delay_ms         bigint default null,
    p_timeout_ms       integer default null,
    p_retry_policy     uuid default null,
    p_depends_on       bigint[] default null,
    p_idempotency_key  text default null,
    p_fingerprint      bytea default null)
returns table (outcome text, job_id bigint, status fl.job_status, priority integer,
               run_at timestamptz, created_at timestamptz, detail text)
language plpgsql as $$
#variable_conflict use_column
declare
    v_now timestamptz;
    q record;
    v_policy uuid;
    v_run_at timestamptz;
    v_status fl.job_status;
    v_priority integer;
    v_id bigint;
begin
    if p_payload is null then
        perform fl._bad_input('FL005', 'payload must not be null (use {} for none)');
    end if;
    if p_depends_on is not null and array_position(p_depends_on, null) is not null then
        perform fl._bad_input('FL005', 'depends_on must not contain null');
    end if;

    if p_idempotency_key is not null or cardinality(p_depends_on) > 0 then
        return query
        select r.outcome, r.job_id, r.status, r.priority, r.run_at, r.created_at, r.detail
          from fl._submit_jobs(
                   p_queue,
                   jsonb_build_array(jsonb_strip_nulls(jsonb_build_object(
                       'type', to_jsonb(p_type), 'priority', p_priority,
                       'run_at', p_run_at, 'delay_ms', p_delay_ms, 'timeout_ms', p_timeout_ms,
                       'retry_policy_id', p_retry_policy, 'depends_on', to_jsonb(p_depends_on)))
                       || jsonb_build_object('payload', p_payload)),
                   false, p_idempotency_key, p_fingerprint) r;
        return;
    end if;

    -- The direct path: fl._submit_jobs's checks for one spec, in its order.
    v_now := fl.now();
    select qq.project_id, qq.retry_policy_id, qq.default_priority, qq.default_timeout_ms,
           qq.max_depth
      into q from fl.queues qq where qq.id = p_queue;
    if not found then
        perform fl._bad_input('FL001', format('queue %s does not exist', coalesce(p_queue::text, 'null')));
    end if;
    if p_type is null or length(p_type) not between 1 and 200 then
        perform fl._bad_input('FL009', 'type must be 1 to 200 characters');
    end if;
    if jsonb_typeof(p_payload) = 'null' then
        perform fl._bad_input('FL005', 'payload must not be null (use {} for none)');
    end if;
    if pg_column_size(p_payload) > 262144 then
        perform fl._bad_input('FL002', format('payload is %s bytes, the limit is 262144',
                                              pg_column_size(p_payload)));
    end if;
    if p_timeout_ms < 1 then
        perform fl._bad_input('FL005', 'timeout_ms must be an integer in range (1 to 2147483647)');
    end if;
    if p_delay_ms < 0 or p_delay_ms > 315360000000 then
        perform fl._bad_input('FL005', 'delay_ms must be an integer in range (0 to 315360000000)');
    end if;
    if not isfinite(p_run_at) then
        perform fl._bad_input('FL003', 'run_at must be a finite time');
    end if;
    if p_run_at is not null and p_delay_ms is not null then
        perform fl._bad_input('FL005', 'give run_at or delay_ms, not both');
    end if;
    v_policy := coalesce(p_retry_policy, q.retry_policy_id);
    if not exists (select 1 from fl.retry_policies rp
                    where rp.id = v_policy and rp.project_id = q.project_id) then
        perform fl._bad_input('FL007', format('retry policy %s does not exist in the queue''s project',
                                              v_policy));
    end if;

    if q.max_depth is not null and fl._queue_depth(p_queue, q.max_depth) + 1 > q.max_depth then
        return query select 'queue_full'::text, null::bigint, null::fl.job_status,
                            null::integer, null::timestamptz, null::timestamptz,
                            format('the queue holds its maximum of %s waiting jobs', q.max_depth);
        return;
    end if;

    v_run_at := coalesce(p_run_at,
                         v_now + make_interval(secs => coalesce(p_delay_ms::double precision / 1000.0, 0)));
    v_status := case when v_run_at > v_now then 'scheduled' else 'queued' end;
    v_priority := coalesce(p_priority, q.default_priority);

    insert into fl.jobs (project_id, queue_id, type, payload, status, priority, run_at,
                         timeout_ms, retry_policy_id, created_at, batch_id, pending_deps,
                         has_dependents)
    values (q.project_id, p_queue, p_type, p_payload, v_status, v_priority, v_run_at,
            coalesce(p_timeout_ms, q.default_timeout_ms), v_policy, v_now, null, 0, false)
    returning id into v_id;

    insert into fl.events (project_id, queue_id, job_id, topic, payload, created_at)
    values (q.project_id, p_queue, v_id, 'job.submitted',
            jsonb_build_object('type', p_type, 'status', v_status, 'run_at', v_run_at), v_now);
    perform pg_notify('fl_queue', p_queue::text);

    return query select 'ok'::text, v_id, v_status, v_priority, v_run_at, v_now, null::text;
end;
$$;
