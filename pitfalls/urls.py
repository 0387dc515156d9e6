"""The admin's pitfall lab page, included by the root URLconf under `admin/`."""

from django.urls import path

from .views import lab_view

urlpatterns = [
    path("pitfalls/", lab_view, name="admin-pitfalls"),
]
