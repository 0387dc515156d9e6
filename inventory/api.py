"""The JSON API. Views parse and validate, call one service or selector, render.

Errors are always `{"error": CODE, "detail": ...}`, a path no endpoint has included
(`not_found`; `shop.views` answers Django's own 400 and 500 so under /api/). Every view is
CSRF-exempt, as load tools need: a method a view does not take is answered 405, never refused
as a page's form would be.
"""

from __future__ import annotations

import hmac
import json
import logging
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, JsonResponse
from django.urls import Resolver404, resolve
from django.views.decorators.csrf import csrf_exempt

from . import selectors, services
from .exceptions import Busy, CheckoutError, InvalidRequest
from .metrics import CheckoutOutcome
from .models import SKU_PATTERN, Order
from .strategies.locks import lock_wait_seconds

logger = logging.getLogger(__name__)

CHECKOUT_FIELDS = {"sku", "qty", "buyer", "idempotency_key"}
#: What Item.sku (a SlugField of 64) can hold.


def error_response(
    code: str, detail: str, status: int, headers: dict[str, str] | None = None
) -> JsonResponse:
    return JsonResponse({"error": code, "detail": detail}, status=status, headers=headers)


def checkout_error_response(error: CheckoutError) -> JsonResponse:
    headers = None
    if isinstance(error, Busy):
        logger.warning("busy: %s", error.detail)
        headers = {"Retry-After": str(error.retry_after)}
    return error_response(error.code, error.detail, error.status, headers)


def method_not_allowed(request: HttpRequest, allowed: str) -> JsonResponse:
    return error_response(
        "method_not_allowed",
        f"{request.method} is not allowed here; use {allowed}",
        405,
        {"Allow": allowed},
    )


@dataclass(frozen=True)
class CheckoutRequest:
    sku: str
    qty: int
    buyer: str
    idempotency_key: str | None


def _text(data: dict[str, Any], field: str, *, max_length: int, required: bool) -> str | None:
    value = data.get(field)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{field}: a non-empty string is required")
    if len(value) > max_length:
        raise InvalidRequest(f"{field}: at most {max_length} characters")
    if not value.isprintable():
        raise InvalidRequest(f"{field}: control characters are not allowed")
    return value.strip()


def _required_text(data: dict[str, Any], field: str, *, max_length: int) -> str:
    value = _text(data, field, max_length=max_length, required=True)
    assert value is not None  # required: _text raised for a missing one
    return value


def parse_checkout(body: bytes) -> CheckoutRequest:
    """Validate a checkout body; raise InvalidRequest saying what is wrong."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # (RecursionError: JSON nested deeper than the parser's recursion limit)
        raise InvalidRequest("the body must be a JSON object") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    unexpected = sorted(set(data) - CHECKOUT_FIELDS)
    if unexpected:
        raise InvalidRequest(f"unexpected field(s): {', '.join(unexpected)}")
    qty = data.get("qty")
    if isinstance(qty, bool) or not isinstance(qty, int):
        raise InvalidRequest("qty: a whole number is required")
    if not 1 <= qty <= settings.FLASHSALE_MAX_QTY:
        raise InvalidRequest(f"qty: from 1 to {settings.FLASHSALE_MAX_QTY}")
    return CheckoutRequest(
        sku=_required_text(data, "sku", max_length=64),
        qty=qty,
        buyer=_required_text(data, "buyer", max_length=64),
        idempotency_key=_text(data, "idempotency_key", max_length=128, required=False),
    )


def _read_body(request: HttpRequest) -> bytes:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise InvalidRequest("Content-Length is not a number") from None
    if declared > limit:
        raise RequestDataTooBig
    return request.body


@csrf_exempt
def checkout(request: HttpRequest) -> JsonResponse:
    """POST /api/checkout: validate, sell through the item's strategy, answer."""
    if request.method != "POST":
        return method_not_allowed(request, "POST")
    lock_wait_seconds.set(0.0)
    with services.counted_checkout() as counted:
        response, counted.outcome = _checkout(request)
    waited = lock_wait_seconds.get()
    if waited:
        response["Server-Timing"] = f"lock;dur={waited * 1000:.2f}"
    return response


def _checkout(request: HttpRequest) -> tuple[JsonResponse, str]:
    """The answer, and its outcome: `accepted` or the error's code."""
    try:
        parsed = parse_checkout(_read_body(request))
    except RequestDataTooBig:
        too_large = error_response(
            "too_large",
            f"the body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes",
            413,
        )
        return too_large, CheckoutOutcome.INVALID
    except CheckoutError as error:
        return checkout_error_response(error), error.code
    return answer_checkout(
        sku=parsed.sku,
        qty=parsed.qty,
        buyer=parsed.buyer,
        idempotency_key=parsed.idempotency_key,
    )


