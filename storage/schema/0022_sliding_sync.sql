-- Simplified sliding sync (MSC4186, issue 27; docs/client-api.md "Sliding sync"): what each
-- connection (user, device, conn_id) has been sent, so that a `pos` given to one process is
-- continued by any other reading this database.
--
-- A connection's positions are the `pos` tokens it was answered with; each names the stream
-- token its response covered. The rooms rows record changes of a room's status: the row with
-- the greatest position_id at or below a `pos` is the room's status as of that `pos` (no row:
-- never sent). When a request names a `pos`, rows of later positions (answers the client never
-- processed) are dropped and earlier rows are folded into it, so a connection keeps at most two
-- positions: the one in use and the one just answered.

CREATE TABLE sliding_sync_connections (
    connection_key BIGSERIAL PRIMARY KEY,
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    conn_id TEXT NOT NULL,
    created_ts BIGINT NOT NULL,
    -- Connections unused for a week are deleted by the pruning job (workers/pruning.py).
    last_used_ts BIGINT NOT NULL,
    UNIQUE (user_id, device_id, conn_id)
);
CREATE INDEX sliding_sync_connections_last_used ON sliding_sync_connections (last_used_ts);

CREATE TABLE sliding_sync_positions (
    position_id BIGSERIAL PRIMARY KEY,
    connection_key BIGINT NOT NULL REFERENCES sliding_sync_connections (connection_key) ON DELETE CASCADE,
    -- The /sync StreamToken (storage/tokens.py) the response reached.
    token TEXT NOT NULL,
    -- The connection's room subscriptions as of this position (they hold until unsubscribed):
    -- JSON, room ID -> room config.
    subscriptions TEXT NOT NULL DEFAULT '{}',
    created_ts BIGINT NOT NULL
);
CREATE INDEX sliding_sync_positions_connection ON sliding_sync_positions (connection_key);

CREATE TABLE sliding_sync_rooms (
    connection_key BIGINT NOT NULL REFERENCES sliding_sync_connections (connection_key) ON DELETE CASCADE,
    position_id BIGINT NOT NULL,
    room_id TEXT NOT NULL,
    -- 'live': sent, and every change up to the position's token with it; 'previously': sent up
    -- to last_token, then out of every list's range and subscription.
    status TEXT NOT NULL CHECK (status IN ('live', 'previously')),
    last_token TEXT,
    -- The combined room config (timeline_limit, required_state) it was last sent with, as JSON.
    config TEXT NOT NULL,
    -- The user's membership when it was last sent (an invite then joined is sent whole again).
    membership TEXT NOT NULL,
    PRIMARY KEY (connection_key, room_id, position_id)
);

-- The room list's recency order: each room's newest "bump" event (MSC4186's `bump_stamp`
-- types) in one index probe, whatever else the room holds.
CREATE INDEX events_room_bump ON events (room_id, stream_ordering)
    WHERE type IN ('m.room.create', 'm.room.message', 'm.room.encrypted', 'm.sticker', 'm.call.invite',
                   'm.poll.start', 'm.beacon_info')
      AND NOT outlier AND rejection_reason IS NULL AND NOT soft_failed;
