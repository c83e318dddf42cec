-- The organization layout (SqliteOptions::layout, Layout::Organization): every agent's board,
-- outbox, channel history, pending deliveries and applied idempotency keys in this one file, as
-- rows keyed by `agent`, so that one writer and one commit (one fsync) serve every agent.
-- A directory in the per-agent layout keeps these tables empty. The same tables, with `agent`
-- left empty, are what migration 0003 of an agent's own database makes.

-- Which layout the directory holds: one row, written at the first open of this release
-- ('organization' or 'per_agent'); a directory without it was written before layouts existed
-- and holds the per-agent layout.
CREATE TABLE layout (
    one  INTEGER PRIMARY KEY NOT NULL CHECK (one = 1),
    kind TEXT    NOT NULL CHECK (kind IN ('organization', 'per_agent'))
) STRICT;

-- The task boards (seed 001). `number` is the per-agent task number.
CREATE TABLE tasks (
    agent            TEXT    NOT NULL,
    number           INTEGER NOT NULL,
    title            TEXT    NOT NULL,
    description      TEXT    NOT NULL,
    status           TEXT    NOT NULL CHECK (status IN ('pending_approval', 'backlog', 'ready',
                         'in_progress', 'waiting', 'done', 'failed', 'cancelled')),
    -- Priority rank: 0 low .. 3 urgent.
    priority         INTEGER NOT NULL CHECK (priority BETWEEN 0 AND 3),
    created_by       TEXT    NOT NULL,
    -- Copy of metadata.delegated_by, for filtering.
    delegated_by     TEXT,
    -- TaskMetadata as JSON.
    metadata         TEXT    NOT NULL,
    attempts         INTEGER NOT NULL,
    max_attempts     INTEGER NOT NULL CHECK (max_attempts >= 1),
    lease_holder     TEXT,
    lease_expires_at INTEGER,
    revision         INTEGER NOT NULL,
    result           TEXT,
    error            TEXT,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    -- A create's idempotency key (NULL: none).
    idempotency_key  TEXT,
    PRIMARY KEY (agent, number)
) STRICT;

-- Serves the claim in the order it sorts: highest priority, then lowest number.
CREATE INDEX tasks_claim ON tasks (agent, status, priority DESC, number);
-- Serves the search for expired leases.
CREATE INDEX tasks_lease ON tasks (agent, status, lease_expires_at);
CREATE INDEX tasks_delegated_by ON tasks (agent, delegated_by, number)
    WHERE delegated_by IS NOT NULL;
CREATE UNIQUE INDEX tasks_idempotency_key ON tasks (agent, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Completion notices, written in the same transaction as the terminal transition.
CREATE TABLE outbox (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    agent       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    task_number INTEGER NOT NULL,
    -- CompletionNotice as JSON.
    notice      TEXT    NOT NULL,
    created_at  INTEGER NOT NULL,
    sent        INTEGER NOT NULL DEFAULT 0 CHECK (sent IN (0, 1)),
    UNIQUE (agent, key),
    FOREIGN KEY (agent, task_number) REFERENCES tasks (agent, number)
) STRICT;

CREATE INDEX outbox_unsent ON outbox (agent, seq) WHERE sent = 0;

-- Channel histories.
CREATE TABLE channels (
    agent TEXT NOT NULL,
    id    TEXT NOT NULL,
    PRIMARY KEY (agent, id)
) STRICT, WITHOUT ROWID;

-- `seq` is the per-agent sequence number.
CREATE TABLE channel_records (
    agent      TEXT    NOT NULL,
    seq        INTEGER NOT NULL,
    channel_id TEXT    NOT NULL,
    kind       TEXT    NOT NULL,
    author     TEXT    NOT NULL,
    content    TEXT    NOT NULL,
    -- Metadata as a JSON object.
    metadata   TEXT    NOT NULL,
    at         INTEGER NOT NULL,
    PRIMARY KEY (agent, seq)
) STRICT;

CREATE INDEX channel_records_channel ON channel_records (agent, channel_id, seq);

-- A channel with records is a known channel.
CREATE TRIGGER channel_records_known AFTER INSERT ON channel_records
BEGIN
    INSERT OR IGNORE INTO channels (agent, id) VALUES (NEW.agent, NEW.channel_id);
END;

-- Envelopes waiting for an agent that is not running, in the order they were persisted.
CREATE TABLE pending_deliveries (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    agent      TEXT    NOT NULL,
    id         TEXT    NOT NULL,
    channel_id TEXT    NOT NULL,
    kind       TEXT    NOT NULL,
    -- Envelope as JSON.
    envelope   TEXT    NOT NULL,
    UNIQUE (agent, id)
) STRICT;

CREATE INDEX pending_deliveries_agent ON pending_deliveries (agent, seq);

-- Idempotency keys each agent has applied.
CREATE TABLE applied_keys (
    agent      TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    applied_at INTEGER NOT NULL,
    PRIMARY KEY (agent, key)
) STRICT, WITHOUT ROWID;
