import getpass
import sys

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.core.validators import validate_email
from django.db import IntegrityError, transaction

from core.errors import ServiceError
from memories.tenancy import username_check


class Command(BaseCommand):
    help = "Create a local account for the web UI (when OIDC is not configured)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--email", default="")
        parser.add_argument("--password-stdin", action="store_true", help="read the password from standard input")

    def handle(self, *args, username: str, email: str, password_stdin: bool, **options):
        User = get_user_model()
        # The arguments are checked before the password is asked for, and before anything is written.
        try:
            username = username_check(username)
        except ServiceError as exc:
            raise CommandError(exc.message) from None
        email = User.objects.normalize_email(email)
        email_max = User._meta.get_field("email").max_length
        if email_max is not None and len(email) > email_max:
            raise CommandError(f"--email is at most {email_max} characters")
        if email:
            try:
                validate_email(email)
            except ValidationError as exc:
                raise CommandError(f"--email: {' '.join(exc.messages)}") from None
        if User.objects.filter(username=username).exists():
            raise CommandError(f"user {username!r} already exists")
        try:
            if password_stdin:
                password = sys.stdin.readline().rstrip("\n")
            else:
                password = getpass.getpass("Password: ")
                if password != getpass.getpass("Password (again): "):
                    raise CommandError("the passwords differ")
        except UnicodeDecodeError:
            raise CommandError("the password is not valid text in this terminal's encoding") from None
        user = User(username=username, email=email)
        try:
            validate_password(password, user)
        except ValidationError as exc:
            raise CommandError(" ".join(exc.messages)) from None
        user.set_password(password)
        try:
            with transaction.atomic():
                user.save()
        except IntegrityError:  # created meanwhile by someone else
            raise CommandError(f"user {username!r} already exists") from None
        self.stdout.write(f"created {username!r}; sign in at /accounts/login/")
