-- The tables of an agent's database gain the `agent` column of the organization layout (see
-- migrations_instance/0003_agents.sql), so that one set of statements serves both layouts. In an
-- agent's own database the file names the agent and the column is empty (''). Every row is kept
-- as it was: task numbers and channel sequence numbers unchanged, outbox and pending deliveries
-- in their order.

CREATE TABLE tasks_v3 (
    agent            TEXT    NOT NULL,
    number           INTEGER NOT NULL,
    title            TEXT    NOT NULL,
    description      TEXT    NOT NULL,
    status           TEXT    NOT NULL CHECK (status IN ('pending_approval', 'backlog', 'ready',
                         'in_progress', 'waiting', 'done', 'failed', 'cancelled')),
    priority         INTEGER NOT NULL CHECK (priority BETWEEN 0 AND 3),
    created_by       TEXT    NOT NULL,
    delegated_by     TEXT,
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
    idempotency_key  TEXT,
    PRIMARY KEY (agent, number)
) STRICT;

INSERT INTO tasks_v3 (agent, number, title, description, status, priority, created_by,
    delegated_by, metadata, attempts, max_attempts, lease_holder, lease_expires_at, revision,
    result, error, created_at, updated_at, idempotency_key)
SELECT '', number, title, description, status, priority, created_by, delegated_by, metadata,
    attempts, max_attempts, lease_holder, lease_expires_at, revision, result, error, created_at,
    updated_at, idempotency_key
FROM tasks ORDER BY number;

CREATE TABLE outbox_v3 (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    agent       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    task_number INTEGER NOT NULL,
    notice      TEXT    NOT NULL,
    created_at  INTEGER NOT NULL,
    sent        INTEGER NOT NULL DEFAULT 0 CHECK (sent IN (0, 1)),
    UNIQUE (agent, key),
    FOREIGN KEY (agent, task_number) REFERENCES tasks_v3 (agent, number)
) STRICT;

INSERT INTO outbox_v3 (seq, agent, key, task_number, notice, created_at, sent)
SELECT seq, '', key, task_number, notice, created_at, sent FROM outbox ORDER BY seq;

CREATE TABLE channels_v3 (
    agent TEXT NOT NULL,
    id    TEXT NOT NULL,
    PRIMARY KEY (agent, id)
) STRICT, WITHOUT ROWID;

INSERT INTO channels_v3 (agent, id) SELECT '', id FROM channels;

CREATE TABLE channel_records_v3 (
    agent      TEXT    NOT NULL,
    seq        INTEGER NOT NULL,
    channel_id TEXT    NOT NULL,
    kind       TEXT    NOT NULL,
    author     TEXT    NOT NULL,
    content    TEXT    NOT NULL,
    metadata   TEXT    NOT NULL,
    at         INTEGER NOT NULL,
    PRIMARY KEY (agent, seq)
) STRICT;

INSERT INTO channel_records_v3 (agent, seq, channel_id, kind, author, content, metadata, at)
SELECT '', seq, channel_id, kind, author, content, metadata, at FROM channel_records ORDER BY seq;

CREATE TABLE pending_deliveries_v3 (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    agent      TEXT    NOT NULL,
    id         TEXT    NOT NULL,
    channel_id TEXT    NOT NULL,
    kind       TEXT    NOT NULL,
    envelope   TEXT    NOT NULL,
    UNIQUE (agent, id)
) STRICT;

INSERT INTO pending_deliveries_v3 (seq, agent, id, channel_id, kind, envelope)
SELECT seq, '', id, channel_id, kind, envelope FROM pending_deliveries ORDER BY seq;

CREATE TABLE applied_keys_v3 (
    agent      TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    applied_at INTEGER NOT NULL,
    PRIMARY KEY (agent, key)
) STRICT, WITHOUT ROWID;

INSERT INTO applied_keys_v3 (agent, key, applied_at) SELECT '', key, applied_at FROM applied_keys;

-- The old tables go with their indexes and trigger; the new ones take their names.
DROP TABLE outbox;
DROP TABLE tasks;
DROP TABLE channel_records;
DROP TABLE channels;
DROP TABLE pending_deliveries;
DROP TABLE applied_keys;

ALTER TABLE tasks_v3 RENAME TO tasks;
ALTER TABLE outbox_v3 RENAME TO outbox;
ALTER TABLE channels_v3 RENAME TO channels;
ALTER TABLE channel_records_v3 RENAME TO channel_records;
ALTER TABLE pending_deliveries_v3 RENAME TO pending_deliveries;
ALTER TABLE applied_keys_v3 RENAME TO applied_keys;

CREATE INDEX tasks_claim ON tasks (agent, status, priority DESC, number);
CREATE INDEX tasks_lease ON tasks (agent, status, lease_expires_at);
CREATE INDEX tasks_delegated_by ON tasks (agent, delegated_by, number)
    WHERE delegated_by IS NOT NULL;
CREATE UNIQUE INDEX tasks_idempotency_key ON tasks (agent, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX outbox_unsent ON outbox (agent, seq) WHERE sent = 0;
CREATE INDEX channel_records_channel ON channel_records (agent, channel_id, seq);
CREATE INDEX pending_deliveries_agent ON pending_deliveries (agent, seq);

CREATE TRIGGER channel_records_known AFTER INSERT ON channel_records
BEGIN
    INSERT OR IGNORE INTO channels (agent, id) VALUES (NEW.agent, NEW.channel_id);
END;
