"""The third-party identifier endpoints of a server with no email/SMS sending and no identity server.

Each answers as the client-server spec allows for that case (docs/client-api.md,
"Third-party identifiers"), after validating its body, and changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.integration.test_client_support import running_server

EMAIL_TOKEN = {"client_secret": "s3cret.=_-", "email": "alice@example.org", "send_attempt": 1}
MSISDN_TOKEN = {"client_secret": "s3cret", "country": "GB", "phone_number": "07700900001", "send_attempt": 1}


async def test_request_token_endpoints_refuse_an_unsupported_medium(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (_, client):
        token = (await client.register_ok("alice"))["access_token"]
        for prefix in ("account/3pid", "register", "account/password"):
            for medium, body in (("email", EMAIL_TOKEN), ("msisdn", MSISDN_TOKEN)):
                path = f"{prefix}/{medium}/requestToken"
                answer = await client.request("POST", path, body, token=token)
                assert (answer.status, answer.errcode) == (400, "M_THREEPID_MEDIUM_NOT_SUPPORTED"), (path, answer)
                # A malformed body is told so first.
                missing = await client.request("POST", path, {"client_secret": "s3cret"}, token=token)
                assert (missing.status, missing.errcode) == (400, "M_MISSING_PARAM"), (path, missing)
                bad_secret = await client.request("POST", path, {**body, "client_secret": "no spaces"}, token=token)
                assert (bad_secret.status, bad_secret.errcode) == (400, "M_INVALID_PARAM"), (path, bad_secret)
                bad_attempt = await client.request("POST", path, {**body, "send_attempt": "1"}, token=token)
                assert (bad_attempt.status, bad_attempt.errcode) == (400, "M_BAD_JSON"), (path, bad_attempt)
        # No other medium is routed.
        other = await client.request("POST", "account/3pid/carrier-pigeon/requestToken", EMAIL_TOKEN, token=token)
        assert other.status == 404


async def test_account_threepids_are_empty_and_cannot_be_added_or_bound(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (_, client):
        token = (await client.register_ok("alice"))["access_token"]
        assert (await client.request("GET", "account/3pid")).status == 401
        listed = await client.request("GET", "account/3pid", token=token)
        assert listed.status == 200 and listed.body == {"threepids": []}

        add_body: dict[str, Any] = {"client_secret": "s3cret", "sid": "session1"}
        first = await client.request("POST", "account/3pid/add", add_body, token=token)
        assert first.status == 401 and first.body["flows"] == [{"stages": ["m.login.password"]}]
        auth = {
            "type": "m.login.password",
            "identifier": {"type": "m.id.user", "user": "alice"},
            "password": "password",
            "session": first.body["session"],
        }
        added = await client.request("POST", "account/3pid/add", {**add_body, "auth": auth}, token=token)
        assert (added.status, added.errcode) == (400, "M_THREEPID_AUTH_FAILED")
        no_sid = await client.request("POST", "account/3pid/add", {"client_secret": "s3cret"}, token=token)
        assert (no_sid.status, no_sid.errcode) == (400, "M_MISSING_PARAM")

        bind_body = {"client_secret": "s3cret", "sid": "session1", "id_server": "id.example.org", "id_access_token": "t"}
        bound = await client.request("POST", "account/3pid/bind", bind_body, token=token)
        assert (bound.status, bound.errcode) == (400, "M_SERVER_NOT_TRUSTED")
        no_server = await client.request("POST", "account/3pid/bind", {**bind_body, "id_server": None}, token=token)
        assert (no_server.status, no_server.errcode) == (400, "M_MISSING_PARAM")
        assert (await client.request("GET", "account/3pid", token=token)).body == {"threepids": []}


async def test_delete_and_unbind_report_no_identity_server(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (_, client):
        token = (await client.register_ok("alice"))["access_token"]
        for path in ("account/3pid/delete", "account/3pid/unbind"):
            body = {"medium": "email", "address": "alice@example.org"}
            answer = await client.request("POST", path, body, token=token)
            assert answer.status == 200 and answer.body == {"id_server_unbind_result": "no-support"}, (path, answer)
            with_server = await client.request("POST", path, {**body, "id_server": "id.example.org"}, token=token)
            assert with_server.body == {"id_server_unbind_result": "no-support"}
            bad_medium = await client.request("POST", path, {**body, "medium": "fax"}, token=token)
            assert (bad_medium.status, bad_medium.errcode) == (400, "M_INVALID_PARAM")
            no_address = await client.request("POST", path, {"medium": "email"}, token=token)
            assert (no_address.status, no_address.errcode) == (400, "M_MISSING_PARAM")
            assert (await client.request("POST", path, body)).status == 401
