"""Writes of the authorization server: registering clients, consent, codes, tokens,
revocation. Every change that matters to a user (a client registered, consent given or
refused, a grant revoked, a refresh token replayed) leaves an audit row in the same
transaction. Codes and tokens are random (256 bits) and stored as sha256 digests."""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.models import AuditEvent
from audit.services import audit_record
from core.choices import Channel, Operation
from core.errors import ErrorCode, ServiceError
from core.inputs import InputError, json_value_check, text_problem
from core.scope import CallContext, MemoryScope
from oauth.cimd import MetadataDocumentError, metadata_document_fetch, metadata_url_check
from oauth.models import OAuthAuthorizationRequest, OAuthClient, OAuthCode, OAuthGrant, OAuthToken

PERMISSION_SCOPES = ("read", "write", "delete")
OFFLINE_ACCESS = "offline_access"
SCOPES_SUPPORTED = (*PERMISSION_SCOPES, OFFLINE_ACCESS)
ACCESS_TOKEN_PREFIX = "mso_at_"  # noqa: S105 - a prefix, not a secret
REFRESH_TOKEN_PREFIX = "mso_rt_"  # noqa: S105
CODE_PREFIX = "mso_ac_"
LOOPBACK_HOSTS = ("127.0.0.1", "[::1]", "::1", "localhost")
# Schemes a redirect must never use, whatever a registration says (RFC 8252 §7.1 allows
# private-use schemes such as cursor://; these are not that).
_FORBIDDEN_SCHEMES = {"javascript", "data", "file", "vbscript", "about", "blob", "ftp", "ws", "wss", "mailto"}
# A grant's last use is written at most this often (one write per minute, not per call).
LAST_USED_RESOLUTION = timedelta(seconds=60)


class OAuthError(Exception):
    """An RFC 6749/7591 error: `error` is the RFC's code, `description` is safe to show."""

    def __init__(self, error: str, description: str):
        super().__init__(description)
        self.error = error
        self.description = description


