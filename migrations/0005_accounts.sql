-- 0005: people and programs that use the HTTP API, what they may do, and what they did.
--
-- Every request is authorised by one join from the caller (a session's user, or an API key's
-- project) to the organization that owns the entity it names (fenceline/api/authz.py). Tokens
-- are random 32-byte strings; only their SHA-256 is stored, so reading these tables does not
-- let anyone act as a user (reference W7). A plain hash is enough for 256 bits of entropy:
-- argon2 is for passwords, which people choose.

-- Ordered: a comparison on the enum is a comparison of power.
create type fl.org_role as enum ('viewer', 'member', 'admin', 'owner');

create table fl.users (
    id             uuid primary key default fl.uuidv7(),
    -- Stored trimmed and lower-cased; the API normalises before it looks up or inserts.
    email          text not null unique
                   check (email = lower(btrim(email)) and length(email) between 3 and 254
                          and email like '_%@_%'),
    name           text check (length(name) between 1 and 200),
    password_hash  text not null,
    created_at     timestamptz not null default fl.now()
);

create table fl.org_members (
    org_id      uuid not null references fl.organizations (id) on delete cascade,
    user_id     uuid not null references fl.users (id) on delete cascade,
    role        fl.org_role not null,
    created_at  timestamptz not null default fl.now(),
    primary key (org_id, user_id)
);

create index org_members_user on fl.org_members (user_id);

-- Logout sets revoked_at; expiry is fixed at login (30 days). The hash is the lookup key.
create table fl.sessions (
    id          uuid primary key default fl.uuidv7(),
    user_id     uuid not null references fl.users (id) on delete cascade,
    token_hash  bytea not null unique check (length(token_hash) = 32),
    created_at  timestamptz not null default fl.now(),
    expires_at  timestamptz not null,
    revoked_at  timestamptz
);

create index sessions_user on fl.sessions (user_id) where revoked_at is null;

-- A key acts inside one project with a role below owner; it never sees the organization.
create table fl.api_keys (
    id          uuid primary key default fl.uuidv7(),
    project_id  uuid not null references fl.projects (id) on delete cascade,
    name        text not null check (length(name) between 1 and 200),
    role        fl.org_role not null check (role <> 'owner'),
    token_hash  bytea not null unique check (length(token_hash) = 32),
    -- The first characters of the token, shown in lists so a person can tell keys apart.
    prefix      text not null,
    created_by  uuid references fl.users (id) on delete set null,
    created_at  timestamptz not null default fl.now(),
    expires_at  timestamptz,
    revoked_at  timestamptz
);

create index api_keys_project on fl.api_keys (project_id, created_at desc, id desc);

-- One row per privileged mutation, written in the mutation's transaction. Organization-level
-- changes are audited too (reference W6): project_id is NULL for those. No foreign key to
-- projects, so deleting a project keeps the record of who deleted it; deleting the
-- organization removes its audit trail with everything else.
create table fl.audit_log (
    id           bigint generated always as identity primary key,
    org_id       uuid not null references fl.organizations (id) on delete cascade,
    project_id   uuid,
    actor_user   uuid,
    actor_key    uuid,
    action       text not null,
    entity       text not null,
    entity_id    text,
    detail       jsonb not null default '{}',
    request_id   text,
    created_at   timestamptz not null default fl.now()
);

create index audit_log_project on fl.audit_log (project_id, id desc) where project_id is not null;
create index audit_log_org on fl.audit_log (org_id, id desc);
