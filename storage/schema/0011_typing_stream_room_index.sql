-- Pruning superseded typing rows (each row is a room's whole typing set) finds a room's
-- newer rows by this index.
CREATE INDEX typing_stream_room_idx ON typing_stream (room_id, stream_id);
