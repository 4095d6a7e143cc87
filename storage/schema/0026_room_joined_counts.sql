-- Big rooms: what every event's push evaluation reads of its room without reading every member
-- (issue 25; docs/push.md "Evaluation and notification records").
--
-- A room's joined member count (push rules' room_member_count), kept by statement-level
-- triggers on current_state_events from the rows each statement changed, so every writer of
-- current state (a send's upsert, state resolution, a join's bulk COPY, a partial-state
-- resync, the admin API's purge) keeps it without knowing of it. Written by whichever process
-- writes the room's current state; read by the room's event writer.
CREATE TABLE room_joined_counts (
    room_id TEXT PRIMARY KEY,
    joined BIGINT NOT NULL
);

CREATE FUNCTION room_joined_counts_add(changes_room TEXT[], changes_delta BIGINT[]) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO room_joined_counts (room_id, joined)
    SELECT r, sum(d) FROM unnest(changes_room, changes_delta) AS x(r, d) GROUP BY r HAVING sum(d) <> 0
    ON CONFLICT (room_id) DO UPDATE SET joined = room_joined_counts.joined + EXCLUDED.joined;
$$;

CREATE FUNCTION room_joined_counts_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM room_joined_counts_add(array_agg(room_id), array_agg(1::bigint))
    FROM new_rows WHERE type = 'm.room.member' AND membership = 'join';
    RETURN NULL;
END
$$;

CREATE FUNCTION room_joined_counts_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM room_joined_counts_add(array_agg(room_id), array_agg(-1::bigint))
    FROM old_rows WHERE type = 'm.room.member' AND membership = 'join';
    RETURN NULL;
END
$$;

CREATE FUNCTION room_joined_counts_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM room_joined_counts_add(array_agg(room_id), array_agg(delta))
    FROM (SELECT room_id, 1::bigint AS delta FROM new_rows WHERE type = 'm.room.member' AND membership = 'join'
          UNION ALL
          SELECT room_id, -1::bigint FROM old_rows WHERE type = 'm.room.member' AND membership = 'join') AS changes;
    RETURN NULL;
END
$$;

CREATE TRIGGER room_joined_counts_inserted AFTER INSERT ON current_state_events
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION room_joined_counts_inserted();
CREATE TRIGGER room_joined_counts_deleted AFTER DELETE ON current_state_events
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION room_joined_counts_deleted();
CREATE TRIGGER room_joined_counts_updated AFTER UPDATE ON current_state_events
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION room_joined_counts_updated();

INSERT INTO room_joined_counts (room_id, joined)
SELECT room_id, count(*) FROM current_state_events
WHERE type = 'm.room.member' AND membership = 'join' GROUP BY room_id;

-- A room's joined members of one server (this one's, for push evaluation), found without
-- reading the others: user IDs are '@localpart:server', and a localpart has no ':'.
CREATE INDEX current_state_joined_by_server ON current_state_events
    (room_id, (substring(state_key FROM position(':' IN state_key) + 1)))
    WHERE type = 'm.room.member' AND membership = 'join';
