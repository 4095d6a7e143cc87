-- Catch-up advances last_successful_stream_ordering room by room (to the newest
-- event of each room it finished), so once it has moved, rooms still waiting can
-- have older missed events below it. catch_up_from keeps where the destination
-- stood when catch-up began, so every room's missed events are found from there,
-- across restarts; it is cleared when catch-up finishes.
ALTER TABLE destinations ADD COLUMN catch_up_from BIGINT;
