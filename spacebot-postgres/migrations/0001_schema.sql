-- Every spacebot store in one PostgreSQL schema: the instance data (links, conversations) and the
-- per-agent data of every agent (boards, outboxes, channel histories, pending deliveries, applied
-- keys), rows keyed by agent id.
--
-- Types: free text (titles, contents, channel ids, keys, ...) is BYTEA holding UTF-8, because
-- PostgreSQL's TEXT cannot hold NUL and spacebot's text may; BYTEA also compares byte by byte,
-- which is the order of Rust strings. Agent ids are validated ASCII: TEXT COLLATE "C" (byte order
-- too). JSON (metadata, notices, envelopes) is TEXT as serde_json writes it (it escapes NUL), not
-- JSONB, which would reorder keys and refuse \u0000. Timestamps are BIGINT milliseconds.

-- Marks the schema as spacebot's: a schema holding tables without this one is refused.
CREATE TABLE spacebot_meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
INSERT INTO spacebot_meta (key, value) VALUES ('format', 'spacebot-postgres');

-- Links: directed, unique per ordered pair.
CREATE TABLE agent_links (
    id            BYTEA   PRIMARY KEY,
    from_agent_id TEXT    COLLATE "C" NOT NULL,
    to_agent_id   TEXT    COLLATE "C" NOT NULL,
    direction     TEXT    NOT NULL CHECK (direction IN ('one_way', 'two_way')),
    relationship  TEXT    NOT NULL CHECK (relationship IN ('peer', 'superior', 'subordinate')),
    enabled       BOOLEAN NOT NULL,
    created_at    BIGINT  NOT NULL,
    updated_at    BIGINT  NOT NULL,
    CONSTRAINT agent_links_pair UNIQUE (from_agent_id, to_agent_id)
);
CREATE INDEX agent_links_to ON agent_links (to_agent_id, from_agent_id);

-- Conversation links and their members.
CREATE TABLE conversations (
    id               BYTEA  PRIMARY KEY,
    mode             TEXT   NOT NULL,
    initiator        TEXT   COLLATE "C" NOT NULL,
    initiated_from   BYTEA,
    status           TEXT   NOT NULL,
    budget_remaining BIGINT NOT NULL CHECK (budget_remaining >= 0),
    pair_key         BYTEA,
    summary          BYTEA,
    revision         BIGINT NOT NULL,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL
);
-- At most one open conversation per pair key.
CREATE UNIQUE INDEX conversations_open_pair ON conversations (pair_key)
    WHERE status = 'open' AND pair_key IS NOT NULL;
CREATE INDEX conversations_created ON conversations (created_at, id);

CREATE TABLE conversation_members (
    conversation_id BYTEA   NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    number          BIGINT  NOT NULL,
    agent_id        TEXT    COLLATE "C" NOT NULL,
    channel_id      BYTEA   NOT NULL,
    name            BYTEA   NOT NULL,
    role            TEXT    NOT NULL,
    open            BOOLEAN NOT NULL,
    PRIMARY KEY (conversation_id, number)
);
CREATE INDEX conversation_members_agent ON conversation_members (agent_id, conversation_id);

-- Each board's last task number. A create bumps it in its transaction: the row lock serializes
-- the creates of one board, so numbers have no gaps (a rolled-back create gives its number back).
CREATE TABLE boards (
    agent_id    TEXT   COLLATE "C" PRIMARY KEY,
    last_number BIGINT NOT NULL
);

