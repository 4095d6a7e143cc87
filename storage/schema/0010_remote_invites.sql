-- Invites of local users to rooms this server is not in (PUT /_matrix/federation/v2/invite):
-- the cosigned invite event and the stripped room state the inviting server sent, shown in
-- /sync rooms.invite until the user joins or rejects. A rejection keeps the row as 'leave'
-- (with the leave event) so the next /sync reports the room under rooms.leave.
-- stream_ordering/instance_name: the events stream position of the latest change, so /sync
-- wakes and reads each change once (it takes no part in the room's timeline).
CREATE TABLE remote_invites (
    user_id TEXT NOT NULL,
    room_id TEXT NOT NULL,
    membership TEXT NOT NULL CHECK (membership IN ('invite', 'leave')),
    event_id TEXT NOT NULL,
    room_version TEXT NOT NULL,
    event_json TEXT NOT NULL,
    invite_state TEXT NOT NULL,
    stream_ordering BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    PRIMARY KEY (user_id, room_id)
);