def _sha256(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _oauth_call() -> CallContext:
    return CallContext(channel=Channel.OAUTH)


def _grant_scope(grant: OAuthGrant) -> MemoryScope:
    return MemoryScope.for_user(grant.user, client_app=client_label(grant.client))


def client_label(client: OAuthClient) -> str:
    """How a client is named in audit rows and on pages: its name and where it comes from."""
    return f"oauth:{client.client_name or client_host(client)}"[:100]


def client_host(client: OAuthClient) -> str:
    """The host that vouches for a client: the document's host (CIMD), else the first
    redirect's host (DCR: self-asserted, shown as such)."""
    source = client.client_id if client.kind == OAuthClient.Kind.CIMD else (client.redirect_uris or [""])[0]
    parts = urlsplit(source)
    return parts.hostname or parts.scheme or "?"


# --- redirect URIs ---------------------------------------------------------------------
def _is_loopback(parts: Any) -> bool:
    return parts.scheme == "http" and (parts.hostname or "") in ("127.0.0.1", "::1", "localhost")


def redirect_uri_check(uri: str) -> None:
    """A redirect a client may register: https, http on loopback (RFC 8252 §7.3), or a
    private-use scheme (RFC 8252 §7.1, e.g. Cursor's cursor://); never a fragment."""
    if not isinstance(uri, str) or not uri or len(uri) > 2048:
        raise OAuthError("invalid_redirect_uri", "redirect_uris must be non-empty strings")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if not scheme or parts.fragment or "#" in uri:
        raise OAuthError("invalid_redirect_uri", "a redirect URI must be absolute and have no fragment")
    if scheme in _FORBIDDEN_SCHEMES:
        raise OAuthError("invalid_redirect_uri", f"redirect URI scheme {scheme!r} is not allowed")
    if scheme == "https":
        if not parts.hostname:
            raise OAuthError("invalid_redirect_uri", "an https redirect URI needs a host")
        return
    if scheme == "http":
        if not _is_loopback(parts):
            raise OAuthError("invalid_redirect_uri", "plain http redirect URIs are allowed on loopback only")
        return
    if not (parts.netloc or parts.path):
        raise OAuthError("invalid_redirect_uri", "a private-use redirect URI needs a path")


def redirect_uri_matches(registered: list[str], uri: str) -> bool:
    """Exact match, except that a loopback redirect matches on any port (RFC 8252 §7.3)."""
    if uri in registered:
        return True
    parts = urlsplit(uri)
    if not _is_loopback(parts):
        return False
    for candidate in registered:
        known = urlsplit(candidate)
        if (
            _is_loopback(known)
            and known.hostname == parts.hostname
            and known.path == parts.path
            and known.query == parts.query
        ):
            return True
    return False


def scopes_check(requested: list[str] | None) -> list[str]:
    """The scopes of a request (all of them when none are named), or invalid_scope."""
    if not requested:
        return list(SCOPES_SUPPORTED)
    unknown = [scope for scope in requested if scope not in SCOPES_SUPPORTED]
    if unknown:
        raise OAuthError("invalid_scope", f"unknown scope: {unknown[0][:40]}")
    return [scope for scope in SCOPES_SUPPORTED if scope in requested]


# --- clients ---------------------------------------------------------------------------
def _canonical_metadata(metadata: dict[str, Any]) -> str:
    kept = {
        key: value
        for key, value in metadata.items()
        if key not in ("client_id", "client_secret", "client_id_issued_at", "client_secret_expires_at")
    }
    return json.dumps(kept, sort_keys=True, default=str)


@dataclass(frozen=True)
class RegisteredClient:
    client_id: str
    deduplicated: bool


def oauth_client_register(*, metadata: dict[str, Any], client_secret: str | None) -> RegisteredClient:
    """RFC 7591 registration. Public clients (auth method none) registering the same
    metadata again get the same client_id back: a client that registers on every start
    does not fill the table. Raises OAuthError (invalid_redirect_uri/invalid_client_metadata)."""
    try:
        # Every string and key: Postgres refuses a NUL in text and jsonb (a DataError, 500).
        json_value_check(metadata)
    except InputError as error:
        raise OAuthError("invalid_client_metadata", error.message) from None
    redirect_uris = [str(uri) for uri in metadata.get("redirect_uris") or []]
    if not redirect_uris:
        raise OAuthError("invalid_redirect_uri", "redirect_uris is required")
    for uri in redirect_uris:
        redirect_uri_check(uri)
    scopes_check((metadata.get("scope") or "").split() or None)
    method = metadata.get("token_endpoint_auth_method") or "none"
    if method not in ("none", "client_secret_post", "client_secret_basic"):
        raise OAuthError("invalid_client_metadata", f"token_endpoint_auth_method {method!r} is not supported")
    name = str(metadata.get("client_name") or "")[:200]
    digest = _sha256(_canonical_metadata({**metadata, "redirect_uris": redirect_uris}))
    fields = {
        "kind": OAuthClient.Kind.DCR,
        "client_name": name,
        "client_uri": str(metadata.get("client_uri") or "")[:512],
        "redirect_uris": redirect_uris,
        "grant_types": list(metadata.get("grant_types") or ["authorization_code", "refresh_token"]),
        "response_types": list(metadata.get("response_types") or ["code"]),
        # Stored as checked: each supported scope once (a scope naming one 60 times would
        # not fit the column).
        "scope": " ".join(dict.fromkeys((metadata.get("scope") or "").split())) or " ".join(SCOPES_SUPPORTED),
        "token_endpoint_auth_method": method,
        "metadata_sha256": digest,
    }
    public = {"token_endpoint_auth_method": "none"}
    existing = OAuthClient.objects.filter(kind="dcr", metadata_sha256=digest, **public)
    if method == "none" and (found := existing.first()) is not None:
        return RegisteredClient(client_id=found.client_id, deduplicated=True)
    try:
        with transaction.atomic():
            client = OAuthClient.objects.create(
                client_id=str(metadata["client_id"]),
                secret_sha256=_sha256(client_secret) if client_secret else "",
                **fields,
            )
            audit_record(
                None,
                call=_oauth_call(),
                operation=Operation.OAUTH_CLIENT_REGISTER,
                detail={"client_id": client.client_id, "client_name": name, "kind": "dcr", "auth_method": method},
            )
    except IntegrityError:
        # The same public client registering twice at once: the first one's row wins.
        if method != "none" or (found := existing.first()) is None:
            raise
        return RegisteredClient(client_id=found.client_id, deduplicated=True)
    return RegisteredClient(client_id=client.client_id, deduplicated=False)


def oauth_client_secret_matches(*, client: OAuthClient, secret: str | None) -> bool:
    """Whether `secret` authenticates the client. A public client (auth method none) has
    none to present: it matches only no secret (an empty one is none, RFC 6749 §3.1). One
    it sends anyway cannot be checked: refused (invalid_client), not ignored, so that a
    client never believes it authenticated with a secret nothing verified."""
    if not client.secret_sha256:
        return client.token_endpoint_auth_method == "none" and not secret  # noqa: S105
    return bool(secret) and secrets.compare_digest(client.secret_sha256, _sha256(secret or ""))


def is_metadata_url(client_id: str) -> bool:
    return client_id.startswith(("https://", "http://"))


def oauth_client_from_metadata_url(*, url: str) -> OAuthClient:
    """The client a Client ID Metadata Document describes, fetched safely and cached for
    OAUTH_CIMD_CACHE_S. Raises MetadataDocumentError (nothing is stored then)."""
    metadata_url_check(url)
    cached = OAuthClient.objects.filter(client_id=url, kind=OAuthClient.Kind.CIMD).first()
    fresh_after = timezone.now() - timedelta(seconds=settings.OAUTH_CIMD_CACHE_S)
    if cached is not None and cached.fetched_at and cached.fetched_at > fresh_after:
        return cached
    document = metadata_document_fetch(url)  # outside any transaction: a slow network call
    if document.get("client_id") != url:
        raise MetadataDocumentError("the document's client_id is not its own URL")
    redirect_uris = document.get("redirect_uris")
    if not isinstance(redirect_uris, list) or not redirect_uris or len(redirect_uris) > 20:
        raise MetadataDocumentError("the document needs redirect_uris (1 to 20)")
    try:
        for uri in redirect_uris:
            redirect_uri_check(uri)
    except OAuthError as error:
        raise MetadataDocumentError(error.description) from error
    method = document.get("token_endpoint_auth_method") or "none"
    if method != "none":
        raise MetadataDocumentError("a metadata-document client must use token_endpoint_auth_method none")
    name = document.get("client_name")
    client_uri = document.get("client_uri")
    raw = json.dumps(document, sort_keys=True)
    with transaction.atomic():
        client, created = OAuthClient.objects.update_or_create(
            client_id=url,
            defaults={
                "kind": OAuthClient.Kind.CIMD,
                "client_name": name[:200] if isinstance(name, str) else "",
                "client_uri": client_uri[:512] if isinstance(client_uri, str) else "",
                "redirect_uris": redirect_uris,
                "grant_types": ["authorization_code", "refresh_token"],
                "response_types": ["code"],
                "scope": " ".join(SCOPES_SUPPORTED),
                "token_endpoint_auth_method": "none",
                "metadata_sha256": _sha256(raw),
                "fetched_at": timezone.now(),
            },
        )
        if created:
            audit_record(
                None,
                call=_oauth_call(),
                operation=Operation.OAUTH_CLIENT_REGISTER,
                detail={"client_id": url, "client_name": client.client_name, "kind": "cimd", "auth_method": "none"},
            )
    return client


# --- authorization and consent ---------------------------------------------------------
def oauth_authorization_begin(
    *,
    client: OAuthClient,
    redirect_uri: str,
    redirect_uri_explicit: bool,
    state: str | None,
    scopes: list[str],
    code_challenge: str,
    resource: str,
) -> str:
    """Park a checked /authorize request until the user decides; returns its key."""
    if not (43 <= len(code_challenge) <= 128):
        raise OAuthError("invalid_request", "code_challenge must be an S256 challenge (43 to 128 characters)")
    # All of these are stored as text: a NUL would be a DataError (500), not an answer.
    texts = {"redirect_uri": redirect_uri, "state": state or "", "code_challenge": code_challenge, "resource": resource}
    for name, value in texts.items():
        problem = text_problem(value)
        if problem:
            raise OAuthError("invalid_request", f"{name} {problem}")
        # Refused, not cut: a shortened state would come back to the client as another one.
        limit = getattr(OAuthAuthorizationRequest._meta.get_field(name), "max_length", None)
        if limit is not None and len(value) > limit:
            raise OAuthError("invalid_request", f"{name} is longer than {limit} characters")
    key = secrets.token_urlsafe(32)
    OAuthAuthorizationRequest.objects.create(
        request_key=key,
        client=client,
        redirect_uri=redirect_uri,
        redirect_uri_explicit=redirect_uri_explicit,
        state=state or "",
        scopes=scopes,
        code_challenge=code_challenge,
        resource=resource,
        expires_at=timezone.now() + timedelta(seconds=settings.OAUTH_CONSENT_TTL_S),
    )
    return key


def _redirect_with(uri: str, params: dict[str, str]) -> str:
    parts = urlsplit(uri)
    query = parts.query + ("&" if parts.query else "") + urlencode({k: v for k, v in params.items() if v})
    return urlunsplit(parts._replace(query=query))


def oauth_consent_decide(
    *, request_key: str, user: Any, granted: list[str] | None, issuer: str, call: CallContext
) -> str:
    """The user's answer to a pending authorization; returns where to send the browser
    (the client's redirect with `code` or `error`, `state` and `iss` — RFC 9207).
    `granted=None` refuses. Granting less than asked is allowed; more is not."""
    with transaction.atomic():
        pending = (
            OAuthAuthorizationRequest.objects.select_for_update()
            .select_related("client")
            .filter(request_key=request_key, decided_at__isnull=True, expires_at__gt=timezone.now())
            .first()
        )
        if pending is None:
            raise ServiceError(ErrorCode.NOT_FOUND, "This authorization request has expired or was already answered.")
        pending.decided_at = timezone.now()
        pending.save(update_fields=["decided_at"])
        client = pending.client
        scope = MemoryScope.for_user(user, client_app=client_label(client))
        if granted is None:
            audit_record(
                scope,
                call=call,
                operation=Operation.OAUTH_CONSENT,
                outcome=AuditEvent.Outcome.DENIED,
                error_code="access_denied",
                detail={"client_id": client.client_id, "requested": pending.scopes},
            )
            return _redirect_with(
                pending.redirect_uri, {"error": "access_denied", "state": pending.state, "iss": issuer}
            )
        scopes = [s for s in pending.scopes if s in granted]
        if not any(s in PERMISSION_SCOPES for s in scopes):
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, "Grant at least one permission, or deny.")
        grant = OAuthGrant.objects.create(user=user, client=client, scopes=scopes, resource=pending.resource)
        code = CODE_PREFIX + secrets.token_urlsafe(32)
        OAuthCode.objects.create(
            code_sha256=_sha256(code),
            grant=grant,
            redirect_uri=pending.redirect_uri,
            redirect_uri_explicit=pending.redirect_uri_explicit,
            code_challenge=pending.code_challenge,
            expires_at=timezone.now() + timedelta(seconds=settings.OAUTH_CODE_TTL_S),
        )
        audit_record(
            scope,
            call=call,
            operation=Operation.OAUTH_CONSENT,
            detail={
                "client_id": client.client_id,
                "grant_id": grant.pk,
                "requested": pending.scopes,
                "granted": scopes,
                "resource": pending.resource,
            },
        )
    return _redirect_with(pending.redirect_uri, {"code": code, "state": pending.state, "iss": issuer})


