from datetime import UTC, datetime, time, timedelta

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from core.choices import Role, permissions_parse
from core.errors import ServiceError
from core.inputs import digits_int
from core.scope import DEFAULT_TENANT, user_tenant
from memories.services import api_key_issue
from memories.tenancy import tenant_user_create


def parse_expiry(raw: str) -> datetime:
    """`30d`, `12h`, an ISO date (end of that day, UTC) or an ISO datetime."""
    raw = raw.strip()
    amount = digits_int(raw[:-1], max_digits=5)
    if amount is not None and raw[-1:] in ("d", "h"):
        return timezone.now() + (timedelta(days=amount) if raw.endswith("d") else timedelta(hours=amount))
    try:
        parsed = datetime.fromisoformat(raw)
    except ValueError:
        raise CommandError("--expires takes 30d, 12h, 2027-01-31 or an ISO 8601 datetime") from None
    if len(raw) == 10:  # a date: valid through that day
        parsed = datetime.combine(parsed.date(), time.max)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


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
        try:
            permission_set = permissions_parse(permissions)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        expires_at = parse_expiry(expires) if expires else None
        user = get_user_model().objects.filter(username=username).first()
        try:
            if user is None:
                if not create_user:
                    raise CommandError(f"no user {username!r}; pass --create-user to create one")
                user = tenant_user_create(tenant=tenant or DEFAULT_TENANT, username=username)
                self.stderr.write(f"created user {username!r} in tenant {user_tenant(user)!r} (no password)")
            elif tenant is not None and user_tenant(user) != tenant:
                raise CommandError(f"user {username!r} is in tenant {user_tenant(user)!r}, not {tenant!r}")
            api_key, plain = api_key_issue(
                user=user,
                name=name or "issued by manage.py",
                role=role,
                permissions=permission_set,
                expires_at=expires_at,
            )
        except ServiceError as exc:
            raise CommandError(exc.message) from None
        expiry = f", expires {api_key.expires_at:%Y-%m-%d %H:%M} UTC" if api_key.expires_at else ""
        self.stderr.write(
            f"issued key {api_key.key_id} for {user_tenant(user)}/{username} "
            f"(role {role}, permissions {api_key.permissions}{expiry})"
        )
        self.stdout.write(plain)
