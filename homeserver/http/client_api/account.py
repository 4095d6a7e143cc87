"""Account servlets: /register, /register/available, /login, /logout, /logout/all, /account/whoami,
/account/password, /account/deactivate.

Each servlet parses and checks the request, then calls a handler. Registration
checks, in the spec's order: the account ``kind``, whether registration is
open, the rate limit, the username (``M_INVALID_USERNAME``, ``M_USER_IN_USE``,
before any user-interactive auth), then the ``m.login.dummy`` UIA stage.
"""

# tests: tests/integration/test_client_accounts.py, tests/integration/test_client_nio.py, tests/integration/test_client_guest.py

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

import attrs

from twisted.web.server import Request

from homeserver.appservice.registration import AppService
from homeserver.config import HomeserverConfig
from homeserver.handlers.accounts.auth import MAX_TOKEN_LENGTH, Auth, client_ip
from homeserver.handlers.accounts.deactivate import DeactivationHandler
from homeserver.handlers.accounts.login import LOGIN_TYPE_PASSWORD, LoginHandler, invalid_credentials, user_from_identifier
from homeserver.handlers.accounts.register import RegistrationHandler, RegistrationResult
from homeserver.handlers.server_info import client_well_known
from homeserver.handlers.accounts.ui_auth import LOGIN_DUMMY, LOGIN_PASSWORD, LOGIN_REGISTRATION_TOKEN, UserInteractiveAuth
from homeserver.events.validation import (
    MAX_DEVICE_DISPLAY_NAME_LENGTH,
    MAX_DEVICE_ID_LENGTH,
    MAX_PASSWORD_LENGTH,
    check_text,
)
from homeserver.http.client_api._base import (
    client_path,
    empty,
    optional_bool,
    optional_string,
    query_string,
    required_string,
)
from homeserver.http.routes import Body, Call, Caller, Response, route
from homeserver.http.server import JsonDict, parse_json_object, parse_optional_json_object
from storage.kernel.errors import MatrixError, bad_json, forbidden, invalid_param, missing_param

REGISTER_FLOWS: Final = ((LOGIN_DUMMY,),)
LOGIN_TYPE_APPLICATION_SERVICE: Final = "m.login.application_service"
# With ``registration_requires_token``: a registration token (made with the admin API) first.
TOKEN_REGISTER_FLOWS: Final = ((LOGIN_REGISTRATION_TOKEN,),)
PASSWORD_FLOWS: Final = ((LOGIN_PASSWORD,),)
MAX_USERNAME_LENGTH: Final = 255


@attrs.frozen
class RegisterParams:
    """The parameters of a ``POST /register`` that a UIA session remembers (in memory only)."""

    username: str | None
    password: str | None = attrs.field(repr=False)
    device_id: str | None
    initial_device_display_name: str | None
    inhibit_login: bool

    def filled_from(self, later: RegisterParams) -> RegisterParams:
        """These parameters, with the ones they lack taken from a later request of the session."""
        return RegisterParams(
            username=self.username if self.username is not None else later.username,
            password=self.password if self.password is not None else later.password,
            device_id=self.device_id if self.device_id is not None else later.device_id,
            initial_device_display_name=(
                self.initial_device_display_name
                if self.initial_device_display_name is not None
                else later.initial_device_display_name
            ),
            inhibit_login=self.inhibit_login or later.inhibit_login,
        )

    def any(self) -> bool:
        return (self.username, self.password, self.device_id, self.initial_device_display_name) != (
            None, None, None, None
        ) or self.inhibit_login


