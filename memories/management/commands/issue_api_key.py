from datetime import UTC, datetime, time, timedelta

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils import timezone

from core.choices import Channel, Role, permissions_parse
from core.errors import ServiceError
from core.inputs import digits_int
from core.scope import DEFAULT_TENANT, CallContext, user_tenant
from memories.services import api_key_issue
from memories.tenancy import tenant_name_check, tenant_user_create


def parse_expiry(raw: str) -> datetime:
    """`30d`, `12h`, an ISO date (end of that day, UTC) or an ISO datetime; in UTC, and in
    the future (checked here, before the command writes anything)."""
    raw = raw.strip()
    amount = digits_int(raw[:-1], max_digits=5)
    if amount is not None and raw[-1:] in ("d", "h"):
        parsed = timezone.now() + (timedelta(days=amount) if raw.endswith("d") else timedelta(hours=amount))
    else:
        try:
            parsed = datetime.fromisoformat(raw)
        except ValueError:
            raise CommandError("--expires takes 30d, 12h, 2027-01-31 or an ISO 8601 datetime") from None
        if len(raw) == 10:  # a date: valid through that day
            parsed = datetime.combine(parsed.date(), time.max)
        try:
            # A time past year 9999 in UTC could be stored, but not read back.
            parsed = (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).astimezone(UTC)
        except OverflowError:
            raise CommandError("--expires is out of range") from None
    if parsed <= timezone.now():
        raise CommandError("--expires must be in the future")
    return parsed


class Command(BaseCommand):
    help = "Print a new bearer API key for USERNAME (shown once; only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--create-user", action="store_true", help="create the user if missing")
        parser.add_argument("--name", default="", help="a label for the key (shown as the client app)")
        parser.add_argument("--tenant", default=None, help=f"the user's tenant (default {DEFAULT_TENANT!r})")
        parser.add_argument(
            "--role",
            default=Role.USER,
            choices=Role.values,
            help="user: its own memories; tenant_admin: any user of its tenant; platform: anyone "
            "(the last two name their subject with X-Memory-Subject: <tenant>/<username>)",
        )
        parser.add_argument("--permissions", default="read,write,delete", help="some of read,write,delete")
        parser.add_argument("--expires", default=None, help="30d, 12h, a date or an ISO datetime (default: never)")

    def handle(self, *args, username: str, create_user: bool, name: str, tenant, role, permissions, expires, **opts):
        # Every argument is checked before anything is written.
        try:
            permission_set = permissions_parse(permissions)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if tenant is not None:
            try:
                tenant_name_check(tenant)
            except ServiceError as exc:
                raise CommandError(exc.message) from None
        expires_at = parse_expiry(expires) if expires else None
        user = _user_named(username)
        created = False
        try:
            # One transaction: a key that cannot be issued leaves no user created for it.
            with transaction.atomic():
                if user is None:
                    if not create_user:
                        raise CommandError(f"no user {username!r}; pass --create-user to create one")
                    user = tenant_user_create(tenant=tenant or DEFAULT_TENANT, username=username)
                    created = True
                elif tenant is not None and user_tenant(user) != tenant:
                    raise CommandError(f"user {username!r} is in tenant {user_tenant(user)!r}, not {tenant!r}")
                api_key, plain = api_key_issue(
                    user=user,
                    name=name or "issued by manage.py",
                    role=role,
                    permissions=permission_set,
                    expires_at=expires_at,
                    call=CallContext(
                        channel=Channel.INTERNAL, actor_username="manage.py issue_api_key", actor_auth="operator"
                    ),
                )
        except ServiceError as exc:
            raise CommandError(exc.message) from None
        if created:
            self.stderr.write(f"created user {user.get_username()!r} in tenant {user_tenant(user)!r} (no password)")
        expiry = f", expires {api_key.expires_at:%Y-%m-%d %H:%M} UTC" if api_key.expires_at else ""
        self.stderr.write(
            f"issued key {api_key.key_id} for {user_tenant(user)}/{user.get_username()} "
            f"(role {role}, permissions {api_key.permissions}{expiry})"
        )
        self.stdout.write(plain)


def _user_named(username: str):
    """The user of that name, or None: also for a name no user can have (too long, or text
    the database refuses), which `--create-user` then rejects with the reason."""
    User = get_user_model()
    max_length: int | None = getattr(User._meta.get_field(User.USERNAME_FIELD), "max_length", None)
    if not username or "\x00" in username or (max_length is not None and len(username) > max_length):
        return None
    try:
        username.encode()
    except UnicodeEncodeError:
        return None
    return User.objects.filter(username=username).first()
