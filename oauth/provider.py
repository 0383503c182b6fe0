"""The MCP SDK's authorization-server handlers (`mcp.server.auth.handlers`: /authorize,
/token, /register, /revoke — request parsing, PKCE S256 verification, RFC error bodies)
backed by our models through `oauth.services`.

The handlers are async; every database call runs in a worker thread. The issuer (our
public base URL) is bound per request by `issuer_bound` so the provider can name the
consent page and check the RFC 8707 resource."""

from __future__ import annotations

import base64
import binascii
import contextvars
import json
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, unquote_plus, urlsplit

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from mcp.server.auth.handlers.authorize import AuthorizationHandler, AuthorizationRequest
from mcp.server.auth.handlers.register import RegistrationHandler
from mcp.server.auth.handlers.revoke import RevocationHandler, RevocationRequest
from mcp.server.auth.handlers.token import (
    AuthorizationCodeRequest,
    JwtBearerRequest,
    RefreshTokenRequest,
    TokenHandler,
)
from mcp.server.auth.middleware.client_auth import AuthenticationError, ClientAuthenticator
from mcp.server.auth.provider import (
    AccessToken,
    AuthorizationCode,
    AuthorizationParams,
    AuthorizeError,
    RefreshToken,
    RegistrationError,
    TokenError,
)
from mcp.server.auth.settings import ClientRegistrationOptions
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE, RequestBodyLimitMiddleware
from mcp.shared.auth import (
    InvalidRedirectUriError,
    InvalidScopeError,
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthToken,
)
from pydantic import AnyUrl, ValidationError
from starlette.datastructures import FormData, Headers, ImmutableMultiDict
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, request_response

from core.asgi_body import asgi_body_buffered
from core.hosts import HOST_REFUSED_MESSAGE, HOST_REFUSED_STATUS, host_allowed
from core.inputs import InputError, json_loads_safe, text_problem
from oauth import services
from oauth.cimd import MetadataDocumentError
from oauth.models import OAuthAuthorizationRequest, OAuthClient

CONSENT_PATH = "/oauth/consent/"
AUTHORIZE_PATH = "/oauth/authorize"
TOKEN_PATH = "/oauth/token"  # noqa: S105
REGISTER_PATH = "/oauth/register"
REVOKE_PATH = "/oauth/revoke"
# The resources tokens may be bound to: our MCP toolsets, /engines/<id>/mcp.
_RESOURCE_PATH = re.compile(r"^/engines/[A-Za-z0-9_-]{1,64}/mcp$")
DEFAULT_RESOURCE_PATH = "/engines/memory/mcp"
_issuer: contextvars.ContextVar[str] = contextvars.ContextVar("oauth_issuer", default="")
# Whether the registration being handled named no token_endpoint_auth_method: bound by
# `_registration_method_defaulted`, read by `MemsiteProvider.register_client`.
_auth_method_omitted: contextvars.ContextVar[bool] = contextvars.ContextVar("oauth_auth_method_omitted", default=False)
# RFC 7591 §2: the method of a registration that names none.
DEFAULT_AUTH_METHOD = "client_secret_basic"
# RFC 6749 §4.1.2.1: an authorization error carries the request's `state`, exactly as
# received. Bounded as a stored state is: /authorize refuses a longer one, and its error
# leaves it out rather than cut it (a cut state would come back as another one).
STATE_MAX_CHARS: int = getattr(OAuthAuthorizationRequest._meta.get_field("state"), "max_length", 0)
# No client has a longer id (a registered one is the SDK's UUID, a metadata-document URL is
# refused past 512 characters): a longer one is refused before the SDK handler, which
# quoted it whole in its "not found" error (a 1 MB form field came back as a 1 MB answer).
CLIENT_ID_MAX_CHARS: int = getattr(OAuthClient._meta.get_field("client_id"), "max_length", 0)


def issuer_for(scheme: str, host: str) -> str:
    """Our issuer identifier: the public base URL (RFC 8414: no trailing slash, no query)."""
    return settings.PUBLIC_BASE_URL or f"{scheme}://{host}"