# --- codes and tokens ------------------------------------------------------------------
@dataclass(frozen=True)
class CodeInfo:
    client_id: str
    scopes: list[str]
    expires_at: float
    code_challenge: str
    redirect_uri: str
    redirect_uri_explicit: bool
    resource: str
    subject: str


def _grant_revoke(grant: OAuthGrant, *, reason: str, call: CallContext, outcome: str = AuditEvent.Outcome.OK) -> None:
    """Inside the caller's transaction."""
    if grant.revoked_at is not None:
        return
    grant.revoked_at = timezone.now()
    grant.revoked_reason = reason
    grant.save(update_fields=["revoked_at", "revoked_reason"])
    audit_record(
        _grant_scope(grant),
        call=call,
        operation=Operation.OAUTH_REVOKE,
        outcome=outcome,
        error_code="" if outcome == AuditEvent.Outcome.OK else reason,
        detail={"client_id": grant.client.client_id, "grant_id": grant.pk, "reason": reason},
    )


def oauth_code_load(*, client_id: str, code: str) -> CodeInfo | None:
    """An unused, live code of this client. A code presented a second time revokes the
    grant it created (RFC 6749 §4.1.2: its tokens must not outlive the replay)."""
    with transaction.atomic():
        row = (
            OAuthCode.objects.select_for_update()
            .select_related("grant", "grant__client", "grant__user")
            .filter(code_sha256=_sha256(code))
            .first()
        )
        if row is None or row.grant.client.client_id != client_id:
            return None
        if row.used_at is not None:
            _grant_revoke(row.grant, reason="code_reuse", call=_oauth_call(), outcome=AuditEvent.Outcome.DENIED)
            return None
        if row.grant.revoked_at is not None:
            return None
    return CodeInfo(
        client_id=client_id,
        scopes=list(row.grant.scopes),
        expires_at=row.expires_at.timestamp(),
        code_challenge=row.code_challenge,
        redirect_uri=row.redirect_uri,
        redirect_uri_explicit=row.redirect_uri_explicit,
        resource=row.grant.resource,
        subject=str(row.grant.user_id),
    )


