-- End-to-end encryption across devices and servers (issue 29).

-- The device-list stream (device_lists_stream, 0002) names local and remote users alike;
-- a local user's rows chain per user: an update's prev_id is that user's previous stream_id.
-- deleted: the row says the device was deleted (federation's m.device_list_update "deleted").
ALTER TABLE device_lists_stream ADD COLUMN deleted BOOLEAN NOT NULL DEFAULT FALSE;

-- Remote users whose device lists this server caches: the stream_id of the last update
-- applied (or of the resync), and whether an update was missed (stale: ask their server).
CREATE TABLE remote_device_lists (
    user_id TEXT PRIMARY KEY,
    stream_id BIGINT NOT NULL,
    stale BOOLEAN NOT NULL DEFAULT FALSE
);

-- Remote users' devices (their keys are in e2e_device_keys, beside local devices' keys).
CREATE TABLE remote_devices (
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    display_name TEXT,
    PRIMARY KEY (user_id, device_id)
);

-- Fallback keys: one per (device, algorithm), handed out when no one-time key is left;
-- used: handed out at least once since it was uploaded.
CREATE TABLE e2e_fallback_keys (
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    algorithm TEXT NOT NULL,
    key_id TEXT NOT NULL,
    key_json TEXT NOT NULL,
    used BOOLEAN NOT NULL DEFAULT FALSE,
    PRIMARY KEY (user_id, device_id, algorithm)
);

-- Cross-signing keys (master, self_signing, user_signing) of local users, and the master and
-- self-signing keys of remote users as their servers gave them.
CREATE TABLE e2e_cross_signing_keys (
    user_id TEXT NOT NULL,
    key_type TEXT NOT NULL CHECK (key_type IN ('master', 'self_signing', 'user_signing')),
    key_json TEXT NOT NULL,
    PRIMARY KEY (user_id, key_type)
);

-- Signatures uploaded with /keys/signatures/upload: signer's key (signing_key_id, e.g.
-- "ed25519:<public key>") over a target user's device or cross-signing key (target_key_id:
-- a device ID or a public key).
CREATE TABLE e2e_cross_signing_signatures (
    signer_user_id TEXT NOT NULL,
    signing_key_id TEXT NOT NULL,
    target_user_id TEXT NOT NULL,
    target_key_id TEXT NOT NULL,
    signature TEXT NOT NULL,
    PRIMARY KEY (signer_user_id, signing_key_id, target_user_id, target_key_id)
);
CREATE INDEX e2e_cross_signing_signatures_target ON e2e_cross_signing_signatures (target_user_id);

-- Server-side key backup (/room_keys): a user's backup versions (the newest not deleted is
-- current; etag moves on with every change of its keys) and the backed-up session keys.
CREATE TABLE e2e_room_keys_versions (
    user_id TEXT NOT NULL,
    version BIGINT NOT NULL,
    algorithm TEXT NOT NULL,
    auth_data TEXT NOT NULL,
    etag BIGINT NOT NULL DEFAULT 0,
    deleted BOOLEAN NOT NULL DEFAULT FALSE,
    PRIMARY KEY (user_id, version)
);

CREATE TABLE e2e_room_keys (
    user_id TEXT NOT NULL,
    version BIGINT NOT NULL,
    room_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    first_message_index BIGINT NOT NULL,
    forwarded_count BIGINT NOT NULL,
    is_verified BOOLEAN NOT NULL,
    session_data TEXT NOT NULL,
    PRIMARY KEY (user_id, version, room_id, session_id)
);
