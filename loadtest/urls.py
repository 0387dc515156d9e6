"""The admin's load-run pages, included by the root URLconf under `admin/`."""

from django.urls import path

from .views import compare_view

urlpatterns = [
    path("compare/", compare_view, name="admin-compare"),
]