@dataclass(frozen=True)
class IssuedTokens:
    access_token: str
    expires_in: int
    scope: str
    refresh_token: str | None


def _tokens_issue(grant: OAuthGrant, scopes: list[str]) -> IssuedTokens:
    now = timezone.now()
    access = ACCESS_TOKEN_PREFIX + secrets.token_urlsafe(32)
    ttl = settings.OAUTH_ACCESS_TOKEN_TTL_S
    OAuthToken.objects.create(
        token_sha256=_sha256(access),
        kind=OAuthToken.Kind.ACCESS,
        grant=grant,
        scopes=scopes,
        expires_at=now + timedelta(seconds=ttl),
    )
    refresh = None
    if OFFLINE_ACCESS in grant.scopes:
        refresh = REFRESH_TOKEN_PREFIX + secrets.token_urlsafe(32)
        OAuthToken.objects.create(
            token_sha256=_sha256(refresh),
            kind=OAuthToken.Kind.REFRESH,
            grant=grant,
            scopes=scopes,
            expires_at=now + timedelta(seconds=settings.OAUTH_REFRESH_TOKEN_TTL_S),
        )
    return IssuedTokens(access_token=access, expires_in=ttl, scope=" ".join(scopes), refresh_token=refresh)


def oauth_code_exchange(*, client_id: str, code: str) -> IssuedTokens:
    """Spend a code (once) for tokens. Raises OAuthError(invalid_grant)."""
    with transaction.atomic():
        row = (
            OAuthCode.objects.select_for_update()
            .select_related("grant", "grant__client", "grant__user")
            .filter(code_sha256=_sha256(code), used_at__isnull=True, expires_at__gt=timezone.now())
            .first()
        )
        if row is None or row.grant.client.client_id != client_id or row.grant.revoked_at is not None:
            raise OAuthError("invalid_grant", "authorization code is invalid, expired or already used")
        row.used_at = timezone.now()
        row.save(update_fields=["used_at"])
        issued = _tokens_issue(row.grant, list(row.grant.scopes))
        audit_record(
            _grant_scope(row.grant),
            call=_oauth_call(),
            operation=Operation.OAUTH_TOKEN,
            detail={"client_id": client_id, "grant_id": row.grant.pk, "grant_type": "authorization_code"},
        )
    return issued


