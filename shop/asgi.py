"""ASGI entry point: `shop.asgi:application` (uvicorn, granian's ASGI interface).

Under it the checkout is an async view (`inventory.async_checkout`): `lua`'s sales batched on
each process's event loop."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
os.environ["FLASHSALE_ASGI"] = "1"

application = get_asgi_application()
