from django.contrib import admin
from django.urls import include, path

from inventory import api
from loadtest.views import compare_view

from . import views

urlpatterns = [
    path("", views.item_list, name="item-list"),
    path("items/<str:sku>/", views.item_page, name="item"),
    path("orders/<uuid:order_id>/", views.order_page, name="order"),
    path("api/", include("inventory.urls")),
    path("healthz", api.healthz, name="healthz"),
    path("admin/compare/", compare_view, name="admin-compare"),
    path("admin/", admin.site.urls),
    # Browsers ask for /favicon.ico on pages that name no icon (the admin's).
    path("favicon.ico", views.favicon),
]
