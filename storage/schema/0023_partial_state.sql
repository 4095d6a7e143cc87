-- Partial-state joins (send_join with omit_members, docs/federation.md "Partial-state joins"):
-- a room this server joined with the state minus its members, while the whole state is
-- fetched from the resident servers in the background.
--
-- A row exists from the partial join; `completed_stream` stays NULL until the full state is
-- stored, then holds the events stream position (of `completed_instance`) reserved by that
-- write, so /sync can send the room as newly joined to clients that did not see it while partial.
-- A later partial join of the same room (after leaving) resets the row.
CREATE TABLE partial_state_rooms (
    room_id TEXT PRIMARY KEY,
    -- Our join, whose state before it is what the resync fetches.
    join_event_id TEXT NOT NULL,
    -- `servers_in_room` of the send_join answer, the server that answered first: where the
    -- state is fetched from, and where our events go while our member list is incomplete.
    servers TEXT[] NOT NULL,
    joined_ts BIGINT NOT NULL,
    completed_instance TEXT,
    completed_stream BIGINT
);
CREATE INDEX partial_state_rooms_incomplete ON partial_state_rooms (room_id) WHERE completed_stream IS NULL;