def _in_thread(function: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        close_old_connections()
        try:
            return function(*args, **kwargs)
        finally:
            close_old_connections()

    return sync_to_async(run, thread_sensitive=False)


class MemsiteClient(OAuthClientInformationFull):
    """A client as the SDK handlers see it, with our redirect and scope rules."""

    def validate_redirect_uri(self, redirect_uri: AnyUrl | None) -> AnyUrl:
        registered = [str(uri) for uri in self.redirect_uris or []]
        if redirect_uri is None:
            if len(registered) == 1:
                return AnyUrl(registered[0])
            raise InvalidRedirectUriError("redirect_uri must be specified unless the client has exactly one")
        if not services.redirect_uri_matches(registered, str(redirect_uri)):
            raise InvalidRedirectUriError("redirect_uri is not registered for this client")
        return redirect_uri

    def validate_scope(self, requested_scope: str | None) -> list[str] | None:
        try:
            return services.scopes_check(requested_scope.split() if requested_scope else None)
        except services.OAuthError as error:
            raise InvalidScopeError(error.description) from error


def _client_info(client: OAuthClient) -> MemsiteClient:
    return MemsiteClient.model_validate(
        {
            "client_id": client.client_id,
            "client_secret": None,  # never loaded: MemsiteAuthenticator compares digests
            "redirect_uris": client.redirect_uris,
            "grant_types": client.grant_types or ["authorization_code", "refresh_token"],
            "response_types": client.response_types or ["code"],
            "scope": client.scope,
            "client_name": client.client_name or None,
            "token_endpoint_auth_method": client.token_endpoint_auth_method,
        }
    )


def _client_lookup(client_id: str) -> OAuthClient | None:
    if text_problem(client_id):  # no client has such an id, and Postgres refuses the lookup
        return None
    if services.is_metadata_url(client_id):
        try:
            return services.oauth_client_from_metadata_url(url=client_id)
        except MetadataDocumentError:
            return None
    if len(client_id) > CLIENT_ID_MAX_CHARS:  # no client has one: not cut, a cut id could name another client
        return None
    return OAuthClient.objects.filter(client_id=client_id, kind=OAuthClient.Kind.DCR).first()


def _tokens(issued: services.IssuedTokens) -> OAuthToken:
    return OAuthToken(
        access_token=issued.access_token,
        token_type="Bearer",  # noqa: S106
        expires_in=issued.expires_in,
        scope=issued.scope,
        refresh_token=issued.refresh_token,
    )


class MemsiteProvider:
    """`OAuthAuthorizationServerProvider` over `oauth.services`."""

    async def get_client(self, client_id: str) -> OAuthClientInformationFull | None:
        client = await _in_thread(_client_lookup)(client_id)
        return None if client is None else _client_info(client)

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        if _auth_method_omitted.get():
            # The SDK handler put its own default, client_secret_post, where RFC 7591 §2 says
            # client_secret_basic; the secret it minted serves either. Stored and answered
            # (the SDK answers with this object) as the RFC's default.
            client_info.token_endpoint_auth_method = DEFAULT_AUTH_METHOD
        metadata = client_info.model_dump(mode="json")
        try:
            registered = await _in_thread(services.oauth_client_register)(
                metadata=metadata, client_secret=client_info.client_secret
            )
        except services.OAuthError as error:
            raise RegistrationError(error.error, error.description) from error  # type: ignore[arg-type]
        # The SDK answers with this object: a deduplicated public client gets its first id.
        client_info.client_id = registered.client_id

    async def authorize(self, client: OAuthClientInformationFull, params: AuthorizationParams) -> str:
        issuer = _issuer.get()
        resource = params.resource or f"{issuer}{DEFAULT_RESOURCE_PATH}"
        parts = urlsplit(resource)
        endpoint = not parts.query and not parts.fragment and _RESOURCE_PATH.match(parts.path)
        if f"{parts.scheme}://{parts.netloc}" != issuer or not endpoint:
            raise AuthorizeError("invalid_target", "resource must be one of this server's MCP endpoints")
        row = await _in_thread(_client_lookup)(str(client.client_id))
        if row is None:
            raise AuthorizeError("unauthorized_client", "unknown client")
        try:
            key = await _in_thread(services.oauth_authorization_begin)(
                client=row,
                redirect_uri=str(params.redirect_uri),
                redirect_uri_explicit=params.redirect_uri_provided_explicitly,
                state=params.state,
                scopes=params.scopes or list(services.SCOPES_SUPPORTED),
                code_challenge=params.code_challenge,
                resource=resource.rstrip("/"),
            )
        except services.OAuthError as error:
            raise AuthorizeError(error.error, error.description) from error  # type: ignore[arg-type]
        return f"{issuer}{CONSENT_PATH}{key}/"

    async def load_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: str
    ) -> AuthorizationCode | None:
        info = await _in_thread(services.oauth_code_load)(client_id=str(client.client_id), code=authorization_code)
        if info is None:
            return None
        return AuthorizationCode(
            code=authorization_code,
            scopes=info.scopes,
            expires_at=info.expires_at,
            client_id=info.client_id,
            code_challenge=info.code_challenge,
            redirect_uri=AnyUrl(info.redirect_uri),
            redirect_uri_provided_explicitly=info.redirect_uri_explicit,
            resource=info.resource,
            subject=info.subject,
        )

    async def exchange_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: AuthorizationCode
    ) -> OAuthToken:
        try:
            issued = await _in_thread(services.oauth_code_exchange)(
                client_id=str(client.client_id), code=authorization_code.code
            )
        except services.OAuthError as error:
            raise TokenError(error.error, error.description) from error  # type: ignore[arg-type]
        return _tokens(issued)

    async def load_refresh_token(self, client: OAuthClientInformationFull, refresh_token: str) -> RefreshToken | None:
        info = await _in_thread(services.oauth_refresh_load)(client_id=str(client.client_id), token=refresh_token)
        if info is None:
            return None
        return RefreshToken(
            token=refresh_token,
            client_id=info.client_id,
            scopes=info.scopes,
            expires_at=info.expires_at,
            resource=info.resource,
            subject=info.subject,
        )

    async def exchange_refresh_token(
        self, client: OAuthClientInformationFull, refresh_token: RefreshToken, scopes: list[str]
    ) -> OAuthToken:
        try:
            issued = await _in_thread(services.oauth_refresh_exchange)(
                client_id=str(client.client_id), token=refresh_token.token, scopes=scopes
            )
        except services.OAuthError as error:
            raise TokenError(error.error, error.description) from error  # type: ignore[arg-type]
        return _tokens(issued)

    async def load_access_token(self, token: str) -> AccessToken | None:
        # Only the revocation endpoint asks (MCP calls authenticate in memories.auth): it
        # needs the token's client to check the revoking client owns it.
        client_id = await _in_thread(services.oauth_token_client_id)(token=token)
        if client_id is None:
            return None
        return AccessToken(token=token, client_id=client_id, scopes=[])

    async def revoke_token(self, token: AccessToken | RefreshToken) -> None:
        await _in_thread(services.oauth_token_revoke)(token=token.token)

    async def exchange_identity_assertion(self, client: Any, params: Any) -> OAuthToken:
        raise TokenError("unsupported_grant_type", "The JWT bearer grant is not supported")


