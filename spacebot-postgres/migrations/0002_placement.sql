-- Placement: which process hosts which agent's loop when several processes share this schema
-- (spacebot_core::placement). One row per agent ever placed; a release keeps the row (with an
-- empty process and an expiry in the distant past) so that the epoch keeps growing.
CREATE TABLE agent_placement (
    agent_id   TEXT   COLLATE "C" PRIMARY KEY,
    -- The holder's ProcessId ('' once released).
    process    TEXT   COLLATE "C" NOT NULL,
    -- Milliseconds since the Unix epoch, by the clock of the process that asked for the lease.
    expires_at BIGINT NOT NULL,
    -- Grows on every change of hands; kept by renewals (a fencing token).
    epoch      BIGINT NOT NULL CHECK (epoch > 0)
);
-- held_by(process, now).
CREATE INDEX agent_placement_process ON agent_placement (process, agent_id);
