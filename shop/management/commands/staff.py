"""`manage.py staff USERNAME` (`make admin`): a staff login for the local shop's /admin/.

The password comes from DJANGO_SUPERUSER_PASSWORD, or is asked for at a terminal. With neither
the command says what to do and exits 1, having made nothing; for a login that exists already it
says so and how to change its password, and changes nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser


def change_password_hint(username: str) -> str:
    return f'make manage ARGS="changepassword {username}"'


class Command(BaseCommand):
    help = "Create a staff login (a superuser) for /admin/, unless it exists."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")

    def handle(self, *args: Any, **options: Any) -> None:
        username = options["username"]
        users = get_user_model()
        if users.objects.filter(username=username).exists():
            self.stdout.write(
                f"{username} already exists: nothing changed. To change its password: "
                f"{change_password_hint(username)}"
            )
            return
        password = os.environ.get("DJANGO_SUPERUSER_PASSWORD", "")
        if password:
            users.objects.create_superuser(username=username, email="", password=password)
        elif sys.stdin.isatty():
            call_command("createsuperuser", username=username, email="", interactive=True)
        else:
            raise CommandError(
                f"no login made: no password for {username}, and no terminal to ask for one. "
                "Give it in DJANGO_SUPERUSER_PASSWORD (DJANGO_SUPERUSER_PASSWORD=... make admin), "
                "or run make admin in a terminal"
            )
        self.stdout.write(f"{username} can log in at /admin/")