def answer_checkout(
    *, sku: str, qty: int, buyer: str, idempotency_key: str | None
) -> tuple[JsonResponse, str]:
    """A validated checkout's answer, and its outcome: `accepted` or the error's code."""
    try:
        result = services.place_order(
            sku=sku, qty=qty, buyer=buyer, idempotency_key=idempotency_key
        )
    except CheckoutError as error:
        return checkout_error_response(error), error.code
    headers = {"Location": f"/api/orders/{result.order.public_id}"}
    if not result.created:
        headers["Idempotent-Replayed"] = "true"
    payload = selectors.checkout_payload(result.order)
    return JsonResponse(payload, status=201, headers=headers), CheckoutOutcome.ACCEPTED


@csrf_exempt
def noop(request: HttpRequest) -> JsonResponse:
    """The HTTP ceiling: what a request costs with no database and no Redis behind it.

    Reads and parses the body like a checkout does, so a load run's baseline pays the same
    HTTP and JSON work as the strategies it is compared with.
    """
    if request.method == "POST":
        try:
            parse_checkout(_read_body(request))
        except (CheckoutError, RequestDataTooBig):
            pass
    return JsonResponse({"ok": True})


def has_api_token(request: HttpRequest) -> bool:
    """Whether the request sends the bearer token FLASHSALE_API_TOKEN (what tools send)."""
    token = settings.FLASHSALE_API_TOKEN
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return bool(
        token and scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token.encode())
    )


def _may_audit(request: HttpRequest) -> bool:
    """A staff login, or the bearer token FLASHSALE_API_TOKEN (what load tools send)."""
    if has_api_token(request):
        return True
    user = getattr(request, "user", None)
    return bool(user and user.is_active and user.is_staff)


@csrf_exempt
def item_audit(request: HttpRequest, sku: str) -> JsonResponse:
    """`sale audit SKU --json` over HTTP, for load tools running on another machine: for staff,
    or with the bearer token FLASHSALE_API_TOKEN."""
    if request.method != "GET":
        return method_not_allowed(request, "GET")
    if not _may_audit(request):
        return error_response(
            "unauthorized",
            "the audit is for staff, or for a client sending the bearer token "
            "FLASHSALE_API_TOKEN (Authorization: Bearer ...)",
            401,
            {"WWW-Authenticate": 'Bearer realm="flashsale"'},
        )
    try:
        return JsonResponse(selectors.audit_sale(sku))
    except CheckoutError as error:
        return checkout_error_response(error)


#: Most `sku` parameters one GET /api/items takes.
MAX_ITEMS_PER_REQUEST = 100


@csrf_exempt
def item_list(request: HttpRequest) -> JsonResponse:
    """Several items in one answer: those named by repeated `sku` parameters, else every item
    on sale. The storefront's list polls this, once for all its cards.

    `{"items": [...], "unknown": [...]}`: each item as GET /api/items/<sku> has it, without the
    Redis figure (`redis_stock`), which costs a Redis call per item; `unknown` lists the skus
    named that no item has.
    """
    if request.method != "GET":
        return method_not_allowed(request, "GET")
    skus = request.GET.getlist("sku")
    if len(skus) > MAX_ITEMS_PER_REQUEST:
        return error_response(
            "invalid", f"at most {MAX_ITEMS_PER_REQUEST} sku parameters, got {len(skus)}", 400
        )
    bad = [sku for sku in skus if not SKU_PATTERN.fullmatch(sku)]
    if bad:
        return error_response("invalid", f"not a sku: {bad[0]!r} (1-64 of a-z A-Z 0-9 _ -)", 400)
    items = selectors.items_by_sku(skus) if skus else list(selectors.items_on_sale())
    known = {item.sku for item in items}
    return JsonResponse(
        {
            "items": [selectors.item_payload(item) for item in items],
            "unknown": [sku for sku in dict.fromkeys(skus) if sku not in known],
        }
    )


@csrf_exempt
def item_detail(request: HttpRequest, sku: str) -> JsonResponse:
    if request.method != "GET":
        return method_not_allowed(request, "GET")
    try:
        return JsonResponse(selectors.item_page(sku))
    except CheckoutError as error:
        return checkout_error_response(error)


@csrf_exempt
def order_detail(request: HttpRequest, order_id: str) -> JsonResponse:
    if request.method != "GET":
        return method_not_allowed(request, "GET")
    try:
        order = selectors.get_order(UUID(order_id))
    except (ValueError, Order.DoesNotExist):  # (ValueError: not a UUID, so no order's id)
        return error_response("unknown_order", f"no order {order_id}", 404)
    return JsonResponse(selectors.order_payload(order))


@csrf_exempt
def not_found(request: HttpRequest) -> JsonResponse:
    """Any path under /api/ that no endpoint has, whatever the method. The API's paths end
    without a slash (the pages' with one): a path that only has one too many says which is
    meant."""
    detail = f"no API endpoint at {request.path}"
    meant = request.path.rstrip("/")
    if meant != request.path:
        try:
            if resolve(meant).func is not not_found:
                detail += f"; did you mean {meant}?"
        except Resolver404:
            pass
    return error_response("not_found", detail, 404)


@csrf_exempt
def healthz(request: HttpRequest) -> JsonResponse:
    if request.method not in ("GET", "HEAD"):
        return method_not_allowed(request, "GET, HEAD")
    state = selectors.health()
    return JsonResponse(state, status=200 if state["ok"] else 503)