class RegistrationServlets:
    """``/register`` and its checks. Registration reads its own optional credentials (a
    service's ``as_token`` in the request, a guest's access token in the body), so it is
    declared for anyone; the rate limit comes after its own checks, and counts nothing here."""

    def __init__(self, config: HomeserverConfig, auth: Auth, registration: RegistrationHandler,
                 uia: UserInteractiveAuth, registration_token_valid: Callable[[str], Awaitable[bool]]) -> None:
        self._config = config
        self._auth = auth
        self._registration = registration
        self._uia = uia
        self._registration_token_valid = registration_token_valid
        self._flows = TOKEN_REGISTER_FLOWS if config.registration_requires_token else REGISTER_FLOWS

    @route("POST", client_path(r"/register"), "client_register", caller=Caller.NONE)
    async def post_register(self, call: Call) -> Response:
        request, auth, registration, uia = call.request, self._auth, self._registration, self._uia
        kind = query_string(request, "kind") or "user"
        if kind == "guest":
            return await self._register_guest(request)
        if kind != "user":
            raise invalid_param("kind must be 'user' or 'guest'")
        service = auth.app_service_by_req(request)
        if service is not None:
            return await self._register_app_service_user(request, service)
        if not self._config.enable_registration:
            raise forbidden("Registration is disabled")
        body = parse_json_object(request)
        if body.get("type") == LOGIN_TYPE_APPLICATION_SERVICE:
            raise MatrixError(401, "M_MISSING_TOKEN", "m.login.application_service needs the service's as_token")
        ip = client_ip(request)
        registration.check_ratelimit(ip)
        given = RegisterParams(
            username=optional_string(body, "username", max_length=MAX_USERNAME_LENGTH),
            password=optional_string(body, "password", max_length=MAX_PASSWORD_LENGTH),
            device_id=optional_string(body, "device_id", max_length=MAX_DEVICE_ID_LENGTH, allow_empty=False),
            initial_device_display_name=optional_string(
                body, "initial_device_display_name", max_length=MAX_DEVICE_DISPLAY_NAME_LENGTH
            ),
            inhibit_login=optional_bool(body, "inhibit_login", False),
        )
        optional_bool(body, "refresh_token", False)  # accepted; access tokens here do not expire
        # The spec: a guest upgrades its account by registering with its access token.
        guest_token = optional_string(body, "guest_access_token", max_length=MAX_TOKEN_LENGTH)
        guest_user_id: str | None = None
        if guest_token is not None:
            guest = await auth.get_user_by_access_token(guest_token)
            if not guest.is_guest:
                raise forbidden("guest_access_token is not a guest account's token")
            guest_user_id = guest.user_id
        auth_dict = body.get("auth")
        # A session that already registered answers with its user again (the
        # username it took is not "in use" for it). Otherwise each parameter
        # keeps the value the session's first request gave it; a later request
        # only fills in those not given before.
        prior = uia.existing(auth_dict, operation="register", user_id=None)
        if prior is not None and prior.has_result:
            return 200, prior.result
        wanted = given
        if prior is not None and isinstance(prior.params, RegisterParams):
            wanted = prior.params.filled_from(given)
            prior.params = wanted
        if guest_user_id is not None:
            # As Synapse: the upgraded account keeps the guest's user ID.
            if wanted.username is not None and registration.user_id_for(wanted.username) != guest_user_id:
                raise invalid_param("An upgraded guest keeps its user ID: username must be its localpart")
        elif wanted.username is not None:
            self._check_not_exclusive(registration.user_id_for(wanted.username))
            await registration.check_username_available(wanted.username)
        session = await uia.check(
            auth_dict, operation="register", flows=self._flows, user_id=None,
            params=given if given.any() else None,
        )
        if session.has_result:
            return 200, session.result
        if isinstance(session.params, RegisterParams):
            wanted = session.params.filled_from(given)
        # As Synapse: a password in this request wins over the session's, so a
        # client told it was missing can send it with the same session.
        password = given.password if given.password is not None else wanted.password
        if password is None:
            # The spec makes it optional in the body; like Synapse, an account needs one.
            raise missing_param("Missing params: password")
        try:
            if guest_user_id is not None:
                result = await registration.upgrade_guest(
                    user_id=guest_user_id,
                    password=password,
                    device_id=wanted.device_id,
                    initial_device_display_name=wanted.initial_device_display_name,
                    inhibit_login=wanted.inhibit_login,
                    ip=ip,
                )
                auth.invalidate_token_hashes(result.stale_token_hashes)
            else:
                result = await registration.register(
                    username=wanted.username,
                    password=password,
                    device_id=wanted.device_id,
                    initial_device_display_name=wanted.initial_device_display_name,
                    inhibit_login=wanted.inhibit_login,
                    ip=ip,
                )
        except MatrixError:
            if session.has_result:  # a concurrent request of this session registered first
                return 200, session.result
            raise
        response = self._registered(result)
        session.set_result(response)
        session.params = None  # forget the password
        return 200, response

    def _registered(self, result: RegistrationResult) -> dict[str, Any]:
        response: dict[str, Any] = {"user_id": result.user_id, "home_server": self._config.server_name}
        if result.login is not None:
            response["access_token"] = result.login.access_token
            response["device_id"] = result.login.device_id
        return response

    def _check_not_exclusive(self, user_id: str) -> None:
        if self._auth.app_services.exclusive_user_owner(user_id) is not None:
            raise MatrixError(400, "M_EXCLUSIVE", "This user ID is reserved by an application service")

    async def _register_app_service_user(self, request: Request, service: AppService) -> Response:
        """``type: m.login.application_service`` with the service's ``as_token``: no password,
        no user-interactive auth, open even when registration is closed; the user must be in
        the service's namespaces (400 ``M_EXCLUSIVE`` otherwise)."""
        body = parse_json_object(request)
        if body.get("type") != LOGIN_TYPE_APPLICATION_SERVICE:
            raise bad_json(f"An application service registers users with type {LOGIN_TYPE_APPLICATION_SERVICE}")
        username = required_string(body, "username", max_length=MAX_USERNAME_LENGTH, allow_empty=False)
        user_id = self._registration.user_id_for(username)
        if not service.may_act_as(user_id):
            raise MatrixError(400, "M_EXCLUSIVE", "This user ID is not in the application service's namespaces")
        other = self._auth.app_services.exclusive_user_owner(user_id)
        if other is not None and other.id != service.id:
            raise MatrixError(400, "M_EXCLUSIVE", "This user ID is reserved by another application service")
        result = await self._registration.register(
            username=username,
            password=None,
            device_id=optional_string(body, "device_id", max_length=MAX_DEVICE_ID_LENGTH, allow_empty=False),
            initial_device_display_name=optional_string(
                body, "initial_device_display_name", max_length=MAX_DEVICE_DISPLAY_NAME_LENGTH
            ),
            inhibit_login=optional_bool(body, "inhibit_login", False),
            ip=client_ip(request),
            counted=False,
        )
        return 200, self._registered(result)

    async def _register_guest(self, request: Request) -> Response:
        # The spec: every body field but initial_device_display_name is ignored and
        # the server picks the device ID; no user-interactive auth, no password.
        if not self._config.allow_guest_access:
            raise MatrixError(403, "M_GUEST_ACCESS_FORBIDDEN", "Guest access is disabled")
        body = parse_optional_json_object(request)
        ip = client_ip(request)
        self._registration.check_ratelimit(ip)
        result = await self._registration.register(
            username=None,
            password=None,
            device_id=None,
            initial_device_display_name=optional_string(
                body, "initial_device_display_name", max_length=MAX_DEVICE_DISPLAY_NAME_LENGTH
            ),
            inhibit_login=False,
            ip=ip,
            is_guest=True,
        )
        assert result.login is not None
        return 200, {
            "user_id": result.user_id,
            "home_server": self._config.server_name,
            "access_token": result.login.access_token,
            "device_id": result.login.device_id,
        }

    def _open_query(self, call: Call, name: str, missing: str) -> str:
        """Query parameter ``name`` of a check that only open registration answers (403 when closed)."""
        if not self._config.enable_registration:
            raise forbidden("Registration is disabled")
        value = query_string(call.request, name)
        if value is None:
            raise missing_param(missing)
        return value

    @route("GET", client_path(r"/register/available"), "client_register_available", caller=Caller.NONE)
    async def get_register_available(self, call: Call) -> Response:
        username = self._open_query(call, "username", "Missing query parameter 'username'")
        check_text(username, "username", max_length=MAX_USERNAME_LENGTH)
        self._check_not_exclusive(self._registration.user_id_for(username))
        await self._registration.check_username_available(username)
        return 200, {"available": True}

    @route("GET", r"/_matrix/client/v1/register/m\.login\.registration_token/validity",
           "client_registration_token_validity", caller=Caller.NONE)
    async def get_token_validity(self, call: Call) -> Response:
        token = self._open_query(call, "token", "Missing 'token'")
        if not 0 < len(token) <= 64:
            raise invalid_param("'token' must be 1 to 64 characters")
        self._registration.check_ratelimit(client_ip(call.request))
        return 200, {"valid": await self._registration_token_valid(token)}


