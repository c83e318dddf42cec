-- Typed cells' images (spacebot_core::records::CellImages): one row per cell, replaced in place
-- by a later revision. The request ledger keeps each request's spend here.
-- Databases made before this migration get the empty table when they are next opened; what they
-- hold as records at the same address is read until a cell's first image is stored.
CREATE TABLE cells (
    namespace TEXT    NOT NULL,
    key       TEXT    NOT NULL,
    revision  INTEGER NOT NULL CHECK (revision >= 0),
    -- The value as JSON text.
    value     TEXT    NOT NULL,
    PRIMARY KEY (namespace, key)
) STRICT, WITHOUT ROWID;
