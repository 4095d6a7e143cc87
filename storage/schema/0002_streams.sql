-- Streams: persisted writer positions, instance IDs, one sequence per stream, and
-- the backing tables of every stream except events/backfill (see docs/streams.md).
--
-- Every backing table has `stream_id` (the fact's ID, from the stream's sequence)
-- and `instance_name` (the writer that wrote it), with an index on
-- (instance_name, stream_id) for get_updates_between. A fact may be several rows
-- sharing one stream_id.

-- Each writer's position per stream: every fact this writer wrote with an ID at
-- or below stream_id has committed (or will never exist). Only ever moves forward.
CREATE TABLE stream_positions (
    stream_name TEXT NOT NULL,
    instance_name TEXT NOT NULL,
    stream_id BIGINT NOT NULL,
    PRIMARY KEY (stream_name, instance_name)
);

-- A persistent small integer per instance name, used in vector-clock tokens.
CREATE TABLE instance_map (
    instance_name TEXT PRIMARY KEY,
    instance_id INTEGER NOT NULL UNIQUE CHECK (instance_id > 0)
);

-- One sequence per stream. CACHE 1 (the default, spelled out) matters: with a
-- per-session cache, nextval would not be monotonic across connections, and an
-- idle writer's position claims rely on "every future ID is above every ID seen".
CREATE SEQUENCE events_stream_seq AS BIGINT CACHE 1 NO CYCLE;
-- Backfilled events: positions of this stream increase like any other; the
-- events migration decides how they are stored (see docs/streams.md).
CREATE SEQUENCE backfill_stream_seq AS BIGINT CACHE 1 NO CYCLE;
CREATE SEQUENCE cache_invalidation_stream_seq AS BIGINT CACHE 1 NO CYCLE;
CREATE SEQUENCE typing_stream_seq AS BIGINT CACHE 1 NO CYCLE;
CREATE SEQUENCE receipts_stream_seq AS BIGINT CACHE 1 NO CYCLE;
CREATE SEQUENCE presence_stream_seq AS BIGINT CACHE 1 NO CYCLE;
CREATE SEQUENCE to_device_stream_seq AS BIGINT CACHE 1 NO CYCLE;
CREATE SEQUENCE account_data_stream_seq AS BIGINT CACHE 1 NO CYCLE;
CREATE SEQUENCE device_lists_stream_seq AS BIGINT CACHE 1 NO CYCLE;
CREATE SEQUENCE federation_stream_seq AS BIGINT CACHE 1 NO CYCLE;

-- caches: "invalidate cache `cache_name` at key `keys`" (NULL keys: the whole cache).
CREATE TABLE cache_invalidation_stream (
    stream_id BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    cache_name TEXT NOT NULL,
    keys TEXT[],
    invalidation_ts BIGINT NOT NULL
);
CREATE INDEX cache_invalidation_stream_instance_idx ON cache_invalidation_stream (instance_name, stream_id);
CREATE INDEX cache_invalidation_stream_ts_idx ON cache_invalidation_stream (invalidation_ts);

-- typing: the users typing in a room, as of stream_id.
CREATE TABLE typing_stream (
    stream_id BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    room_id TEXT NOT NULL,
    user_ids TEXT[] NOT NULL
);
CREATE INDEX typing_stream_instance_idx ON typing_stream (instance_name, stream_id);

-- receipts: the latest receipt per (room, type, user, thread); an update moves the
-- row to a new stream_id (older IDs of the row are then skipped, which is fine:
-- readers only need the latest receipt).
CREATE TABLE receipts (
    stream_id BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    room_id TEXT NOT NULL,
    receipt_type TEXT NOT NULL,
    user_id TEXT NOT NULL,
    thread_id TEXT,
    event_id TEXT NOT NULL,
    data TEXT NOT NULL,
    UNIQUE NULLS NOT DISTINCT (room_id, receipt_type, user_id, thread_id)
);
CREATE INDEX receipts_instance_idx ON receipts (instance_name, stream_id);
CREATE INDEX receipts_room_idx ON receipts (room_id, stream_id);

-- presence: the latest presence state per user.
CREATE TABLE presence_stream (
    stream_id BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    user_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    status_msg TEXT,
    last_active_ts BIGINT NOT NULL,
    currently_active BOOLEAN NOT NULL
);
CREATE INDEX presence_stream_instance_idx ON presence_stream (instance_name, stream_id);

-- to_device: messages for local devices (device_inbox) and for other servers
-- (device_federation_outbox) share the to_device stream.
CREATE TABLE device_inbox (
    stream_id BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    message_json TEXT NOT NULL
);
CREATE INDEX device_inbox_instance_idx ON device_inbox (instance_name, stream_id);
CREATE INDEX device_inbox_device_idx ON device_inbox (user_id, device_id, stream_id);

CREATE TABLE device_federation_outbox (
    stream_id BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    destination TEXT NOT NULL,
    message_id TEXT NOT NULL,
    messages_json TEXT NOT NULL,
    queued_ts BIGINT NOT NULL
);
CREATE INDEX device_federation_outbox_instance_idx ON device_federation_outbox (instance_name, stream_id);
CREATE INDEX device_federation_outbox_destination_idx ON device_federation_outbox (destination, stream_id);

-- account_data: the latest content per (user, room, type); room_id NULL is global.
CREATE TABLE account_data (
    stream_id BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    user_id TEXT NOT NULL,
    room_id TEXT,
    account_data_type TEXT NOT NULL,
    content TEXT NOT NULL,
    UNIQUE NULLS NOT DISTINCT (user_id, room_id, account_data_type)
);
CREATE INDEX account_data_instance_idx ON account_data (instance_name, stream_id);
CREATE INDEX account_data_user_idx ON account_data (user_id, stream_id);

-- device_lists: "the devices of this user changed".
CREATE TABLE device_lists_stream (
    stream_id BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL
);
CREATE INDEX device_lists_stream_instance_idx ON device_lists_stream (instance_name, stream_id);
CREATE INDEX device_lists_stream_user_idx ON device_lists_stream (user_id, stream_id);

-- federation: EDUs queued for other servers, for a federation sender on a worker.
CREATE TABLE federation_stream (
    stream_id BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    destination TEXT NOT NULL,
    edu_type TEXT NOT NULL,
    content TEXT NOT NULL
);
CREATE INDEX federation_stream_instance_idx ON federation_stream (instance_name, stream_id);
