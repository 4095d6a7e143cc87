-- Device-list updates survive a destination's downtime (issue 29): how far along the
-- device_lists stream each destination has acknowledged our users' changes. It moves only
-- when a transaction carrying the updates up to it is accepted; the sender sends, per local
-- user sharing a room with the destination, the newest change above it. NULL: no change was
-- ever meant for the destination (the first one sets it just below itself).
ALTER TABLE destinations ADD COLUMN device_lists_position BIGINT;
-- Existing destinations were told of every change so far (or lost it already).
UPDATE destinations SET device_lists_position = (SELECT COALESCE(MAX(stream_id), 0) FROM device_lists_stream);
