-- Behaviours' records (spacebot_core::records): every version of every key of every namespace.
-- A write is one row: its version, its place in the history and its effect key together.
-- Databases made before this migration get the empty table when they are next opened.
CREATE TABLE records (
    namespace  TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    version    INTEGER NOT NULL CHECK (version > 0),
    -- The value as JSON text.
    value      TEXT    NOT NULL,
    author     TEXT    NOT NULL,
    written_at INTEGER NOT NULL,
    -- Idempotency: a write with a key already applied in the namespace is not written again.
    effect_key TEXT,
    PRIMARY KEY (namespace, key, version)
) STRICT;

CREATE UNIQUE INDEX records_effect_key ON records (namespace, effect_key)
    WHERE effect_key IS NOT NULL;