class _BasicCredentials(NamedTuple):
    client_id: str
    secret: str


def _basic_scheme(headers: Headers) -> tuple[bool, str]:
    """(whether the Authorization header uses the Basic scheme, its credentials). Scheme
    names are case-insensitive (RFC 7235 §2.1, RFC 9110 §11.1): `basic` and `BASIC` are
    `Basic`; one or more spaces separate the credentials."""
    scheme, _, credentials = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "basic", credentials.strip(" ")


def _basic_credentials(headers: Headers) -> _BasicCredentials | None:
    """The client credentials of an `Authorization: Basic` header (RFC 6749 §2.3.1: the
    client_id and secret, each form-urlencoded, as user-id and password, RFC 7617), or None
    when the header is not Basic. Each is form-decoded, as the RFC encodes it: `+` is a
    space and `%2B` a `+` (percent-decoding alone left a form-encoded space a `+`, so a
    client encoding as the RFC says, e.g. Go's x/oauth2, was refused; the MCP SDKs'
    encodings, `%20` or none for their ids and hex secrets, read the same either way).
    Raises ValueError for Basic credentials that cannot be read (not base64, not UTF-8, no
    `:`); the message never holds them."""
    is_basic, credentials = _basic_scheme(headers)
    if not is_basic:
        return None
    try:
        decoded = base64.b64decode(credentials, validate=True).decode()
    except (ValueError, binascii.Error):
        raise ValueError("Invalid Basic authentication header") from None
    if ":" not in decoded:
        raise ValueError("Invalid Basic authentication header")
    client_id, _, secret = decoded.partition(":")
    return _BasicCredentials(unquote_plus(client_id), unquote_plus(secret))


