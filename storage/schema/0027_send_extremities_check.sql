-- A local send's check that the room did not change under it (docs/client-api.md, "Send
-- throughput"): the send is built on the room's forward extremities as its writer last left
-- them, and its transaction ends with this check and COMMIT in one round trip. Raises SQLSTATE
-- TQ001 (storage/stores/events.py: StaleRoomContext) when the event's prev events were not all
-- extremities or the room has extremities the send did not know of: another writer's; the
-- send's transaction then rolls back and the event is built again.
CREATE FUNCTION send_extremities_as_expected(room TEXT, deleted BIGINT, expected_deleted BIGINT,
                                             counted BIGINT, expected_counted BIGINT) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF deleted <> expected_deleted OR counted <> expected_counted THEN
        RAISE EXCEPTION 'room %: expected % forward extremities including the event''s prev_events, '
                        'found % or more of which % were its prev_events', room, expected_counted - 1,
                        counted - 1, deleted
            USING ERRCODE = 'TQ001';
    END IF;
END
$$;
