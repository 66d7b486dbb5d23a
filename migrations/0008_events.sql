-- 0008: the event stream's low-water mark (fenceline/api/events.py).
--
-- Readers follow a project's outbox by position (txid, id). A retention job (none exists
-- yet) that drops a project's events must, in the same transaction:
--   * delete only events whose txid is below pg_snapshot_xmin(pg_current_snapshot()), so no
--     event can later appear below what it dropped;
--   * record here the greatest (txid, id) it dropped for that project (never moving it back).
-- A reader whose cursor is below that position is answered 410 cursor_too_old with this
-- position as `oldest`, instead of silently missing events; a reader with no cursor starts
-- here. No row = nothing was ever dropped.
create table fl.events_retention (
    project_id  uuid primary key references fl.projects (id) on delete cascade,
    txid        xid8 not null,
    id          bigint not null check (id >= 0),
    updated_at  timestamptz not null default fl.now()
);

-- The outbox has no foreign key (an FK check on every event insert of the hot paths is not
-- worth it), so a deleted project's events are removed here; an organization's deletion
-- cascades to its projects and so fires this too. events_stream leads with project_id.
create function fl.projects_deleted() returns trigger
language plpgsql as $$
begin
    delete from fl.events where project_id = old.id;
    return null;
end;
$$;

create trigger projects_deleted after delete on fl.projects
    for each row execute function fl.projects_deleted();
