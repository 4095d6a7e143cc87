-- Relations, full-text search and the room directory (issue 22; docs/client-api.md).
--
-- The relations index and the search vector are filled by a trigger on `events`, so they
-- are written by whichever process persists the event (the events stream's writer for the
-- room), in the event's own transaction, without another round trip. The trigger reads the
-- stored PDU JSON; a PDU PostgreSQL's jsonb refuses (a \u0000 escape) is stored, not indexed.
-- Readers (storage/stores/relations.py, storage/stores/search.py) only count rows whose
-- event is live (not an outlier, not rejected, not soft-failed) and not redacted.

-- One row per event that names a parent in content."m.relates_to" (rel_type and event_id).
CREATE TABLE event_relations (
    event_id TEXT PRIMARY KEY,
    relates_to_id TEXT NOT NULL,
    relation_type TEXT NOT NULL,
    room_id TEXT NOT NULL,
    -- m.annotation's key (the reaction), kept for later aggregation.
    aggregation_key TEXT
);
CREATE INDEX event_relations_parent ON event_relations (relates_to_id, relation_type);
-- /threads: the thread roots of a room.
CREATE INDEX event_relations_room_threads ON event_relations (room_id, relates_to_id)
    WHERE relation_type = 'm.thread';

-- Full-text search over m.room.message bodies and room names and topics (POST /search).
ALTER TABLE events ADD COLUMN search_vector tsvector;
CREATE INDEX events_search_vector ON events USING GIN (search_vector);

CREATE FUNCTION events_index_content() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    pdu jsonb;
    rel jsonb;
    searched text;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        DELETE FROM event_relations WHERE event_id = NEW.event_id;
        NEW.search_vector := NULL;
    END IF;
    IF strpos(NEW.json, 'm.relates_to') = 0
            AND NEW.type NOT IN ('m.room.message', 'm.room.name', 'm.room.topic') THEN
        RETURN NEW;
    END IF;
    BEGIN
        pdu := NEW.json::jsonb;
    EXCEPTION WHEN others THEN
        RETURN NEW;
    END;
    IF jsonb_typeof(pdu->'content') <> 'object' THEN
        RETURN NEW;
    END IF;
    searched := CASE
        WHEN NEW.type = 'm.room.message' THEN pdu->'content'->'body'
        WHEN NEW.type = 'm.room.name' AND NEW.state_key = '' THEN pdu->'content'->'name'
        WHEN NEW.type = 'm.room.topic' AND NEW.state_key = '' THEN pdu->'content'->'topic'
    END #>> '{}';
    IF searched IS NOT NULL THEN
        NEW.search_vector := to_tsvector('english', left(searched, 65536));
    END IF;
    rel := pdu->'content'->'m.relates_to';
    IF jsonb_typeof(rel) = 'object' AND jsonb_typeof(rel->'rel_type') = 'string'
            AND jsonb_typeof(rel->'event_id') = 'string' THEN
        INSERT INTO event_relations (event_id, relates_to_id, relation_type, room_id, aggregation_key)
        VALUES (NEW.event_id, left(rel->>'event_id', 512), left(rel->>'rel_type', 255), NEW.room_id,
                CASE WHEN jsonb_typeof(rel->'key') = 'string' THEN left(rel->>'key', 512) END)
        ON CONFLICT (event_id) DO NOTHING;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER events_index_content BEFORE INSERT OR UPDATE OF json ON events
    FOR EACH ROW EXECUTE FUNCTION events_index_content();

-- Events stored before this migration are indexed too.
UPDATE events SET json = json WHERE strpos(json, 'm.relates_to') > 0
    OR type IN ('m.room.message', 'm.room.name', 'm.room.topic');

-- The room directory: rooms published in /publicRooms (PUT /directory/list/room/{roomId}).
-- Written by the main process; read anywhere.
CREATE TABLE room_directory (
    room_id TEXT PRIMARY KEY,
    published_ts BIGINT NOT NULL
);
