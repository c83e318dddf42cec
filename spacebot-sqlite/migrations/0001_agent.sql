-- An agent's database ({dir}/agents/{id}/data/spacebot.db): its board, outbox, channel history,
-- pending deliveries and applied idempotency keys.

-- Marks the file as a spacebot agent database ("SBA1").
PRAGMA application_id = 1396850993;

-- The task board (seed 001). `number` is the per-agent task number (the rowid).
CREATE TABLE tasks (
    number           INTEGER PRIMARY KEY NOT NULL,
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
    updated_at       INTEGER NOT NULL
) STRICT;

-- Serves the claim in the order it sorts: highest priority, then lowest number.
CREATE INDEX tasks_claim ON tasks (status, priority DESC, number);
-- Serves the search for expired leases.
CREATE INDEX tasks_lease ON tasks (status, lease_expires_at);
CREATE INDEX tasks_delegated_by ON tasks (delegated_by, number) WHERE delegated_by IS NOT NULL;

-- Completion notices, written in the same transaction as the terminal transition.
CREATE TABLE outbox (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    key         TEXT    NOT NULL UNIQUE,
    task_number INTEGER NOT NULL REFERENCES tasks (number),
    -- CompletionNotice as JSON.
    notice      TEXT    NOT NULL,
    created_at  INTEGER NOT NULL,
    sent        INTEGER NOT NULL DEFAULT 0 CHECK (sent IN (0, 1))
) STRICT;

CREATE INDEX outbox_unsent ON outbox (seq) WHERE sent = 0;

-- Channel histories.
CREATE TABLE channels (
    id TEXT PRIMARY KEY NOT NULL
) STRICT, WITHOUT ROWID;

CREATE TABLE channel_records (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    channel_id TEXT    NOT NULL,
    kind       TEXT    NOT NULL,
    author     TEXT    NOT NULL,
    content    TEXT    NOT NULL,
    -- Metadata as a JSON object.
    metadata   TEXT    NOT NULL,
    at         INTEGER NOT NULL
) STRICT;

CREATE INDEX channel_records_channel ON channel_records (channel_id, seq);

-- A channel with records is a known channel.
CREATE TRIGGER channel_records_known AFTER INSERT ON channel_records
BEGIN
    INSERT OR IGNORE INTO channels (id) VALUES (NEW.channel_id);
END;

-- Envelopes waiting for an agent that is not running, in the order they were persisted.
CREATE TABLE pending_deliveries (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    id         TEXT    NOT NULL UNIQUE,
    channel_id TEXT    NOT NULL,
    kind       TEXT    NOT NULL,
    -- Envelope as JSON.
    envelope   TEXT    NOT NULL
) STRICT;

-- Idempotency keys this agent has applied.
CREATE TABLE applied_keys (
    key        TEXT    PRIMARY KEY NOT NULL,
    applied_at INTEGER NOT NULL
) STRICT, WITHOUT ROWID;
