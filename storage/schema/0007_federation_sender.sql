-- The federation sender reads new local events from the events table in
-- stream order and needs, for each, the remote servers that were in the room at
-- that event. The persister already works that out; storing it on the event row
-- (NULL for remote events, outliers and events no other server shares) costs no
-- extra statement and lets any process, main or worker, fan the event out.
ALTER TABLE events ADD COLUMN destinations TEXT[];

-- The sender scans for new fan-out work above its position; only local events
-- with destinations matter, so the index holds just those.
CREATE INDEX events_federation_fanout ON events (stream_ordering) WHERE destinations IS NOT NULL;

-- Per-PDU errors a destination reported: kept for operators (and the Spark
-- report), never retried.
CREATE TABLE destination_pdu_errors (
    destination TEXT NOT NULL,
    event_id TEXT NOT NULL,
    error TEXT NOT NULL,
    reported_ts BIGINT NOT NULL,
    PRIMARY KEY (destination, event_id)
);
