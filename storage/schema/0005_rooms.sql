-- Client-server API bookkeeping for rooms: aliases, send idempotency, redactions,
-- forgotten rooms. (Receipts use the receipts table of 0002.)

CREATE TABLE room_aliases (
    room_alias TEXT PRIMARY KEY,
    room_id TEXT NOT NULL,
    creator TEXT NOT NULL
);
CREATE INDEX room_aliases_room ON room_aliases (room_id);

-- PUT /send and /state and /redact with a txnId return the same event for the
-- same (access token, txnId).
CREATE TABLE event_txn_ids (
    access_token_id BIGINT NOT NULL,
    txn_id TEXT NOT NULL,
    room_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    inserted_ts BIGINT NOT NULL,
    PRIMARY KEY (access_token_id, txn_id)
);
CREATE INDEX event_txn_ids_event ON event_txn_ids (event_id);

-- Which event redacts which (filled by the persist transaction of every
-- m.room.redaction, local or remote), so that reads can serve events pruned.
CREATE TABLE event_redactions (
    redaction_id TEXT PRIMARY KEY,
    redacts TEXT NOT NULL,
    room_id TEXT NOT NULL
);
CREATE INDEX event_redactions_redacts ON event_redactions (redacts);

CREATE TABLE room_forgotten (
    user_id TEXT NOT NULL,
    room_id TEXT NOT NULL,
    PRIMARY KEY (user_id, room_id)
);

-- PUT /sendToDevice idempotency per (user, device, txnId).
CREATE TABLE to_device_txn_ids (
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    txn_id TEXT NOT NULL,
    PRIMARY KEY (user_id, device_id, txn_id)
);

-- End-to-end keys: enough for clients with encryption support to work.
CREATE TABLE e2e_device_keys (
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    key_json TEXT NOT NULL,
    PRIMARY KEY (user_id, device_id)
);

CREATE TABLE e2e_one_time_keys (
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    algorithm TEXT NOT NULL,
    key_id TEXT NOT NULL,
    key_json TEXT NOT NULL,
    PRIMARY KEY (user_id, device_id, algorithm, key_id)
);
