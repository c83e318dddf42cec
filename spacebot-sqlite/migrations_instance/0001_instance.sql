-- The instance database ({dir}/instance.db): data that spans agents.

-- Marks the file as a spacebot instance database ("SBI1").
PRAGMA application_id = 1396853041;

-- Links (seed 003): directed, unique per ordered pair.
CREATE TABLE agent_links (
    id            TEXT    PRIMARY KEY NOT NULL,
    from_agent_id TEXT    NOT NULL,
    to_agent_id   TEXT    NOT NULL,
    direction     TEXT    NOT NULL CHECK (direction IN ('one_way', 'two_way')),
    relationship  TEXT    NOT NULL CHECK (relationship IN ('peer', 'superior', 'subordinate')),
    enabled       INTEGER NOT NULL CHECK (enabled IN (0, 1)),
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL,
    UNIQUE (from_agent_id, to_agent_id)
) STRICT;

CREATE INDEX agent_links_to ON agent_links (to_agent_id, from_agent_id);

-- Conversation links (seeds 000 and 002).
CREATE TABLE conversations (
    id               TEXT    PRIMARY KEY NOT NULL,
    mode             TEXT    NOT NULL,
    initiator        TEXT    NOT NULL,
    initiated_from   TEXT,
    status           TEXT    NOT NULL,
    budget_remaining INTEGER NOT NULL CHECK (budget_remaining >= 0),
    pair_key         TEXT,
    summary          TEXT,
    revision         INTEGER NOT NULL,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL
) STRICT;

-- At most one open conversation per pair key.
CREATE UNIQUE INDEX conversations_open_pair ON conversations (pair_key)
    WHERE status = 'open' AND pair_key IS NOT NULL;
CREATE INDEX conversations_created ON conversations (created_at, id);

CREATE TABLE conversation_members (
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    number          INTEGER NOT NULL,
    agent_id        TEXT    NOT NULL,
    channel_id      TEXT    NOT NULL,
    name            TEXT    NOT NULL,
    role            TEXT    NOT NULL,
    open            INTEGER NOT NULL CHECK (open IN (0, 1)),
    PRIMARY KEY (conversation_id, number)
) STRICT, WITHOUT ROWID;

CREATE INDEX conversation_members_agent ON conversation_members (agent_id, conversation_id);
