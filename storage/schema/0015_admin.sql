-- Administration (docs/admin.md): server admins, registration tokens, blocked rooms,
-- server notice rooms.

-- Server admins may use the admin API (/_synapse/admin/...) and the operator console.
ALTER TABLE users ADD COLUMN admin BOOLEAN NOT NULL DEFAULT FALSE;

-- Registration tokens for the m.login.registration_token stage of /register.
-- uses_allowed NULL: unlimited; expiry_time NULL: never expires. "pending" counts
-- registrations that passed the stage but have not completed yet; "completed" those
-- that did.
CREATE TABLE registration_tokens (
    token TEXT PRIMARY KEY,
    uses_allowed INTEGER,
    pending INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    expiry_time BIGINT
);

-- Rooms an admin blocked: local users may not join them (delete room with "block").
CREATE TABLE blocked_rooms (
    room_id TEXT PRIMARY KEY,
    user_id TEXT NOT NULL,
    blocked_ts BIGINT NOT NULL
);

-- The room each local user gets server notices in, from the server notices user.
CREATE TABLE server_notice_rooms (
    user_id TEXT PRIMARY KEY,
    room_id TEXT NOT NULL
);
