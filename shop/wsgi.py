"""WSGI entry point: `shop.wsgi:application`."""

import os

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

application = get_wsgi_application()

if not settings.DATABASE_URL_IS_SET:
    raise ImproperlyConfigured(
        "DATABASE_URL is not set: the shop will not serve without its database. Set it, or "
        "start it with `make serve`, which starts an embedded PostgreSQL."
    )
if not (settings.SECRET_KEY_IS_SET or settings.DEBUG):
    raise ImproperlyConfigured(
        "DJANGO_SECRET_KEY is not set: the shop will not serve with a key anyone can read. "
        "Set it (docker compose: in .env), or start it with `make serve`, which keeps one in "
        ".data/secret_key."
    )

# A web process that died mid-sale may have left Redis short of the units it took: each one
# that starts repairs the sales that sold lately (`inventory.recovery`), in a thread of its own.
from inventory.recovery import repair_in_the_background  # noqa: E402 - needs Django set up

repair_in_the_background()
