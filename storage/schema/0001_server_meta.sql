-- Which server this database belongs to. A database holds one server's users,
-- rooms and keys; starting a server with another name against it is refused.
CREATE TABLE server_meta (
    lock CHAR(1) NOT NULL DEFAULT 'X' UNIQUE CHECK (lock = 'X'),
    server_name TEXT NOT NULL,
    created_ts BIGINT NOT NULL
);
