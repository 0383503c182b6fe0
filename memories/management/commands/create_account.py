import getpass
import sys

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Create a local account for the web UI (when OIDC is not configured)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--email", default="")
        parser.add_argument("--password-stdin", action="store_true", help="read the password from standard input")

    def handle(self, *args, username: str, email: str, password_stdin: bool, **options):
        User = get_user_model()
        if User.objects.filter(username=username).exists():
            raise CommandError(f"user {username!r} already exists")
        if password_stdin:
            password = sys.stdin.readline().rstrip("\n")
        else:
            password = getpass.getpass("Password: ")
            if password != getpass.getpass("Password (again): "):
                raise CommandError("the passwords differ")
        user = User(username=username, email=email)
        try:
            validate_password(password, user)
        except ValidationError as exc:
            raise CommandError(" ".join(exc.messages)) from None
        user.set_password(password)
        user.save()
        self.stdout.write(f"created {username!r}; sign in at /accounts/login/")
