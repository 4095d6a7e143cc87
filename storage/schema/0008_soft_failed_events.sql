-- Soft failure (server-server API, "Soft failure"): a remote event that passes the
-- auth rules against the state before it but not against the room's current state
-- is stored and stays in the room's graph (later events may cite it, state
-- resolution sees it), but it is not a forward extremity, does not change current
-- state or memberships, and is never served to clients (timelines skip it).
ALTER TABLE events ADD COLUMN soft_failed BOOLEAN NOT NULL DEFAULT FALSE;
