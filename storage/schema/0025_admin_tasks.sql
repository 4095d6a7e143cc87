-- The admin API's background tasks (room deletion v2, history purges; docs/admin.md): kept so
-- that their status outlives the process, and so that a task the process stopped under is run
-- again when the main process starts (both actions are idempotent). params: the JSON the
-- task's work is run with; result: its JSON result once complete.
CREATE TABLE admin_tasks (
    id TEXT PRIMARY KEY,
    action TEXT NOT NULL,
    resource_id TEXT NOT NULL,
    params TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('scheduled', 'active', 'complete', 'failed')),
    timestamp_ms BIGINT NOT NULL,
    result TEXT,
    error TEXT
);
CREATE INDEX admin_tasks_resource ON admin_tasks (resource_id, action);
CREATE INDEX admin_tasks_unfinished ON admin_tasks (timestamp_ms) WHERE status IN ('scheduled', 'active');