class LoginServlets:
    """``/login``, ``/logout``, ``/account/whoami`` and ``/account/password``. Logging in as an
    application service reads the service's ``as_token`` itself: the body's ``type`` says so."""

    def __init__(self, config: HomeserverConfig, auth: Auth, login: LoginHandler, uia: UserInteractiveAuth) -> None:
        self._config = config
        self._auth = auth
        self._login = login
        self._uia = uia

    @route("GET", client_path(r"/login"), "client_login_flows", caller=Caller.NONE)
    async def get_login(self, call: Call) -> Response:
        flows = [{"type": LOGIN_TYPE_PASSWORD}]
        if self._auth.app_services:
            flows.append({"type": LOGIN_TYPE_APPLICATION_SERVICE})
        return 200, {"flows": flows}

    @route("POST", client_path(r"/login"), "client_login", caller=Caller.NONE, body=Body.OBJECT)
    async def post_login(self, call: Call) -> Response:
        body = call.content
        login_type = body.get("type")
        if login_type is None:
            raise missing_param("Missing 'type'")
        if not isinstance(login_type, str):
            raise bad_json("'type' must be a string")
        if login_type == LOGIN_TYPE_APPLICATION_SERVICE:
            return await self._login_app_service(call.request, body)
        if login_type != LOGIN_TYPE_PASSWORD:
            raise MatrixError(400, "M_UNKNOWN", "Unsupported login type")
        user = user_from_identifier(body.get("identifier"), body.get("user"))
        if user is None:
            if body.get("medium") is not None or body.get("address") is not None:
                raise forbidden("No account is bound to that third-party identifier")
            raise missing_param("Missing 'identifier'")
        password = body.get("password")
        if password is None:
            raise missing_param("Missing 'password'")
        if not isinstance(password, str):
            raise bad_json("'password' must be a string")
        if len(password) > MAX_PASSWORD_LENGTH:
            raise invalid_credentials()
        device_id = optional_string(body, "device_id", max_length=MAX_DEVICE_ID_LENGTH, allow_empty=False)
        display_name = optional_string(
            body, "initial_device_display_name", max_length=MAX_DEVICE_DISPLAY_NAME_LENGTH
        )
        optional_bool(body, "refresh_token", False)
        result = await self._login.login_with_password(
            user=user,
            password=password,
            device_id=device_id,
            initial_device_display_name=display_name,
            ip=client_ip(call.request),
        )
        response: dict[str, Any] = {
            "user_id": result.user_id,
            "access_token": result.access_token,
            "device_id": result.device_id,
            "home_server": self._config.server_name,
        }
        well_known = client_well_known(self._config)
        if well_known is not None:
            response["well_known"] = well_known
        return 200, response

    async def _login_app_service(self, request: Request, body: JsonDict) -> Response:
        service = self._auth.app_service_by_req(request)
        if service is None:
            raise MatrixError(401, "M_MISSING_TOKEN", "m.login.application_service needs the service's as_token")
        user = user_from_identifier(body.get("identifier"), body.get("user"))
        if user is None:
            raise missing_param("Missing 'identifier'")
        result = await self._login.login_as_app_service(
            service, user=user,
            device_id=optional_string(body, "device_id", max_length=MAX_DEVICE_ID_LENGTH, allow_empty=False),
            initial_device_display_name=optional_string(
                body, "initial_device_display_name", max_length=MAX_DEVICE_DISPLAY_NAME_LENGTH
            ),
            ip=client_ip(request),
        )
        return 200, {"user_id": result.user_id, "access_token": result.access_token, "device_id": result.device_id,
                     "home_server": self._config.server_name}

    @route("POST", client_path(r"/logout"), "client_logout", caller=Caller.GUEST)
    async def post_logout(self, call: Call) -> Response:
        await self._login.logout(call.user)
        return empty()

    @route("POST", client_path(r"/logout/all"), "client_logout_all", caller=Caller.GUEST)
    async def post_logout_all(self, call: Call) -> Response:
        await self._login.logout_all(call.user)
        return empty()

    @route("GET", client_path(r"/account/whoami"), "client_whoami", caller=Caller.GUEST)
    async def get_whoami(self, call: Call) -> Response:
        requester = call.user
        answer: dict[str, Any] = {"user_id": requester.user_id, "is_guest": requester.is_guest}
        if requester.device_id:  # an application service may act with no device
            answer["device_id"] = requester.device_id
        return 200, answer

    @route("POST", client_path(r"/account/password"), "client_change_password", caller=Caller.USER, body=Body.OBJECT)
    async def post_password(self, call: Call) -> Response:
        body = call.content
        new_password = required_string(body, "new_password", max_length=MAX_PASSWORD_LENGTH, allow_empty=False)
        logout_devices = optional_bool(body, "logout_devices", True)
        session = await self._uia.check(
            body.get("auth"), operation="change_password", flows=PASSWORD_FLOWS, user_id=call.user.user_id
        )
        if not session.has_result:
            await self._login.change_password(call.user, new_password, logout_devices=logout_devices)
            session.set_result({})
        return empty()


class DeactivateServlet:
    def __init__(self, uia: UserInteractiveAuth, deactivation: DeactivationHandler) -> None:
        self._uia = uia
        self._deactivation = deactivation

    @route("POST", client_path(r"/account/deactivate"), "client_deactivate", caller=Caller.USER, body=Body.OBJECT)
    async def post_deactivate(self, call: Call) -> Response:
        body = call.content
        erase = optional_bool(body, "erase", False)
        optional_string(body, "id_server", max_length=MAX_USERNAME_LENGTH)
        session = await self._uia.check(
            body.get("auth"), operation="deactivate", flows=PASSWORD_FLOWS, user_id=call.user.user_id
        )
        if not session.has_result:
            await self._deactivation.deactivate(call.user, erase=erase)
            # No identity server is configured, so no third-party ID could be unbound from one.
            session.set_result({"id_server_unbind_result": "no-support"})
        return 200, session.result
