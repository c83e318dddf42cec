-- Behaviours' records (spacebot_core::records): every version of every key of every namespace.
-- A write is one row: its version, its place in the history and its effect key together. Of two
-- writers racing for one version (or one effect key) the unique indexes let one insert; the other
-- reads again. Namespaces are validated ASCII; keys, authors and effect keys are BYTEA (UTF-8,
-- byte order); values are JSON text as serde_json writes it.
CREATE TABLE records (
    namespace  TEXT   COLLATE "C" NOT NULL,
    key        BYTEA  NOT NULL,
    version    BIGINT NOT NULL CHECK (version > 0),
    value      TEXT   NOT NULL,
    author     BYTEA  NOT NULL,
    written_at BIGINT NOT NULL,
    effect_key BYTEA,
    PRIMARY KEY (namespace, key, version)
);
CREATE UNIQUE INDEX records_effect_key ON records (namespace, effect_key)
    WHERE effect_key IS NOT NULL;
