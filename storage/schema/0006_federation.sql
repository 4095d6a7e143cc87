-- Federation: inbound transactions already answered, and other servers' verified key responses.

-- One row per (origin, txnId) we answered: a repeat gets the same response.
CREATE TABLE received_transactions (
    origin TEXT NOT NULL,
    transaction_id TEXT NOT NULL,
    response_json TEXT NOT NULL,
    received_ts BIGINT NOT NULL,
    PRIMARY KEY (origin, transaction_id)
);
CREATE INDEX received_transactions_ts ON received_transactions (received_ts);

-- The last verified /_matrix/key/v2/server response of each server, as received
-- (so that we can serve it, counter-signed, as a notary) with when we fetched it.
CREATE TABLE server_keys_json (
    server_name TEXT PRIMARY KEY,
    response_json TEXT NOT NULL,
    fetched_ts BIGINT NOT NULL
);
