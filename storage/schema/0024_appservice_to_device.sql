-- Application services' to-device messages (MSC2409) are read from the to_device stream above
-- each service's own position, like its events, instead of being held in memory: a restart or
-- a service that is down loses none (docs/appservices.md). NULL until the service is first
-- followed, which starts it at the stream's position then.
ALTER TABLE appservice_stream_positions
    ADD COLUMN to_device_position BIGINT,
    ADD COLUMN pending_to_device_upto BIGINT;
