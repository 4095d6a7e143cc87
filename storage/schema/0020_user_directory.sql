-- The user directory (issue 22; docs/client-api.md "User directory"): who may be found by
-- POST /user_directory/search, kept by one process (the `background` worker when the config has
-- one, else the main process: workers/user_directory.py) following the events stream.
--
-- The updater reads the rooms whose state changed since its stored position and rewrites their
-- rows from current state, so these tables are a copy of current state, never a second truth.

-- Joined members of every room this server knows, with the name and avatar of their member event.
CREATE TABLE user_directory_members (
    room_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    display_name TEXT,
    avatar_url TEXT,
    PRIMARY KEY (room_id, user_id)
);
CREATE INDEX user_directory_members_user ON user_directory_members (user_id);

-- Rooms whose join rule is `public`: their members may be found by anyone.
CREATE TABLE user_directory_public_rooms (
    room_id TEXT PRIMARY KEY
);

-- How far along the events stream the updater has applied (one row).
CREATE TABLE user_directory_position (
    lock CHAR(1) NOT NULL DEFAULT 'X' UNIQUE CHECK (lock = 'X'),
    stream_id BIGINT NOT NULL
);
INSERT INTO user_directory_position (stream_id) VALUES (0);
