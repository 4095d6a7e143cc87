"""The operator console: one HTML page (no front-end framework) at ``/_tributary/console/``
on listeners with the ``admin`` resource, and the one JSON document it needs beyond the
admin API (``/_tributary/console/status``: processes, stream positions, replication
connections, the federation sender's in-memory queues).

The page asks for an admin's access token, keeps it in the tab's sessionStorage, and
reads everything through admin-only endpoints with it; the page itself holds no data,
so serving it to anyone reveals nothing (``Caller.NONE``; the status is ``Caller.ADMIN``).
"""

# tests: tests/integration/test_admin_console.py

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from homeserver.http.routes import Call, Caller, Response, route

CONSOLE_PAGE: Final = b"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Tributary console</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
 h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
 table { border-collapse: collapse; font-size: 0.9em; }
 th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
 th { background: #f0f0f0; }
 .bad { color: #a00; } .ok { color: #070; } #error { color: #a00; }
 code { font-size: 0.95em; }
</style>
</head>
<body>
<h1>Tributary console <span id="server"></span></h1>
<form id="login">
 <label>Admin access token <input id="token" type="password" size="50" autocomplete="off"></label>
 <button type="submit">Show</button>
</form>
<p id="error"></p>
<div id="content" hidden>
 <h2>Processes</h2><table id="processes"></table>
 <h2>Replication</h2><table id="replication"></table>
 <h2>Federation destinations</h2><table id="destinations"></table>
 <h2>Users</h2><table id="users"></table>
 <h2>Rooms</h2><table id="rooms"></table>
</div>
<script>
"use strict";
const tokenInput = document.getElementById("token");
tokenInput.value = sessionStorage.getItem("tributary_admin_token") || "";

async function get(path) {
  const response = await fetch(path, {headers: {"Authorization": "Bearer " + tokenInput.value}});
  const body = await response.json();
  if (!response.ok) { throw new Error(path + ": " + (body.error || response.status)); }
  return body;
}

function fill(id, columns, rows) {
  const table = document.getElementById(id);
  table.replaceChildren();
  const head = table.insertRow();
  for (const column of columns) {
    const th = document.createElement("th");
    th.textContent = column[0];
    head.appendChild(th);
  }
  for (const row of rows) {
    const tr = table.insertRow();
    for (const column of columns) {
      const value = column[1](row);
      tr.insertCell().textContent = value === null || value === undefined ? "" : String(value);
    }
  }
  if (rows.length === 0) { table.insertRow().insertCell().textContent = "none"; }
}

function when(ms) { return ms ? new Date(ms).toISOString().replace(".000", "") : ""; }

async function show() {
  document.getElementById("error").textContent = "";
  try {
    const [status, users, rooms, destinations] = await Promise.all([
      get("/_tributary/console/status"),
      get("/_synapse/admin/v2/users?limit=100&deactivated=true"),
      get("/_synapse/admin/v1/rooms?limit=100&order_by=joined_members&dir=b"),
      get("/_synapse/admin/v1/federation/destinations?limit=100"),
    ]);
    sessionStorage.setItem("tributary_admin_token", tokenInput.value);
    document.getElementById("server").textContent = "- " + status.server_name + " (" + status.version + ")";
    fill("processes", [["process", p => p.name], ["app", p => p.app],
                       ["writes", p => p.writes.join(", ")],
                       ["stream positions", p => Object.entries(p.positions).map(e => e[0] + "=" + e[1]).join(" ")]],
         status.processes);
    fill("replication", [["transport", r => r.transport], ["peer", r => r.peer]],
         status.replication.connections.length ? status.replication.connections
                                               : [{transport: status.replication.transport, peer: ""}]);
    const queues = Object.fromEntries(status.sender.map(d => [d.destination, d]));
    fill("destinations", [["destination", d => d.destination],
                          ["queue (PDUs / EDUs)", d => queues[d.destination] ?
                              queues[d.destination].pending_pdus + " / " + queues[d.destination].pending_edus : ""],
                          ["backoff", d => d.retry_interval ? Math.round(d.retry_interval / 1000) + " s" : "none"],
                          ["failing since", d => when(d.failure_ts)],
                          ["catch-up", d => (queues[d.destination] && queues[d.destination].catching_up) ||
                              d.catch_up_from !== null ? "catching up" : ""],
                          ["rooms behind", d => d.rooms_behind],
                          ["acknowledged up to", d => d.last_successful_stream_ordering]],
         destinations.destinations);
    fill("users", [["user", u => u.name], ["display name", u => u.displayname], ["admin", u => u.admin],
                   ["deactivated", u => u.deactivated], ["guest", u => u.is_guest], ["created", u => when(u.creation_ts)]],
         users.users);
    fill("rooms", [["room", r => r.room_id], ["name", r => r.name], ["alias", r => r.canonical_alias],
                   ["joined", r => r.joined_members], ["local", r => r.joined_local_members],
                   ["version", r => r.version], ["public", r => r.public]],
         rooms.rooms);
    document.getElementById("content").hidden = false;
    document.body.dataset.loaded = "true";
  } catch (e) {
    document.getElementById("error").textContent = e.message;
  }
}

document.getElementById("login").addEventListener("submit", event => { event.preventDefault(); show(); });
if (tokenInput.value) { show(); }
</script>
</body>
</html>
"""


class ConsoleServlets:
    """The page (anyone may load it; it holds no data) and its admin-only status document."""

    def __init__(self, status: Callable[[], Mapping[str, Any]]) -> None:
        self._status = status

    @route("GET", r"/_tributary/console/?", "console_page", caller=Caller.NONE)
    async def page(self, call: Call) -> Response:
        request = call.request
        request.setHeader(b"Content-Type", b"text/html; charset=utf-8")
        request.setHeader(b"Content-Security-Policy",
                          b"default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'")
        request.setHeader(b"X-Frame-Options", b"DENY")
        return 200, CONSOLE_PAGE

    @route("GET", r"/_tributary/console/status", "console_status", caller=Caller.ADMIN)
    async def get_status(self, call: Call) -> Response:
        return 200, dict(self._status())