@dataclass(frozen=True)
class RefreshInfo:
    client_id: str
    scopes: list[str]
    expires_at: int
    resource: str
    subject: str


def oauth_refresh_load(*, client_id: str, token: str) -> RefreshInfo | None:
    """A live, unused refresh token of this client. A used one is a replay (rotation):
    the whole grant is revoked, so neither the thief nor the client keeps access."""
    with transaction.atomic():
        row = (
            OAuthToken.objects.select_for_update()
            .select_related("grant", "grant__client", "grant__user")
            .filter(token_sha256=_sha256(token), kind=OAuthToken.Kind.REFRESH)
            .first()
        )
        if row is None or row.grant.client.client_id != client_id or row.grant.revoked_at is not None:
            return None
        if row.used_at is not None:
            _grant_revoke(row.grant, reason="refresh_reuse", call=_oauth_call(), outcome=AuditEvent.Outcome.DENIED)
            return None
    return RefreshInfo(
        client_id=client_id,
        scopes=list(row.scopes),
        expires_at=int(row.expires_at.timestamp()),
        resource=row.grant.resource,
        subject=str(row.grant.user_id),
    )


def oauth_refresh_exchange(*, client_id: str, token: str, scopes: list[str]) -> IssuedTokens:
    """Rotate: the refresh token is spent and a new access + refresh pair issued."""
    with transaction.atomic():
        row = (
            OAuthToken.objects.select_for_update()
            .select_related("grant", "grant__client", "grant__user")
            .filter(
                token_sha256=_sha256(token),
                kind=OAuthToken.Kind.REFRESH,
                used_at__isnull=True,
                expires_at__gt=timezone.now(),
            )
            .first()
        )
        if row is None or row.grant.client.client_id != client_id or row.grant.revoked_at is not None:
            raise OAuthError("invalid_grant", "refresh token is invalid, expired or already used")
        row.used_at = timezone.now()
        row.save(update_fields=["used_at"])
        narrowed = [scope for scope in row.scopes if scope in scopes]
        issued = _tokens_issue(row.grant, narrowed)
        audit_record(
            _grant_scope(row.grant),
            call=_oauth_call(),
            operation=Operation.OAUTH_TOKEN,
            detail={"client_id": client_id, "grant_id": row.grant.pk, "grant_type": "refresh_token"},
        )
    return issued


