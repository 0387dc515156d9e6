/* flashsale storefront: keeps the rendered pages current without a reload.
 *
 * - items ([data-item]): poll every second for stock and opening time (the item page: GET
 *   /api/items/<sku>; the list: one GET /api/items for all its cards); count down to a later
 *   opening; show on sale / opens soon / sold out / limit reached.
 * - the buy form ([data-buy-form]): enabled only while the item can be bought (its quantity
 *   offered only then, or before the sale opens); disabled on submit so a double click sends
 *   one request (the server's idempotency key covers the rest).
 * - orders ([data-order]): poll GET /api/orders/<id> until confirmed, failed or expired.
 * - the health banner ([data-health-banner]): poll /healthz; say when the database fallback is
 *   serving checkout because Redis is down.
 *
 * Network failures are shown on the page, never thrown: a poll that fails is tried again.
 */
(function () {
  "use strict";

  var ITEM_POLL_MS = 1000;
  var ORDER_POLL_MS = 1000;
  var HEALTH_POLL_MS = 2000;
  var FINAL_STATUSES = ["confirmed", "failed", "expired"];
  var STATUS_TEXT = {
    pending: "We have your units; the payment is being processed.",
    paid: "Paid; confirming your order.",
    confirmed: "Confirmed. Thank you!",
    failed: "The payment was declined; the units went back on sale.",
    expired: "Not paid in time; the units went back on sale.",
  };
  var STEPS = ["pending", "paid", "confirmed"];

  // The server's clock, as rendered into the page: countdowns use it, not the visitor's.
  var serverNow = Date.parse(document.body.getAttribute("data-server-now") || "");
  var clockSkew = isNaN(serverNow) ? 0 : serverNow - Date.now();

  function now() {
    return Date.now() + clockSkew;
  }

  function setText(element, text) {
    // Only touch the DOM on a change, so aria-live regions announce changes, not every poll.
    if (element && element.textContent !== text) {
      element.textContent = text;
    }
  }

  function parseTime(value) {
    var parsed = Date.parse(value || "");
    return isNaN(parsed) ? null : parsed;
  }

  /* GETs url every interval ms while the page is visible (first at once when immediately) and
   * hands each answer ({ok, status, data}) to onData, which returns false to stop polling.
   * onError gets network failures; polling goes on after them. */
  function poll(url, interval, onData, onError, immediately) {
    var timer = null;
    var stopped = false;
    var inFlight = false;

    function schedule() {
      if (!stopped && timer === null && !document.hidden) {
        timer = window.setTimeout(tick, interval);
      }
    }

    function tick() {
      timer = null;
      if (stopped || inFlight) {
        return;
      }
      inFlight = true;
      fetch(url, { headers: { Accept: "application/json" }, cache: "no-store" })
        .then(function (response) {
          return response.json().then(function (data) {
            return { ok: response.ok, status: response.status, data: data };
          });
        })
        .then(function (answer) {
          if (onData(answer) === false) {
            stopped = true;
          }
        })
        .catch(function (error) {
          if (onError) {
            onError(error);
          }
        })
        .then(function () {
          inFlight = false;
          schedule();
        });
    }

    document.addEventListener("visibilitychange", function () {
      if (!document.hidden && timer === null && !inFlight) {
        tick();
      }
    });
    if (immediately) {
      tick();
    } else {
      schedule();
    }
  }

  function formatCountdown(milliseconds) {
    var total = Math.max(0, Math.ceil(milliseconds / 1000));
    var hours = Math.floor(total / 3600);
    var minutes = Math.floor((total % 3600) / 60);
    var seconds = total % 60;
    var mm = (hours ? String(minutes).padStart(2, "0") : String(minutes)) + ":";
    return (hours ? hours + ":" : "") + mm + String(seconds).padStart(2, "0");
  }

  /* One item on the list or the item page. */
  function ItemWidget(root) {
    this.root = root;
    this.url = root.getAttribute("data-item-url");
    this.stock = parseInt(root.getAttribute("data-stock-value"), 10) || 0;
    this.initialStock = parseInt(root.getAttribute("data-initial-stock"), 10) || null;
    this.opensAt = parseTime(root.getAttribute("data-opens-at"));
    this.onSale = root.hasAttribute("data-item-page")
      ? root.getAttribute("data-on-sale") === "true"
      : true;
    this.limitReached = root.getAttribute("data-limit-reached") === "true";
    this.limitBuyer = root.getAttribute("data-limit-buyer") || "";
    this.badge = root.querySelector("[data-state-badge]");
    this.stockText = root.querySelector("[data-stock-text]");
    this.meter = root.querySelector("[data-stock-meter]");
    this.countdown = root.querySelector("[data-countdown]");
    this.clock = root.querySelector("[data-countdown-clock]");
    this.form = root.querySelector("[data-buy-form]");
    this.button = root.querySelector("[data-buy-button]");
    this.buyerInput = root.querySelector("input[name=buyer]");
    this.qtyInput = root.querySelector("input[name=qty]");
    this.qtyHint = root.querySelector("#qty-hint");
    this.message = root.querySelector("[data-sale-message]");
    this.submitting = false;
    this.clockTimer = null;
    this.connectionLost = false;
  }

  ItemWidget.prototype.phase = function () {
    if (!this.onSale) {
      return "not_on_sale";
    }
    if (this.opensAt !== null && this.opensAt > now()) {
      return "not_started";
    }
    if (this.stock <= 0) {
      return "sold_out";
    }
    if (this.limitReached && (!this.buyerInput || this.buyerInput.value.trim() === this.limitBuyer)) {
      return "limit_reached";
    }
    return "on_sale";
  };

  ItemWidget.prototype.render = function () {
    var phase = this.phase();
    var badges = {
      not_on_sale: "Not on sale",
      not_started: "Opens soon",
      sold_out: "Sold out",
      limit_reached: "Limit reached",
      on_sale: "On sale",
    };
    this.root.setAttribute("data-phase", phase);
    if (this.badge) {
      setText(this.badge, badges[phase]);
    }
    if (this.stockText) {
      setText(this.stockText, this.stock > 0 ? this.stock + " left" : "none left");
    }
    if (this.meter && this.initialStock) {
      var percent = Math.max(0, Math.min(100, (100 * this.stock) / this.initialStock));
      this.meter.style.width = percent.toFixed(1) + "%";
    }
    if (this.countdown) {
      this.countdown.hidden = phase !== "not_started";
    }
    if (phase === "not_started") {
      setText(this.clock, formatCountdown(this.opensAt - now()));
      this.startClock();
    }
    if (this.message && this.message.textContent.trim()) {
      // The "limit reached" note holds for the name it was rendered for.
      this.message.hidden = phase !== "limit_reached";
    }
    if (this.button) {
      this.button.disabled = this.submitting || phase !== "on_sale";
    }
    // A quantity is offered only while the item is, or is about to be, on sale to this name.
    var offered = phase === "on_sale" || phase === "not_started";
    if (this.qtyInput && !this.submitting) {
      this.qtyInput.disabled = !offered;
    }
    if (this.qtyHint) {
      this.qtyHint.hidden = !offered;
    }
  };

  ItemWidget.prototype.startClock = function () {
    var widget = this;
    if (this.clockTimer !== null) {
      return;
    }
    this.clockTimer = window.setInterval(function () {
      if (widget.opensAt === null || widget.opensAt <= now()) {
        window.clearInterval(widget.clockTimer);
        widget.clockTimer = null;
      }
      widget.render();
    }, 250);
  };

  ItemWidget.prototype.update = function (answer) {
    if (answer.ok) {
      var data = answer.data;
      this.stock = data.stock;
      this.initialStock = data.initial_stock || this.initialStock;
      this.opensAt = parseTime(data.opens_at);
      this.onSale = data.sale_started_at !== null;
      var facts = this.root.querySelectorAll("[data-fact]");
      for (var i = 0; i < facts.length; i++) {
        var value = data[facts[i].getAttribute("data-fact")];
        setText(facts[i], value === null || value === undefined ? "–" : String(value));
      }
    } else if (answer.status === 404) {
      this.onSale = false;
    }
    this.render();
  };

  ItemWidget.prototype.start = function () {
    var widget = this;
    this.render();
    if (this.form) {
      this.form.addEventListener("submit", function (event) {
        if (widget.submitting || widget.phase() !== "on_sale") {
          event.preventDefault();
          return;
        }
        widget.submitting = true;
        widget.form.setAttribute("aria-busy", "true");
        setText(widget.form.querySelector("[data-buy-label]"), "Placing your order…");
        // The form data is taken after this handler, without the button: disabling it now
        // means a second click sends nothing.
        widget.render();
      });
      if (this.buyerInput) {
        this.buyerInput.addEventListener("input", function () {
          widget.render();
        });
      }
    }
    // A page restored from the back/forward cache must not stay "placing your order".
    window.addEventListener("pageshow", function (event) {
      if (event.persisted) {
        window.location.reload();
      }
    });
    if (this.url) {
      poll(this.url, ITEM_POLL_MS, function (answer) {
        widget.update(answer);
      });
    }
  };

  /* The order page: live status until the order is final. */
  function OrderWidget(root) {
    this.root = root;
    this.url = root.getAttribute("data-order-url");
    this.badge = root.querySelector("[data-order-status]");
    this.text = root.querySelector("[data-order-status-text]");
    this.pollingHint = root.querySelector("[data-order-polling]");
    this.steps = root.querySelectorAll("[data-step]");
  }

  OrderWidget.prototype.render = function (status) {
    this.root.setAttribute("data-status", status);
    setText(this.badge, status);
    this.badge.className = "badge badge--" + status;
    setText(this.text, STATUS_TEXT[status] || status);
    var reached = STEPS.indexOf(status);
    for (var i = 0; i < this.steps.length; i++) {
      var step = this.steps[i];
      var index = STEPS.indexOf(step.getAttribute("data-step"));
      var done = reached >= 0 && index <= reached;
      step.classList.toggle("done", done);
      step.classList.toggle("stopped", reached < 0 && index > 0);
      if (index === reached) {
        step.setAttribute("aria-current", "step");
      } else {
        step.removeAttribute("aria-current");
      }
    }
    var final = FINAL_STATUSES.indexOf(status) >= 0;
    if (this.pollingHint) {
      this.pollingHint.hidden = final;
    }
    return final;
  };

  OrderWidget.prototype.start = function () {
    var widget = this;
    if (this.render(this.root.getAttribute("data-status"))) {
      return;
    }
    poll(this.url, ORDER_POLL_MS, function (answer) {
      if (!answer.ok) {
        return true;
      }
      return !widget.render(answer.data.status);
    });
  };

  /* The banner under the header: the Redis fallback, or a shop that does not answer. */
  function startHealthBanner(banner, url) {
    function show(kind, html) {
      banner.className = "banner banner--" + (kind === "fallback" ? "warning" : "error");
      banner.setAttribute("data-kind", kind);
      if (banner.innerHTML !== html) {
        banner.innerHTML = html;
      }
      banner.hidden = false;
    }
    function hide() {
      banner.hidden = true;
      banner.setAttribute("data-kind", "");
    }
    poll(
      url,
      HEALTH_POLL_MS,
      function (answer) {
        var data = answer.data || {};
        if (data.database && data.database !== "ok") {
          show(
            "database",
            "<strong>Checkout is unavailable.</strong> The shop's database is not answering; " +
              "please try again shortly."
          );
        } else if (data.fallback_active) {
          show(
            "fallback",
            "<strong>Fallback active.</strong> Redis is down, so the database is serving " +
              "checkout. You can still buy; it may be a little slower."
          );
        } else {
          hide();
        }
      },
      function () {
        show("offline", "<strong>Connection lost.</strong> Trying to reach the shop again…");
      },
      true
    );
  }

  /* The list: one poll of every item on sale feeds all the cards. A card whose item is not in
   * the answer any more is no longer on sale. */
  function startItemList(list) {
    var widgets = {};
    var cards = list.querySelectorAll("[data-item][data-sku]");
    for (var i = 0; i < cards.length; i++) {
      var widget = new ItemWidget(cards[i]);
      widget.start();
      widgets[cards[i].getAttribute("data-sku")] = widget;
    }
    poll(list.getAttribute("data-items-url"), ITEM_POLL_MS, function (answer) {
      if (!answer.ok) {
        return true;
      }
      var bySku = {};
      answer.data.items.forEach(function (item) {
        bySku[item.sku] = item;
      });
      Object.keys(widgets).forEach(function (sku) {
        widgets[sku].update(
          sku in bySku
            ? { ok: true, status: 200, data: bySku[sku] }
            : { ok: false, status: 404, data: null }
        );
      });
      return true;
    });
  }

  function init() {
    var list = document.querySelector("[data-items-url]");
    if (list) {
      startItemList(list);
    }
    var items = document.querySelectorAll("[data-item]:not([data-sku])");
    for (var i = 0; i < items.length; i++) {
      new ItemWidget(items[i]).start();
    }
    var order = document.querySelector("[data-order]");
    if (order) {
      new OrderWidget(order).start();
    }
    var banner = document.querySelector("[data-health-banner]");
    var healthUrl = document.body.getAttribute("data-health-url");
    if (banner && healthUrl) {
      startHealthBanner(banner, healthUrl);
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();