class MemsiteAuthenticator(ClientAuthenticator):
    """Client authentication at /token and /revoke against the stored secret digest
    (public clients — auth method none, every CIMD client — send no secret, and are refused
    if they send one). HTTP Basic credentials, when sent, name the client; a form
    client_id naming another one was refused before (`_basic_client_id_in_form`), as was a
    form client_secret beside them (`_one_client_authentication`). Either method serves a
    client with a secret, whichever it registered (see docs/architecture.md: enforcing the
    registered method would refuse real clients)."""

    async def authenticate_request(self, request: Request) -> OAuthClientInformationFull:
        form = await request.form()
        client_id = form.get("client_id")
        secret = form.get("client_secret")
        try:
            basic = _basic_credentials(request.headers)
        except ValueError as error:
            raise AuthenticationError(str(error)) from None
        if basic is not None:
            if client_id and client_id != basic.client_id:
                raise AuthenticationError("Client ID mismatch in Basic auth")
            client_id, secret = basic.client_id, basic.secret
        if not isinstance(client_id, str) or not client_id:
            raise AuthenticationError("Missing client_id")
        row = await _in_thread(_client_lookup)(client_id)
        if row is None:
            raise AuthenticationError("Invalid client_id")
        secret = secret if isinstance(secret, str) else None
        if not services.oauth_client_secret_matches(client=row, secret=secret):
            if secret and row.token_endpoint_auth_method == "none":  # noqa: S105
                raise AuthenticationError("A public client (token_endpoint_auth_method none) sends no client_secret")
            raise AuthenticationError("Invalid client credentials")
        return _client_info(row)


