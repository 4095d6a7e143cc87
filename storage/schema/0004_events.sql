-- Rooms, events and their graph, room state, memberships, and the
-- per-destination tables that feed federation catch-up.

CREATE TABLE rooms (
    room_id TEXT PRIMARY KEY,
    room_version TEXT NOT NULL,
    creator TEXT,
    is_public BOOLEAN NOT NULL DEFAULT FALSE,
    created_ts BIGINT NOT NULL
);

-- One row per event, local or remote. stream_ordering is the event's ID on the
-- multi-writer "events" stream (positive), or on the "backfill" stream
-- (negative, counting down) for history fetched from other servers.
CREATE TABLE events (
    stream_ordering BIGINT PRIMARY KEY,
    instance_name TEXT NOT NULL,
    event_id TEXT NOT NULL UNIQUE,
    room_id TEXT NOT NULL,
    type TEXT NOT NULL,
    state_key TEXT,
    sender TEXT NOT NULL,
    depth BIGINT NOT NULL,
    origin_server_ts BIGINT NOT NULL,
    -- Created by this server (and so ours to send to other servers).
    is_local BOOLEAN NOT NULL,
    -- Known, but not part of the room's graph as we see it (e.g. auth events of a join).
    outlier BOOLEAN NOT NULL DEFAULT FALSE,
    rejection_reason TEXT,
    redacted_by TEXT,
    json TEXT NOT NULL
);
CREATE INDEX events_room_stream ON events (room_id, stream_ordering);
CREATE INDEX events_room_depth ON events (room_id, depth, stream_ordering);
CREATE INDEX events_instance_stream ON events (instance_name, stream_ordering);

-- The DAG: prev_events and auth_events.
CREATE TABLE event_edges (
    event_id TEXT NOT NULL,
    prev_event_id TEXT NOT NULL,
    room_id TEXT NOT NULL,
    PRIMARY KEY (event_id, prev_event_id)
);
CREATE INDEX event_edges_prev ON event_edges (prev_event_id);

CREATE TABLE event_auth (
    event_id TEXT NOT NULL,
    auth_id TEXT NOT NULL,
    room_id TEXT NOT NULL,
    PRIMARY KEY (event_id, auth_id)
);

-- The room's forward extremities: events nothing yet points at.
CREATE TABLE event_forward_extremities (
    room_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    PRIMARY KEY (room_id, event_id)
);

-- Room state, stored as state groups: a group is a delta (the (type,
-- state_key) -> event_id entries that differ) on top of its prev_group, or a
-- full snapshot when prev_group is NULL. Chains are kept short (see
-- storage/stores/state.py), so reading a group is one recursive query, and a
-- message event adds no state at all: it reuses its predecessor's group.
CREATE SEQUENCE state_group_id_seq;
CREATE TABLE state_groups (
    id BIGINT PRIMARY KEY,
    room_id TEXT NOT NULL,
    prev_group BIGINT REFERENCES state_groups (id),
    -- How many deltas lie between this group and a full snapshot.
    delta_depth INTEGER NOT NULL
);

CREATE TABLE state_groups_state (
    state_group BIGINT NOT NULL REFERENCES state_groups (id),
    type TEXT NOT NULL,
    state_key TEXT NOT NULL,
    event_id TEXT NOT NULL,
    PRIMARY KEY (state_group, type, state_key)
);

-- The state before and after each (non-outlier) event.
CREATE TABLE event_state_groups (
    event_id TEXT PRIMARY KEY,
    state_group_before BIGINT NOT NULL REFERENCES state_groups (id),
    state_group_after BIGINT NOT NULL REFERENCES state_groups (id)
);

-- The room's current state, resolved over its forward extremities.
CREATE TABLE current_state_events (
    room_id TEXT NOT NULL,
    type TEXT NOT NULL,
    state_key TEXT NOT NULL,
    event_id TEXT NOT NULL,
    -- For m.room.member: the membership, so "who is joined" is one index scan.
    membership TEXT,
    PRIMARY KEY (room_id, type, state_key)
);
CREATE INDEX current_state_members ON current_state_events (state_key, membership) WHERE type = 'm.room.member';
CREATE INDEX current_state_room_members ON current_state_events (room_id, membership) WHERE type = 'm.room.member';

-- Every membership event, for history ("was the user in the room then?").
CREATE TABLE room_memberships (
    event_id TEXT PRIMARY KEY,
    room_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    sender TEXT NOT NULL,
    membership TEXT NOT NULL,
    stream_ordering BIGINT NOT NULL,
    display_name TEXT,
    avatar_url TEXT
);
CREATE INDEX room_memberships_user ON room_memberships (user_id, room_id, stream_ordering);

-- Outbound federation bookkeeping. destinations holds each remote server's
-- backoff and how far it has acknowledged our events; destination_rooms holds,
-- per (server, room) they share with us, the newest of our events they should
-- have. Catch-up walks destination_rooms above last_successful_stream_ordering.
CREATE TABLE destinations (
    destination TEXT PRIMARY KEY,
    retry_last_ts BIGINT,
    retry_interval BIGINT,
    failure_ts BIGINT,
    last_successful_stream_ordering BIGINT
);

CREATE TABLE destination_rooms (
    destination TEXT NOT NULL REFERENCES destinations (destination),
    room_id TEXT NOT NULL,
    stream_ordering BIGINT NOT NULL,
    PRIMARY KEY (destination, room_id)
);
CREATE INDEX destination_rooms_stream ON destination_rooms (destination, stream_ordering);
