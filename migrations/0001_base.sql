-- 0001: the fl schema, time and the testing switches.
--
-- Every timestamp the engine writes comes from fl.now(). In production it is now()
-- (transaction time). A session can steer it for tests:
--     set fl.testing = 'on'; set fl.now = '2026-01-01 00:00:00+00';
-- fl.now is ignored unless fl.testing is on, so a stray setting cannot move production time.
-- fl.jitter = 'off' makes retry backoff deterministic (read by the engine's backoff function).

create schema if not exists fl;

create or replace function fl.now() returns timestamptz
language plpgsql stable parallel safe as $$
declare
    v text;
begin
    if coalesce(current_setting('fl.testing', true), '') = 'on' then
        v := current_setting('fl.now', true);
        if v is not null and v <> '' then
            return v::timestamptz;
        end if;
    end if;
    return now();
end;
$$;

comment on function fl.now() is
    'Transaction time, or fl.now when fl.testing = on (tests steer time with it).';

create or replace function fl.jitter_enabled() returns boolean
language sql stable parallel safe as $$
    select coalesce(current_setting('fl.jitter', true), '') <> 'off'
$$;

comment on function fl.jitter_enabled() is
    'False when the session has set fl.jitter = off (deterministic backoff in tests).';