def _host_checked(app: Any) -> Any:
    """These endpoints are mounted beside Django, so its ALLOWED_HOSTS check never ran: a
    foreign Host named the issuer (consent page, default resource) without
    PUBLIC_BASE_URL. Refused first, before anything is read or stored, with the status the
    MCP endpoints and every other JSON surface give it (421, core/hosts.py) in the OAuth
    error shape (RFC 6749 §5.2)."""

    async def checked(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not host_allowed(Headers(scope=scope).get("host", "")):
            refusal = _oauth_error(HOST_REFUSED_STATUS, "invalid_request", HOST_REFUSED_MESSAGE)
            await refusal(scope, receive, send)
            return
        await app(scope, receive, send)

    return checked


def _issuer_bound(app: Any) -> Any:
    async def bound(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = Headers(scope=scope)
        token = _issuer.set(issuer_for(scope.get("scheme", "http"), headers.get("host", "localhost")))
        try:
            await app(scope, receive, send)
        finally:
            _issuer.reset(token)

    return bound


def _metadata_url_prechecked(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A client_id that is a metadata-document URL and cannot be used is refused here with
    the reason (the SDK handler would only say 'not found'). No redirect: the client is
    not trusted yet (RFC 6749 §4.1.2.1). The client_id and state are those the SDK handler
    reads (`_handler_params`: a POST's form, not its query), after the input check."""

    async def handle(request: Request) -> Response:
        params = await _handler_params(request)
        client_id = params.get("client_id") if params is not None else None
        if isinstance(client_id, str) and services.is_metadata_url(client_id):
            try:
                await _in_thread(services.oauth_client_from_metadata_url)(url=client_id)
            except MetadataDocumentError as error:
                return _oauth_error(400, "invalid_client", str(error), state=_state_echoable(params))
        return await handler(request)

    return handle


def _redirects_only_to_consent(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """The SDK handler redirects an error to the client's registered redirect_uri once the
    client and redirect check out (RFC 6749 §4.1.2.1). A self-registered client (DCR, or a
    metadata document anyone can publish) vouches for nothing, so that made /authorize an
    open redirector (RFC 9700 §4.11.2). Before the user has answered the consent page a
    redirect means nothing to the client: the error is answered here, directly, with the
    request's `state` (bounded, `_state_echoable`). The errors the SDK answers directly
    itself (an unknown client or redirect_uri) are answered again here, so that their
    state is bounded too. The one redirect left is to the consent page, whose answer (a
    code or access_denied) still goes to the client."""

    async def handle(request: Request) -> Response:
        response = await handler(request)
        location = response.headers.get("location")
        if location is not None and _is_consent_page(location):
            return response
        if location is not None:
            error, description = _redirected_error(location)
        elif response.status_code == 400:
            error, description = _answered_error(response)
        else:
            return response
        return _oauth_error(400, error, description, state=_state_echoable(await _handler_params(request)))

    return handle


def _registration_method_defaulted(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A registration naming no token_endpoint_auth_method (or null) was registered and
    answered `client_secret_post`, the SDK's RegistrationHandler default; RFC 7591 §2 says
    the default is `client_secret_basic`. Whether it named one is read here with the
    handler's own model (`OAuthClientMetadata`), so it is decided exactly as the handler
    decides to put its default; `MemsiteProvider.register_client` puts the RFC's instead.
    A body the model refuses is the handler's to answer (invalid_client_metadata). Clients
    keep either method (not enforced: see docs/architecture.md)."""

    async def handle(request: Request) -> Response:
        try:
            metadata = OAuthClientMetadata.model_validate_json(await request.body())
        except ValidationError:
            omitted = False
        else:
            omitted = metadata.token_endpoint_auth_method is None
        bound = _auth_method_omitted.set(omitted)
        try:
            return await handler(request)
        finally:
            _auth_method_omitted.reset(bound)

    return handle


def _client_secret_optional(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A revocation without `client_secret` reaches the SDK handler as one with an empty
    `client_secret`, which RFC 6749 §3.1 says is the same request (a parameter sent without
    a value is treated as omitted). Workaround for modelcontextprotocol/python-sdk#3508:
    its `RevocationRequest` declares `client_secret: str | None` with no default, so a
    request that leaves it out, as a public client (auth method none: every CIMD client,
    Claude Code) and a client_secret_basic one do (RFC 7009 §2.1, RFC 6749 §2.3.1), was a
    400 "client_secret: Field required" and its token stayed live. Drop this once the SDK
    gives the field a default. The client authenticator, which runs first, reads an empty
    secret as none: a public client passes, a client with a secret is refused as with a
    wrong one. /token needs nothing of this: its request models default the field."""

    async def handle(request: Request) -> Response:
        params = await _handler_params(request)  # the form, parsed once, kept on the request
        if params is not None and "client_secret" not in params:
            # Starlette's Request.form() gives back the form it keeps here: the
            # authenticator and the SDK handler read this one. A private attribute, kept
            # over a new Request around a re-encoded body: that would re-encode every field,
            # and one sent raw (multipart, or bytes urlencoding escapes) grows, past the form
            # parser's 1 MiB part limit too, which the handlers' parse raises uncaught (a
            # 500; _input_refusal bounds only the body as sent). The tests of both uses fail
            # if Starlette stops reading it.
            request._form = FormData([*params.multi_items(), ("client_secret", "")])
        return await handler(request)

    return handle


def _basic_client_id_in_form(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A client authenticating with HTTP Basic names itself there (RFC 6749 §2.3.1) and may
    leave client_id out of the form; the SDK's request models require it (a 400
    "client_id: Field required"), and compare the code's or token's client with it. So a
    request with readable Basic credentials and no client_id (or an empty one, RFC 6749
    §3.1) reaches the SDK handler with the header's. One whose form client_id names another
    client is malformed (RFC 6749 §5.2 invalid_request: it names two clients, the header's
    and the form's), refused before the credentials are checked, naming neither.
    Unreadable Basic credentials are left to the authenticator (401 invalid_client)."""

    async def handle(request: Request) -> Response:
        try:
            basic = _basic_credentials(request.headers)
        except ValueError:
            basic = None
        params = await _handler_params(request) if basic is not None else None
        if basic is None or params is None:
            return await handler(request)
        named = params.get("client_id")
        if named and named != basic.client_id:
            description = "client_id in the form is not the client of the Authorization header"
            return _oauth_error(400, "invalid_request", description)
        if not named:
            # As in _client_secret_optional: the authenticator and the SDK handler read this form.
            items = [(name, value) for name, value in params.multi_items() if name != "client_id"]
            request._form = FormData([*items, ("client_id", basic.client_id)])
        return await handler(request)

    return handle


# The refusal of a request using two client authentication methods: fixed, it names
# neither the client nor its credentials.
TWO_METHODS_MESSAGE = (
    "the client authenticated with more than one method (HTTP Basic and client_secret in the form): "
    "use one (RFC 6749 §2.3)"
)


def _one_client_authentication(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A client MUST NOT use more than one authentication method in a request (RFC 6749
    §2.3): one sending HTTP Basic credentials and a form client_secret was authenticated by
    the header, the form's secret silently ignored. That is a malformed request (RFC 6749
    §5.2 lists it under invalid_request): 400, refused before the credentials are read or
    checked (unreadable Basic credentials too: the client tried Basic, `_basic_attempted`),
    so no code is spent and no token rotated or revoked; a fixed message naming neither the client nor
    its credentials. An empty client_secret is none (RFC 6749 §3.1), as is one
    `_client_secret_optional` adds."""

    async def handle(request: Request) -> Response:
        if _basic_attempted(request.headers):
            params = await _handler_params(request)
            if params is not None and params.get("client_secret"):
                return _oauth_error(400, "invalid_request", TWO_METHODS_MESSAGE)
        return await handler(request)

    return handle


def _client_refusal_named(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """The SDK's RevocationHandler answers a client it cannot authenticate (its only 401)
    `unauthorized_client`; RFC 7009 §2.2.1 and RFC 6749 §5.2 name that `invalid_client`,
    as its TokenHandler and our own input checks at /revoke answer it. Same status and
    description, in the same shape."""

    async def handle(request: Request) -> Response:
        response = await handler(request)
        if response.status_code != 401:
            return response
        _, description = _answered_error(response)
        return _oauth_error(401, "invalid_client", description)

    return handle


# The challenge of a client refused at /token or /revoke after authenticating with HTTP
# Basic: a fixed realm, nothing of the request's. charset: the credentials are read as UTF-8
# (RFC 7617 §2.1).
BASIC_CHALLENGE = 'Basic realm="oauth", charset="UTF-8"'


def _basic_attempted(headers: Headers) -> bool:
    """Whether the client authenticated (or tried to) with the Authorization header's Basic
    scheme; auth-scheme names are case-insensitive (RFC 9110 §11.1)."""
    return _basic_scheme(headers)[0]


def _basic_challenged(app: Any) -> Any:
    """RFC 6749 §5.2: a client that tried to authenticate with the Authorization header and
    failed MUST get a 401 whose WWW-Authenticate names the scheme it used. Neither the SDK's
    handlers nor our input checks sent one: every 401 of /token and /revoke (all of them
    invalid_client: the SDK's, `_client_refusal_named`'s, `_parameter_refusal`'s and
    `_client_id_refusal`'s) gets it here when the request carried Basic credentials. A client
    that authenticated in the form (or is public) gets none: the RFC requires it only for
    the header, and a Basic challenge would name a scheme the client did not use (a public
    client, every CIMD one, cannot use it)."""

    async def challenged(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not _basic_attempted(Headers(scope=scope)):
            await app(scope, receive, send)
            return

        async def send_challenged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] == 401:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"www-authenticate"]
                headers.append((b"www-authenticate", BASIC_CHALLENGE.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await app(scope, receive, send_challenged)

    return challenged


def _answered_error(response: Response) -> tuple[str, str]:
    """The error of the SDK's own direct JSON answer."""
    try:
        answer = json.loads(bytes(response.body))
    except ValueError:
        answer = None
    answer = answer if isinstance(answer, dict) else {}
    error, description = answer.get("error"), answer.get("error_description")
    return (
        error if isinstance(error, str) and error else "invalid_request",
        description if isinstance(description, str) and description else "invalid authorization request",
    )


def _reads_form(method: str) -> bool:
    """Whether the SDK's AuthorizationHandler reads the form (else the query): it reads the
    query of a GET and the form of any other method, a POST (or a HEAD, which Starlette
    routes with GET). The other handlers take POST only and read its form."""
    return method != "GET"


async def _handler_params(request: Request) -> ImmutableMultiDict[str, Any] | None:
    """The parameters the SDK handler reads (`_reads_form`). Starlette keeps a parsed form
    on the request, so the handler and its wrappers all see the one parse."""
    if not _reads_form(request.method):
        return request.query_params
    try:
        await request.body()  # kept on the request: a form that fails to parse can be parsed again
        return await request.form()
    except Exception:  # noqa: BLE001 - a body the handler could not parse: no state to give back
        return None


def _state_echoable(params: ImmutableMultiDict[str, Any] | None) -> str | None:
    """The `state` an /authorize error carries back, or None: none was sent, or more than
    one (RFC 6749 §3.1: neither is the request's state), or it is empty (RFC 6749 A.5:
    state is 1*VSCHAR; the consent page's answer leaves an empty one out too), longer than
    a stored state may be, or holding text no state can hold (NUL, C0 controls, lone
    surrogates: refused for that). Given back in the answer only, never logged."""
    values = params.getlist("state") if params is not None else []
    value = values[0] if len(values) == 1 else None
    if not isinstance(value, str) or not value or len(value) > STATE_MAX_CHARS or text_problem(value):
        return None
    return value


def _is_consent_page(location: str) -> bool:
    return location.startswith(f"{_issuer.get()}{CONSENT_PATH}") and not urlsplit(location).query


def _redirected_error(location: str) -> tuple[str, str]:
    """The error the SDK put on a redirect: the parameters from the last `error` on (it
    appends them after whatever query the registered redirect_uri has)."""
    items = parse_qsl(urlsplit(location).query, keep_blank_values=True)
    starts = [index for index, (name, _) in enumerate(items) if name == "error"]
    answer = dict(items[starts[-1] :]) if starts else {}
    return answer.get("error") or "invalid_request", answer.get("error_description") or "invalid authorization request"


# The parameters that identify or authenticate the client: bad text there is invalid_client.
_CLIENT_PARAMETERS = ("client_id", "client_secret")


class _Refused(NamedTuple):
    status: int
    error: str
    description: str


def _parameter_refusal(path: str, items: Iterable[tuple[str, Any]]) -> _Refused | None:
    """The OAuth error for the first parameter holding text no client id, token, state or
    URI can hold (NUL, C0 controls, lone surrogates), or None. Never echoes the text. The
    client's own parameters first: a client that cannot be identified hears that first."""
    for name, value in sorted(items, key=lambda item: item[0] not in _CLIENT_PARAMETERS):
        problem = text_problem(name)
        if problem:
            return _Refused(400, "invalid_request", f"a parameter name {problem}")
        problem = text_problem(value) if isinstance(value, str) else None
        if not problem:
            continue
        description = f"{name[:40]} {problem}"
        if name not in _CLIENT_PARAMETERS:
            return _Refused(400, "invalid_request", description)
        # As the SDK answers a client it cannot authenticate: 401 at /token and /revoke,
        # 400 at /authorize (where no redirect may go to an unknown client).
        return _Refused(400 if path == AUTHORIZE_PATH else 401, "invalid_client", description)
    return None


def _client_id_refusal(path: str, params: Iterable[tuple[str, Any]]) -> _Refused | None:
    """A client_id longer than any client's, refused as a client that cannot be identified
    (as `_parameter_refusal` refuses one holding bad text), never quoted."""
    for name, value in params:
        if name == "client_id" and isinstance(value, str) and len(value) > CLIENT_ID_MAX_CHARS:
            description = f"client_id is longer than {CLIENT_ID_MAX_CHARS} characters"
            return _Refused(400 if path == AUTHORIZE_PATH else 401, "invalid_client", description)
    return None


# The parameters each SDK handler reads (with its client authenticator: client_id and
# client_secret at /token and /revoke), from its own request models. RFC 6749 §3.1: none
# may be sent more than once; an unrecognized one is ignored, repeated or not.
_READ_PARAMETERS: dict[str, frozenset[str]] = {
    AUTHORIZE_PATH: frozenset(AuthorizationRequest.model_fields),
    TOKEN_PATH: frozenset(
        name
        for model in (AuthorizationCodeRequest, RefreshTokenRequest, JwtBearerRequest)
        for name in model.model_fields
    ),
    REVOKE_PATH: frozenset(RevocationRequest.model_fields),
}


def _repeat_refusal(path: str, params: Iterable[tuple[str, Any]]) -> _Refused | None:
    """A parameter the handler reads sent more than once: the SDK took one of the values
    (its model reads the last, the state of a direct error one too), so the request meant
    something other than what was done with it. invalid_request (RFC 6749 §4.1.2.1, §5.2,
    RFC 7009 §2.2.1), naming the parameters, never their values. A repeated `resource` is
    RFC 8707's request for a token serving several resources, which is not malformed: a
    token here serves one, so that is invalid_target."""
    known = _READ_PARAMETERS.get(path, frozenset())
    seen: set[str] = set()
    repeated: list[str] = []
    for name, _ in params:
        if name in seen and name in known and name not in repeated:
            repeated.append(name)
        seen.add(name)
    malformed = [name for name in repeated if name != "resource"]
    if malformed:
        names = ", ".join(malformed)
        verb = "was" if len(malformed) == 1 else "were"
        return _Refused(400, "invalid_request", f"{names} {verb} sent more than once: each parameter may be sent once")
    if repeated:
        return _Refused(400, "invalid_target", "resource was sent more than once: a token serves one resource")
    return None


def _oauth_error(status: int, error: str, description: str, *, state: str | None = None) -> JSONResponse:
    body = {"error": error, "error_description": description}
    if state is not None:  # /authorize's errors (RFC 6749 §4.1.2.1)
        body["state"] = state
    return JSONResponse(body, status_code=status, headers={"Cache-Control": "no-store", "Pragma": "no-cache"})


def _input_checked(app: Any, path: str) -> Any:
    """Refuse invalid text in the query, the form and (registration) the JSON body with the
    endpoint's OAuth error before the SDK handler runs: it passed client ids, states and
    client metadata to Postgres, and a NUL there was a DataError (a plain-text 500). The
    registration body is parsed with json_loads_safe: bounded depth, every string checked.
    A parameter the handler reads sent twice, in what it reads, is refused too."""

    async def checked(scope: dict[str, Any], receive: Any, send: Any) -> None:
        # RequestBodyLimitMiddleware has bounded and buffered the body already.
        buffered = await asgi_body_buffered(receive)
        assert buffered is not None  # no byte limit given
        body, replay = buffered
        refusal = await _input_refusal(path, scope, body)
        if refusal is not None:
            await refusal(scope, replay, send)
            return
        await app(scope, replay, send)

    return checked


async def _input_refusal(path: str, scope: dict[str, Any], body: bytes) -> JSONResponse | None:
    query = Request(scope).query_params.multi_items()
    refused = _parameter_refusal(path, query)
    if path == REGISTER_PATH:
        if refused is None:
            try:
                json_loads_safe(body)
            except InputError as error:
                refused = _Refused(400, "invalid_client_metadata", error.message)
        return None if refused is None else _oauth_error(*refused)
    params = query  # what the SDK handler reads (_reads_form)
    if _reads_form(str(scope.get("method", ""))):
        try:
            params = await _form_items(scope, body)
        except MultiPartException as error:
            # A field over the form parser's part limit (1 MiB): the handlers' own parse (the
            # client authenticator's first) would raise it uncaught, a 500. Starlette's message
            # names the limit, never the field's text.
            params = []
            refused = refused or _Refused(400, "invalid_request", str(error))
        refused = refused or _parameter_refusal(path, params)
    refused = refused or _repeat_refusal(path, params) or _client_id_refusal(path, params)
    if refused is None:
        return None
    state = _state_echoable(ImmutableMultiDict(params)) if path == AUTHORIZE_PATH else None
    return _oauth_error(*refused, state=state)


async def _form_items(scope: dict[str, Any], body: bytes) -> list[tuple[str, Any]]:
    """The form, parsed with Starlette's form parser, the one the SDK handlers use, so this
    check sees exactly what they will; a body that is no form is left to them (no items
    here). Raises MultiPartException for a field over the parser's limits."""
    delivered = False

    async def once() -> dict[str, Any]:
        nonlocal delivered
        if delivered:
            return {"type": "http.disconnect"}
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    request = Request(scope, once)
    try:
        form = await request.form()
    except MultiPartException:
        raise
    except Exception:  # noqa: BLE001 - a malformed form is the handler's to answer, in its shape
        return []
    try:
        return form.multi_items()
    finally:
        await form.close()


def oauth_asgi_routes() -> dict[str, Any]:
    """path -> ASGI app, mounted by memsite/asgi.py next to the MCP toolsets."""
    provider = MemsiteProvider()
    authenticator = MemsiteAuthenticator(provider)
    options = ClientRegistrationOptions(
        enabled=True, valid_scopes=list(services.SCOPES_SUPPORTED), default_scopes=list(services.SCOPES_SUPPORTED)
    )
    handlers: list[tuple[str, Any, list[str]]] = [
        (
            AUTHORIZE_PATH,
            _metadata_url_prechecked(_redirects_only_to_consent(AuthorizationHandler(provider).handle)),
            ["GET", "POST"],
        ),
        (
            TOKEN_PATH,
            _one_client_authentication(_basic_client_id_in_form(TokenHandler(provider, authenticator).handle)),
            ["POST"],
        ),
        (
            REGISTER_PATH,
            _registration_method_defaulted(RegistrationHandler(provider, options=options).handle),
            ["POST"],
        ),
        (
            REVOKE_PATH,
            _client_refusal_named(
                _one_client_authentication(
                    _basic_client_id_in_form(_client_secret_optional(RevocationHandler(provider, authenticator).handle))
                )
            ),
            ["POST"],
        ),
    ]
    apps: dict[str, Any] = {}
    for path, handler, methods in handlers:
        # Inside the body limit, so the input check buffers no more than the handler would.
        checked = _input_checked(request_response(handler), path)
        if path in (TOKEN_PATH, REVOKE_PATH):
            checked = _basic_challenged(checked)  # outside the input check: its 401s too
        endpoint = RequestBodyLimitMiddleware(checked, DEFAULT_MAX_REQUEST_BODY_SIZE)
        route = Route(path, endpoint=endpoint, methods=methods)
        apps[path] = _host_checked(_issuer_bound(route.handle))
    return apps
