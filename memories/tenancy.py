"""Tenants (organisations) and who may act for whom (issue 12).

Every user belongs to one tenant (`TenantMembership`; none means the default tenant).
The engine partition stays `{tenant}:{user_pk}`. A `tenant_admin` principal may act for
the users of its own tenant, a `platform` principal for anyone; an ordinary principal only
for itself. Resolution answers a user of another tenant exactly like a missing one."""

from __future__ import annotations

import re
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from core.choices import Role
from core.errors import ErrorCode, ServiceError
from core.scope import DEFAULT_TENANT
from memories.models import Tenant, TenantMembership

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def tenant_name_check(name: str) -> str:
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ServiceError(
            ErrorCode.INVALID_ARGUMENT,
            "A tenant name is 1-63 characters: lowercase letters, digits, '-' and '_', "
            "starting with a letter or digit.",
        )
    return name


# --- services ---------------------------------------------------------------------------
def tenant_create(*, name: str, display_name: str = "") -> Tenant:
    """Create a tenant; `conflict` if it exists."""
    tenant_name_check(name)
    try:
        with transaction.atomic():
            return Tenant.objects.create(name=name, display_name=display_name[:200])
    except IntegrityError:
        raise ServiceError(ErrorCode.CONFLICT, f"Tenant {name!r} already exists.") from None


def tenant_ensure(*, name: str) -> Tenant:
    """The tenant, created on first use (the default tenant, OIDC fixed mappings)."""
    tenant_name_check(name)
    tenant, _ = Tenant.objects.get_or_create(name=name)
    return tenant


def username_check(username: str) -> str:
    """A username a new account may have, as the user model stores it (NFKC-normalised);
    `invalid_argument` otherwise. Checked before anything is written: the database would
    take an empty or oddly spelled name, and refuse an overlong one only at the INSERT."""
    User = get_user_model()
    max_length: int | None = getattr(User._meta.get_field(User.USERNAME_FIELD), "max_length", None)
    if not isinstance(username, str):
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "A username is a string.")
    normalized = User.normalize_username(username)
    if not normalized:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "A username cannot be empty.")
    if max_length is not None and len(normalized) > max_length:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"A username is at most {max_length} characters.")
    try:
        User.username_validator(normalized)
    except ValidationError as exc:
        message = f"Username {normalized[:40]!r}: {' '.join(exc.messages)}"
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, message) from None
    return normalized


@transaction.atomic
def tenant_user_create(*, tenant: str, username: str, email: str = "") -> Any:
    """A new user in `tenant` (which must exist, except the default one); `invalid_argument`
    for a username the user model does not allow, `conflict` if it is taken."""
    username = username_check(username)
    if tenant == DEFAULT_TENANT:
        tenant_ensure(name=tenant)
    elif not Tenant.objects.filter(name=tenant).exists():
        raise ServiceError(ErrorCode.NOT_FOUND, f"No tenant {tenant[:63]!r}.")
    try:
        # A savepoint: a name taken meanwhile (or equal once normalised) is a conflict, not a 500.
        with transaction.atomic():
            user = get_user_model().objects.create_user(username=username, email=email)
    except IntegrityError:
        raise ServiceError(ErrorCode.CONFLICT, f"User {username!r} already exists.") from None
    TenantMembership.objects.create(user=user, tenant_id=tenant)
    return user


# --- selectors ----------------------------------------------------------------------------
def tenant_user_get(*, tenant: str, username: str) -> Any | None:
    """The active user `username` of `tenant`, or None."""
    user = (
        get_user_model().objects.filter(username=username, is_active=True).select_related("tenant_membership").first()
    )
    if user is None:
        return None
    membership = getattr(user, "tenant_membership", None)
    return user if (membership.tenant_id if membership else DEFAULT_TENANT) == tenant else None


NO_SUBJECT_MESSAGE = "No such user."


def subject_parse(raw: str) -> tuple[str, str]:
    """`<tenant>/<username>` -> (tenant, username); `invalid_argument` otherwise."""
    tenant, sep, username = raw.partition("/")
    if not sep or not tenant or not username:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "X-Memory-Subject must be <tenant>/<username>.")
    return tenant, username


def subject_resolve(*, actor_tenant: str, actor_user: Any, role: str, tenant: str, username: str) -> Any:
    """The user a principal acts for, or a ServiceError:
    - itself: always;
    - an ordinary principal naming anyone else: `forbidden` (denied);
    - `tenant_admin` naming a user of another tenant: `not_found`, the same answer (code,
      message) as a user that does not exist;
    - `platform`: any existing user."""
    if tenant == actor_tenant and username == actor_user.get_username():
        return actor_user
    if role not in (Role.TENANT_ADMIN, Role.PLATFORM):
        raise ServiceError(ErrorCode.FORBIDDEN, "This credential may act only for its own user.", denied=True)
    # Look the user up in every case, so the other-tenant answer does not come faster.
    subject = tenant_user_get(tenant=tenant, username=username)
    if subject is None or (role == Role.TENANT_ADMIN and tenant != actor_tenant):
        raise ServiceError(ErrorCode.NOT_FOUND, NO_SUBJECT_MESSAGE, denied=True)
    return subject
