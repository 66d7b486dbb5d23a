-- 0012: fl.submit (0004) becomes a thin front of fl.submit_job, so that one body holds the
-- checks and the insert of a plain submission.
--
-- Until now the schema had two bodies for the same work: 0004's fl.submit and 0010's direct
-- path of fl.submit_job, with the same checks, the same job row, event and notification, kept
-- equal by tests only. fl.submit keeps its signature, its answer and its SQLSTATEs: its delay
-- is in seconds (fl.submit_job's in milliseconds), so the delay is checked here, with 0004's
-- code (FL003) and message, and passed on rounded to the millisecond; everything else is
-- fl.submit_job's. Two things a caller can see changed: the messages of a few refusals are
-- fl.submit_job's wording (same codes), and a bad queue is reported before a bad type when
-- both are wrong.

create or replace function fl.submit(
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
begin
    if p_delay_s is not null and (p_delay_s < 0 or p_delay_s = 'NaN'::float8
                                  or p_delay_s > 315360000) then
        perform fl._bad_input('FL003', format('delay must be between 0 and 315360000 s, got %s',
                                              p_delay_s));
    end if;
    return query
    select r.outcome, r.job_id, r.status, r.run_at
      from fl.submit_job(p_queue, p_type, p_payload, p_priority, p_run_at,
                         round(p_delay_s * 1000)::bigint, p_timeout_ms, p_retry_policy) r;
end;
$$;
