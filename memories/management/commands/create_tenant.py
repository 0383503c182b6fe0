from django.core.management.base import BaseCommand, CommandError

from core.errors import ServiceError
from memories.tenancy import tenant_create


class Command(BaseCommand):
    help = "Create a tenant (an organisation). Its name is fixed once created: it prefixes its users' partitions."

    def add_arguments(self, parser):
        parser.add_argument("name", help="lowercase letters, digits, '-' and '_'")
        parser.add_argument("--display-name", default="")

    def handle(self, *args, name: str, display_name: str, **options):
        try:
            tenant_create(name=name, display_name=display_name)
        except ServiceError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"created tenant {name!r}")
