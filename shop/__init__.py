"""The flashsale Django project: settings, URLs, WSGI, the Celery app and the storefront."""

from .celery import app as celery_app

__all__ = ("celery_app",)
