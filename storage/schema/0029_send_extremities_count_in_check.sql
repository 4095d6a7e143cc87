-- The count of a room's forward extremities that a local send's check compares
-- (0027_send_extremities_check) moves into the check, whose settings leave the planner one way
-- to count: walking the primary key's index in order, which marks the index entries of
-- deleted extremities dead as it passes them. Each send deletes the extremity the send before
-- it made, so a plan that marks nothing (a bitmap scan, or a sequential scan of a small table)
-- walks every extremity replaced since the last vacuum. As a subquery of the send's statement
-- the count was an index scan on most statistics and a bitmap scan on others: on a new
-- database, and in a clean-clone test run.
-- STABLE: the count sees the calling statement's snapshot, as the subquery did (the event's
-- own extremity in, its prev events not yet out).
-- An overload (its fourth argument is the count's limit, an INT, where 0027's takes the count,
-- a BIGINT): 0027's stays for the processes of a worker layout still running the code before
-- this migration until they are restarted; a later migration may drop it.
CREATE FUNCTION send_extremities_as_expected(room TEXT, deleted BIGINT, expected_deleted BIGINT,
                                             count_limit INT, expected_counted BIGINT) RETURNS void
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    counted BIGINT;
BEGIN
    SELECT count(*) INTO counted
    FROM (SELECT 1 FROM event_forward_extremities WHERE room_id = room
          ORDER BY room_id, event_id LIMIT count_limit) AS known;
    IF deleted <> expected_deleted OR counted <> expected_counted THEN
        RAISE EXCEPTION 'room %: expected % forward extremities including the event''s prev_events, '
                        'found % or more of which % were its prev_events', room, expected_counted - 1,
                        counted - 1, deleted
            USING ERRCODE = 'TQ001';
    END IF;
END
$$;
