-- A local send's push context kept in memory (issue 25; docs/push.md "Evaluation and
-- notification records", docs/client-api.md "Send throughput").
--
-- Push evaluation reads, per room, the room's own state (members, display names, member
-- count, power levels) and, per local member, their stored m.push_rules and whether they have
-- an http pusher. The room's writer keeps the last copy it read with the room's snapshot:
-- its room part is the writer's own (it stays valid while the room's extremities are those it
-- last left, which the send's batch checks already), and the users' part is vouched for by
-- this one counter, bumped by every change to a user's m.push_rules or to a pusher, whichever
-- process makes it. The send's batch checks the counter is still the one the copy was read at
-- (push_context_as_expected, in the statement that checks the room's extremities) and
-- otherwise raises SQLSTATE TQ001, as a stale room does
-- (storage/stores/events.py: StaleRoomContext): the send is built again on a fresh read.
-- A row, not a sequence: a sequence moves before the change commits, so a send could read the
-- old rules at the new version and keep them. Writers of push rules and pushers so take the
-- row's lock until they commit (rare writes; a deadlock between two is retried by the pool).
CREATE TABLE push_context_version (
    only_row BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (only_row),
    version BIGINT NOT NULL
);
INSERT INTO push_context_version (only_row, version) VALUES (TRUE, 0);

CREATE FUNCTION push_context_version_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE push_context_version SET version = version + 1;
    RETURN NULL;
END
$$;

-- User-level m.push_rules only (room-level account data of that type means nothing to push).
-- An upsert that updates fires the UPDATE trigger, not the INSERT one.
CREATE TRIGGER push_context_rules_inserted AFTER INSERT ON account_data FOR EACH ROW
    WHEN (NEW.account_data_type = 'm.push_rules' AND NEW.room_id IS NULL)
    EXECUTE FUNCTION push_context_version_bump();
CREATE TRIGGER push_context_rules_updated AFTER UPDATE ON account_data FOR EACH ROW
    WHEN ((NEW.account_data_type = 'm.push_rules' AND NEW.room_id IS NULL)
          OR (OLD.account_data_type = 'm.push_rules' AND OLD.room_id IS NULL))
    EXECUTE FUNCTION push_context_version_bump();
CREATE TRIGGER push_context_rules_deleted AFTER DELETE ON account_data FOR EACH ROW
    WHEN (OLD.account_data_type = 'm.push_rules' AND OLD.room_id IS NULL)
    EXECUTE FUNCTION push_context_version_bump();

-- Who has a pusher of which kind; a delivery's progress (last_stream_ordering, failing_since)
-- changes nothing here. Per row, so that a statement that changes none (a periodic clean-up
-- finding nothing) does not bump it.
CREATE TRIGGER push_context_pushers_changed AFTER INSERT OR DELETE OR UPDATE OF user_id, kind ON pushers
    FOR EACH ROW EXECUTE FUNCTION push_context_version_bump();

-- ``current_version``: the version as the calling statement read it (a scalar subquery there,
-- cheaper than a query of the function's own); ``kept_version`` NULL: the caller kept no copy,
-- nothing to check.
CREATE FUNCTION push_context_as_expected(room TEXT, kept_version BIGINT, current_version BIGINT) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF kept_version IS NOT NULL AND current_version IS DISTINCT FROM kept_version THEN
        RAISE EXCEPTION 'room %: push rules or pushers changed since its push context was read (version % -> %)',
                        room, kept_version, current_version
            USING ERRCODE = 'TQ001';
    END IF;
END
$$;