-- Task boards.
CREATE TABLE tasks (
    agent_id         TEXT   COLLATE "C" NOT NULL,
    number           BIGINT NOT NULL,
    title            BYTEA  NOT NULL,
    description      BYTEA  NOT NULL,
    status           TEXT   NOT NULL CHECK (status IN ('pending_approval', 'backlog', 'ready',
                         'in_progress', 'waiting', 'done', 'failed', 'cancelled')),
    -- Priority rank: 0 low .. 3 urgent.
    priority         BIGINT NOT NULL CHECK (priority BETWEEN 0 AND 3),
    created_by       BYTEA  NOT NULL,
    -- Copy of metadata.delegated_by, for filtering.
    delegated_by     TEXT   COLLATE "C",
    -- TaskMetadata as JSON.
    metadata         TEXT   NOT NULL,
    attempts         BIGINT NOT NULL,
    max_attempts     BIGINT NOT NULL CHECK (max_attempts >= 1),
    lease_holder     BYTEA,
    lease_expires_at BIGINT,
    revision         BIGINT NOT NULL,
    result           BYTEA,
    error            BYTEA,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    -- The idempotency key of the create that made the task (NULL: none).
    idempotency_key  BYTEA,
    PRIMARY KEY (agent_id, number)
);
-- A key names one task per board.
CREATE UNIQUE INDEX tasks_idempotency_key ON tasks (agent_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- Serves the claim in the order it sorts: highest priority, then lowest number.
CREATE INDEX tasks_claim ON tasks (agent_id, priority DESC, number) WHERE status = 'ready';
-- Serves the search for expired leases: an agent's in-progress tasks (few: one per running
-- worker) in number order, filtered by expiry.
CREATE INDEX tasks_lease ON tasks (agent_id, number) WHERE status = 'in_progress';
CREATE INDEX tasks_delegated_by ON tasks (agent_id, delegated_by, number)
    WHERE delegated_by IS NOT NULL;

-- Completion notices, written in the same transaction as the terminal transition.
CREATE TABLE outbox (
    seq         BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    agent_id    TEXT    COLLATE "C" NOT NULL,
    key         BYTEA   NOT NULL,
    task_number BIGINT  NOT NULL,
    -- CompletionNotice as JSON.
    notice      TEXT    NOT NULL,
    created_at  BIGINT  NOT NULL,
    sent        BOOLEAN NOT NULL DEFAULT FALSE,
    CONSTRAINT outbox_key UNIQUE (agent_id, key),
    FOREIGN KEY (agent_id, task_number) REFERENCES tasks (agent_id, number)
);
CREATE INDEX outbox_unsent ON outbox (agent_id, seq) WHERE NOT sent;

-- Each agent's last channel record sequence number (bumped like boards.last_number).
CREATE TABLE histories (
    agent_id TEXT   COLLATE "C" PRIMARY KEY,
    last_seq BIGINT NOT NULL
);

-- Known channels.
CREATE TABLE channels (
    agent_id TEXT  COLLATE "C" NOT NULL,
    id       BYTEA NOT NULL,
    PRIMARY KEY (agent_id, id)
);

CREATE TABLE channel_records (
    agent_id   TEXT   COLLATE "C" NOT NULL,
    seq        BIGINT NOT NULL,
    channel_id BYTEA  NOT NULL,
    kind       TEXT   NOT NULL,
    author     BYTEA  NOT NULL,
    content    BYTEA  NOT NULL,
    -- Metadata as JSON.
    metadata   TEXT   NOT NULL,
    at         BIGINT NOT NULL,
    PRIMARY KEY (agent_id, seq)
);
CREATE INDEX channel_records_channel ON channel_records (agent_id, channel_id, seq);

-- Envelopes waiting for an agent that is not running, in the order they were persisted.
CREATE TABLE pending_deliveries (
    seq        BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    agent_id   TEXT   COLLATE "C" NOT NULL,
    id         BYTEA  NOT NULL,
    channel_id BYTEA  NOT NULL,
    kind       TEXT   NOT NULL,
    -- Envelope as JSON.
    envelope   TEXT   NOT NULL,
    CONSTRAINT pending_deliveries_id UNIQUE (agent_id, id)
);
CREATE INDEX pending_deliveries_agent ON pending_deliveries (agent_id, seq);

-- Idempotency keys each agent has applied.
CREATE TABLE applied_keys (
    agent_id   TEXT   COLLATE "C" NOT NULL,
    key        BYTEA  NOT NULL,
    applied_at BIGINT NOT NULL,
    PRIMARY KEY (agent_id, key)
);
