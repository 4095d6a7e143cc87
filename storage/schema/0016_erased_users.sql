-- Users who deactivated their account with `erase: true` (POST /account/deactivate): their
-- events are served pruned, as though redacted, to users who were not joined when they were sent
-- (the spec's erasure: later joiners get redacted copies). Written by the main process only.
CREATE TABLE erased_users (
    user_id TEXT PRIMARY KEY REFERENCES users (user_id),
    erased_ts BIGINT NOT NULL
);
