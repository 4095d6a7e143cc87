-- Knocks of local users on rooms this server is not in (make_knock / send_knock, room
-- versions 7+): kept beside remote invites, with the room state the resident server returned
-- (knock_room_state) in invite_state, and shown in /sync rooms.knock until the knock is
-- accepted (an invite replaces the row), withdrawn (leave) or the user joins.
ALTER TABLE remote_invites DROP CONSTRAINT remote_invites_membership_check;
ALTER TABLE remote_invites ADD CONSTRAINT remote_invites_membership_check
    CHECK (membership IN ('invite', 'leave', 'knock'));
