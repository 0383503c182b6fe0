from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from memories.services import api_key_issue


class Command(BaseCommand):
    help = "Print a new bearer API key for USERNAME (shown once; only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--create-user", action="store_true", help="create the user if missing")
        parser.add_argument("--name", default="", help="a label for the key")

    def handle(self, *args, username: str, create_user: bool, name: str, **options):
        User = get_user_model()
        user = User.objects.filter(username=username).first()
        if user is None:
            if not create_user:
                raise CommandError(f"no user {username!r}; pass --create-user to create one")
            user = User.objects.create_user(username=username)
            self.stderr.write(f"created user {username!r} (no password; set one with changepassword)")
        api_key, plain = api_key_issue(user=user, name=name or "issued by manage.py")
        self.stderr.write(f"issued key {api_key.key_id} for {username!r}")
        self.stdout.write(plain)