@dataclass(frozen=True)
class AccessTokenInfo:
    user: Any
    scopes: frozenset[str]
    client_label: str
    grant_id: int


def oauth_access_token_authenticate(*, token: str, resource: str | None) -> AccessTokenInfo | None:
    """The grant behind a live access token issued for `resource` (RFC 8707 audience);
    None for anything else, including a token for another resource or a revoked grant.
    Records the grant's last use (at most once a minute)."""
    if not token.startswith(ACCESS_TOKEN_PREFIX) or not resource:
        return None
    row = (
        OAuthToken.objects.select_related("grant", "grant__client", "grant__user")
        .filter(token_sha256=_sha256(token), kind=OAuthToken.Kind.ACCESS, expires_at__gt=timezone.now())
        .first()
    )
    if row is None or row.grant.revoked_at is not None or not row.grant.user.is_active:
        return None
    if row.grant.resource.rstrip("/") != resource.rstrip("/"):
        return None
    now = timezone.now()
    if row.grant.last_used_at is None or now - row.grant.last_used_at > LAST_USED_RESOLUTION:
        OAuthGrant.objects.filter(pk=row.grant.pk).update(last_used_at=now)
    return AccessTokenInfo(
        user=row.grant.user,
        scopes=frozenset(row.scopes),
        client_label=client_label(row.grant.client),
        grant_id=row.grant.pk,
    )


def oauth_token_client_id(*, token: str) -> str | None:
    """The client an access or refresh token was issued to (None: unknown token)."""
    if not token.startswith((ACCESS_TOKEN_PREFIX, REFRESH_TOKEN_PREFIX)):
        return None
    row = OAuthToken.objects.select_related("grant__client").filter(token_sha256=_sha256(token)).first()
    return None if row is None else row.grant.client.client_id


def oauth_token_revoke(*, token: str) -> None:
    """RFC 7009: revoking either token of a grant revokes the grant. Unknown tokens: no-op."""
    with transaction.atomic():
        row = (
            OAuthToken.objects.select_related("grant", "grant__client", "grant__user")
            .filter(token_sha256=_sha256(token))
            .first()
        )
        if row is not None:
            grant = OAuthGrant.objects.select_for_update().select_related("client", "user").get(pk=row.grant_id)
            _grant_revoke(grant, reason="client_revoked", call=_oauth_call())


def oauth_grant_revoke(*, user: Any, grant_id: int, call: CallContext) -> None:
    """The user disconnects an app. Another user's grant behaves like a missing one."""
    with transaction.atomic():
        grant = (
            OAuthGrant.objects.select_for_update()
            .select_related("client", "user")
            .filter(pk=grant_id, user=user, revoked_at__isnull=True)
            .first()
        )
        if grant is None:
            raise ServiceError(ErrorCode.NOT_FOUND, "No such connected app.")
        _grant_revoke(grant, reason="user_revoked", call=call)
