from django.contrib import admin
from django.urls import include, path

from inventory import api

from . import metrics, views

urlpatterns = [
    # The API first: a flash crowd's requests are tried against no page's pattern.
    path("api/", include("inventory.urls")),
    path("", views.item_list, name="item-list"),
    path("items/<str:sku>/", views.item_page, name="item"),
    path("orders/<uuid:order_id>/", views.order_page, name="order"),
    path("healthz", api.healthz, name="healthz"),
    path("metrics", metrics.metrics, name="metrics"),
    # Before the admin's own catch-all; named by string, so shop imports nothing of loadtest.
    path("admin/", include("loadtest.urls")),
    path("admin/", include("pitfalls.urls")),
    path("admin/", admin.site.urls),
    # Browsers ask for /favicon.ico on pages that name no icon (the admin's).
    path("favicon.ico", views.favicon),
]

# Under /api/ these answer the API's JSON errors, elsewhere Django's pages.
handler400 = views.bad_request
handler500 = views.server_error
