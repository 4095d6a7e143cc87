// matrix-js-sdk, unmodified from npm (package.json), syncing two users against Tributary with
// simplified sliding sync (MSC4186) and its Rust crypto: rooms, messages, typing and an
// encrypted DM. Run by tests/integration/test_sliding_sync_js.py:
//
//   node sliding_sync_client.mjs BASE_URL '{"alice": {user_id, access_token, device_id}, "bob": {...}}'
//
// Prints one JSON line of what Bob's client saw, and exits 0 when every step worked (1 otherwise).

import * as sdk from "matrix-js-sdk";
import { SlidingSync } from "matrix-js-sdk/lib/sliding-sync.js";
import { logger } from "matrix-js-sdk/lib/logger.js";

logger.setLevel("warn");
const [baseUrl, usersJson] = process.argv.slice(2);
const users = JSON.parse(usersJson);
const STEP_TIMEOUT_MS = 30000;

function waitFor(what, check, emitter, events) {
    return new Promise((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error(`timed out waiting for ${what}`)), STEP_TIMEOUT_MS);
        const poll = () => {
            const value = check();
            if (value) {
                clearTimeout(timer);
                for (const event of events) emitter.off(event, poll);
                clearInterval(interval);
                resolve(value);
            }
        };
        for (const event of events) emitter.on(event, poll);
        const interval = setInterval(poll, 200);
        poll();
    });
}

async function start(name) {
    const { user_id: userId, access_token: accessToken, device_id: deviceId } = users[name];
    const client = sdk.createClient({ baseUrl, accessToken, userId, deviceId });
    await client.initRustCrypto({ useIndexedDB: false });
    const roomConfig = { timeline_limit: 10, required_state: [["*", "*"]] };
    const lists = new Map([["all", { ranges: [[0, 49]], ...roomConfig }]]);
    const slidingSync = new SlidingSync(baseUrl, lists, roomConfig, client, 10000);
    await client.startClient({ slidingSync });
    await waitFor(`${name}'s first sync`, () => client.isInitialSyncComplete(), client, ["sync"]);
    return client;
}

function timelineBodies(client, roomId) {
    const room = client.getRoom(roomId);
    if (!room) return [];
    return room.getLiveTimeline().getEvents().map((e) => e.getContent()?.body).filter((b) => b !== undefined);
}

const seen = {};
let alice, bob;
try {
    alice = await start("alice");
    bob = await start("bob");

    // A public room: Bob joins, Alice writes, Bob's client shows the room by name with the message.
    const { room_id: lobby } = await alice.createRoom({ name: "Lobby", preset: "public_chat" });
    await bob.joinRoom(lobby);
    await alice.sendTextMessage(lobby, "hello over sliding sync");
    await waitFor("the message in Bob's client", () => timelineBodies(bob, lobby).includes("hello over sliding sync"),
        bob, ["Room.timeline", "sync"]);
    seen.lobby_name = bob.getRoom(lobby).name;
    seen.lobby_members = bob.getRoom(lobby).getJoinedMemberCount();

    // Typing: the typing extension.
    await alice.sendTyping(lobby, true, 20000);
    await waitFor("Alice typing in Bob's client",
        () => bob.getRoom(lobby)?.getMember(users.alice.user_id)?.typing === true, bob, ["RoomMember.typing", "sync"]);
    seen.typing = true;

    // An encrypted DM: Alice's client encrypts for Bob's device (keys claimed, a room key sent
    // to-device), Bob's client decrypts.
    const { room_id: dm } = await alice.createRoom({
        is_direct: true, preset: "trusted_private_chat", invite: [users.bob.user_id],
        initial_state: [{ type: "m.room.encryption", state_key: "", content: { algorithm: "m.megolm.v1.aes-sha2" } }],
    });
    await waitFor("the invite in Bob's client", () => bob.getRoom(dm)?.getMyMembership() === "invite", bob,
        ["Room.myMembership", "sync"]);
    await bob.joinRoom(dm);
    await waitFor("Bob's join in Alice's client", () => alice.getRoom(dm)?.getMember(users.bob.user_id)?.membership === "join",
        alice, ["RoomMember.membership", "sync"]);
    await alice.sendTextMessage(dm, "a secret");
    const secret = await waitFor("the decrypted message in Bob's client", () => {
        const events = bob.getRoom(dm)?.getLiveTimeline().getEvents() ?? [];
        return events.find((e) => e.isEncrypted() && e.getContent()?.body === "a secret");
    }, bob, ["Event.decrypted", "Room.timeline", "sync"]);
    seen.dm_encrypted = secret.isEncrypted();
    seen.dm_body = secret.getContent().body;
    seen.dm_type = secret.getWireType();
    console.log(JSON.stringify(seen));
    alice.stopClient();
    bob.stopClient();
    process.exit(0);
} catch (error) {
    console.log(JSON.stringify({ ...seen, error: String(error?.stack ?? error) }));
    alice?.stopClient();
    bob?.stopClient();
    process.exit(1);
}
