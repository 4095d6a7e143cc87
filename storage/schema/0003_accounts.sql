-- Accounts: local users, their devices and access tokens, profiles and /sync
-- filters. Nothing here needs a room event. (Account data lives in the
-- account_data stream table of 0002_streams.sql.)

-- Local user accounts. password_hash is bcrypt over the SHA-256 of the password
-- (homeserver/handlers/auth.py says why); NULL when the account has no password.
CREATE TABLE users (
    user_id TEXT PRIMARY KEY,
    password_hash TEXT,
    created_ts BIGINT NOT NULL,
    is_guest BOOLEAN NOT NULL DEFAULT FALSE,
    deactivated BOOLEAN NOT NULL DEFAULT FALSE
);

-- A user's logged-in sessions. last_seen_* are updated at most every few minutes.
CREATE TABLE devices (
    user_id TEXT NOT NULL REFERENCES users (user_id),
    device_id TEXT NOT NULL,
    display_name TEXT,
    created_ts BIGINT NOT NULL,
    last_seen_ts BIGINT,
    last_seen_ip TEXT,
    PRIMARY KEY (user_id, device_id)
);

-- Access tokens, stored only as the SHA-256 of the token: a copy of this table
-- lets nobody act as the users. Every token belongs to one device.
CREATE TABLE access_tokens (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    token_sha256 BYTEA NOT NULL UNIQUE,
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    created_ts BIGINT NOT NULL,
    FOREIGN KEY (user_id, device_id) REFERENCES devices (user_id, device_id)
);
CREATE INDEX access_tokens_device ON access_tokens (user_id, device_id);

-- Display names and avatars of local users (global, not per room).
CREATE TABLE profiles (
    user_id TEXT PRIMARY KEY REFERENCES users (user_id),
    displayname TEXT,
    avatar_url TEXT
);

-- Uploaded /sync filters. Uploading the same filter twice returns the same ID.
CREATE TABLE user_filters (
    filter_id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id TEXT NOT NULL,
    filter_json TEXT NOT NULL,
    filter_sha256 BYTEA NOT NULL,
    UNIQUE (user_id, filter_sha256)
);
