-- The media repository (homeserver/media/, docs/media.md). Files live in a storage
-- provider (local disk by default) under the SHA-256 of their bytes, so identical
-- uploads share one file; these tables hold what is known about each media ID.
-- Written only by the process that serves media (the main process, or the
-- media_repository worker).

-- Quarantine and delete are for server admins: users.admin, added by 0015_admin.sql.

-- Media uploaded to this server. sha256 is NULL while an asynchronous upload
-- (POST /_matrix/media/v1/create) waits for its bytes; such a row expires at
-- unused_expires_ts. authenticated: stored while media.freeze_unauthenticated_media
-- was on, so never served by the unauthenticated endpoints (Matrix 1.11's freeze).
CREATE TABLE local_media (
    media_id TEXT PRIMARY KEY,
    user_id TEXT NOT NULL,
    created_ts BIGINT NOT NULL,
    content_type TEXT,
    upload_name TEXT,
    size BIGINT,
    sha256 TEXT,
    unused_expires_ts BIGINT,
    uploaded_ts BIGINT,
    last_access_ts BIGINT,
    quarantined_by TEXT,
    authenticated BOOLEAN NOT NULL DEFAULT FALSE
);
CREATE INDEX local_media_user_created ON local_media (user_id, created_ts);
CREATE INDEX local_media_sha256 ON local_media (sha256);
CREATE INDEX local_media_last_access ON local_media (last_access_ts);

-- Media of other servers, fetched for our clients and kept as a cache.
CREATE TABLE remote_media (
    origin TEXT NOT NULL,
    media_id TEXT NOT NULL,
    content_type TEXT,
    upload_name TEXT,
    size BIGINT NOT NULL,
    sha256 TEXT NOT NULL,
    fetched_ts BIGINT NOT NULL,
    last_access_ts BIGINT NOT NULL,
    quarantined_by TEXT,
    authenticated BOOLEAN NOT NULL DEFAULT FALSE,
    PRIMARY KEY (origin, media_id)
);
CREATE INDEX remote_media_sha256 ON remote_media (sha256);
CREATE INDEX remote_media_last_access ON remote_media (last_access_ts);

-- Thumbnails of local and remote media (origin is our server name for local media).
CREATE TABLE media_thumbnails (
    origin TEXT NOT NULL,
    media_id TEXT NOT NULL,
    width INTEGER NOT NULL,
    height INTEGER NOT NULL,
    method TEXT NOT NULL,
    animated BOOLEAN NOT NULL,
    content_type TEXT NOT NULL,
    size BIGINT NOT NULL,
    sha256 TEXT NOT NULL,
    PRIMARY KEY (origin, media_id, width, height, method, animated)
);
CREATE INDEX media_thumbnails_sha256 ON media_thumbnails (sha256);
