-- Idempotent task creation: a create with a key already used on this board returns the task that
-- the first create with it made. Existing tasks have no key (NULL); any number of tasks may.
ALTER TABLE tasks ADD COLUMN idempotency_key TEXT;

CREATE UNIQUE INDEX tasks_idempotency_key ON tasks (idempotency_key)
    WHERE idempotency_key IS NOT NULL;
