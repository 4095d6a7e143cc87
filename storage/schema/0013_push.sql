-- Push notifications (docs/push.md).
--
-- event_push_actions: one row per (local user, event) that notifies the user under their
-- push rules, written by the events writer in the event's own transaction, so /sync's
-- unread counts, GET /notifications and the pusher read the same facts.
CREATE TABLE event_push_actions (
    user_id TEXT NOT NULL,
    room_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    stream_ordering BIGINT NOT NULL,
    highlight BOOLEAN NOT NULL,
    -- The matching rule's actions (JSON list): the tweaks a push carries.
    actions TEXT NOT NULL,
    received_ts BIGINT NOT NULL,
    -- The thread the event is in (its m.thread relation's root), NULL for the main timeline:
    -- what per-thread unread counts group by.
    thread_id TEXT,
    PRIMARY KEY (user_id, event_id)
);
CREATE INDEX event_push_actions_user_room ON event_push_actions (user_id, room_id, stream_ordering);
CREATE INDEX event_push_actions_user_stream ON event_push_actions (user_id, stream_ordering);

-- pushers: where a user's notifications go (POST /pushers/set). last_stream_ordering is
-- the events position up to which this pusher has delivered: it survives restarts, so a
-- restarted pusher process sends nothing twice and misses nothing.
CREATE TABLE pushers (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id TEXT NOT NULL,
    access_token_id BIGINT,
    kind TEXT NOT NULL,
    app_id TEXT NOT NULL,
    pushkey TEXT NOT NULL,
    app_display_name TEXT NOT NULL,
    device_display_name TEXT NOT NULL,
    profile_tag TEXT,
    lang TEXT NOT NULL,
    data TEXT NOT NULL,
    created_ts BIGINT NOT NULL,
    last_stream_ordering BIGINT NOT NULL,
    -- When delivery started failing (ms), NULL while it works.
    failing_since BIGINT,
    UNIQUE (app_id, pushkey, user_id)
);
CREATE INDEX pushers_pushkey ON pushers (app_id, pushkey);
