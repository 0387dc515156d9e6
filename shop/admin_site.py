"""The admin site: Django's, with the pages that are not a model's list (the compare page, the
pitfall lab) listed in their app's module, first, as a model is listed: on the home page and in
the sidebar, each app shows once, under its own name.

`AdminConfig` replaces `django.contrib.admin` in INSTALLED_APPS (Django's way of overriding the
default site); apps name their pages with `add_page` from their AppConfig.ready().
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.contrib import admin
from django.contrib.admin.apps import AdminConfig as DjangoAdminConfig
from django.http import HttpRequest
from django.urls import reverse

#: (app label, the page's name, its URL name), in the order the apps added them.
_PAGES: list[tuple[str, str, str]] = []


def add_page(app_label: str, name: str, url_name: str) -> None:
    """List the admin page `url_name` as `name` in the module of app `app_label`."""
    if (app_label, name, url_name) not in _PAGES:
        _PAGES.append((app_label, name, url_name))


class ShopAdminSite(admin.AdminSite):
    def get_app_list(self, request: HttpRequest, app_label: str | None = None) -> list[Any]:
        """Django's list of apps and their models, each app's pages first. An app whose models
        the user may not see is listed with its pages alone (they are open to all staff)."""
        listed = super().get_app_list(request, app_label)
        by_label = {app["app_label"]: app for app in listed}
        for label, name, url_name in reversed(_PAGES):
            if app_label not in (None, label):
                continue
            app = by_label.get(label)
            if app is None:
                app = by_label[label] = {
                    "name": apps.get_app_config(label).verbose_name,
                    "app_label": label,
                    "app_url": reverse(url_name),
                    "has_module_perms": True,
                    "models": [],
                }
                listed.append(app)
            app["models"].insert(0, _page_row(name, url_name))
        return sorted(listed, key=lambda app: app["name"].lower())


def _page_row(name: str, url_name: str) -> dict[str, Any]:
    """A page, in the shape the admin's app list gives a model it may only view."""
    return {
        "name": name,
        "object_name": url_name.replace("-", "_"),
        "admin_url": reverse(url_name),
        "add_url": None,
        "view_only": True,
        "perms": {"add": False, "change": False, "delete": False, "view": True},
    }


class AdminConfig(DjangoAdminConfig):
    default_site = "shop.admin_site.ShopAdminSite"
