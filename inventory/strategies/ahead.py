"""Units taken ahead: `lua` stock one process took from a sale's counters for its next
checkouts, so that most of its batches run no script (docs/decisions/0035-units-taken-ahead.md).

A batch that cannot be served from what its process holds runs the take script; one of
several checkouts (LEAST_BATCH) takes BATCHES_AHEAD times its units more, for the process to
hold. Held units are out of Redis, so:
- the script that takes them registers the process as a holder of the sale first, in the same
  step (a Redis hash, leases on Redis's clock): while another holder's lease runs, a short
  take is told busy, not sold out, and the reconciler leaves Redis alone;
- they go back after IDLE_SECONDS unused, MOST_SECONDS at most, and at exit, with the
  counters' generation they were taken in: once the counters were set from the database
  since (which counts them), or Redis lost its keys, the give-back adds nothing;
- a Redis failure drops them: the counters are rebuilt from the database, as after any failure.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

from locking import Claim
from locking.counter import Registration, Take

from .. import keys
from ..breaker import breaker
from ..models import Item
from ..redis_client import REDIS_DOWN_ERRORS
from .counters import counter, holder_registry

logger = logging.getLogger(__name__)

#: A batch that runs the script takes this many times its own units more, to hold,
BATCHES_AHEAD = 8
#: when it holds at least this many checkouts: a process whose checkouts do not batch (a sync
#: worker) sells no faster for held units, and its database rows meet more often
#: (docs/decisions/0036-a-short-take-waits-for-units-held-elsewhere.md),
LEAST_BATCH = 2
#: and never more than this share of the units the item row counts (the sale's supply, until
#: the reconciler folds what its stock rows hold into it): a process holds no large part of a
#: small sale, whose last units other processes' buyers would wait for.
MOST_SHARE = 1 / 100
#: What a process held and has not served from for this long goes back to the counters.
IDLE_SECONDS = 0.05
#: What a process holds goes back this long after it was taken, served from or not.
MOST_SECONDS = 1.0
#: After a take ahead finds the counters short, the process gives back what it holds at once
#: and takes none for this long: near the end of a sale its checkouts take their own units
#: only, and register as holders no more.
SHORT_SECONDS = 1.0
#: A holder's registration lasts this long unless renewed: long enough to outlive what it
#: holds (MOST_SECONDS), short enough that a process that died holding units keeps the others
#: answering busy (and the reconciler waiting) only a few seconds.
LEASE_MS = 3000
#: The sale's registrations are kept this long after the last one: a lease that ran out (a
#: process that died holding units) stays visible to the reconciler, which runs every 60 s.
KEEP_MS = 300_000


@dataclass
class _Held:
    """The units one process holds of one sale: stock row -> units."""

    item: Item
    units: dict[int, int]
    taken_at: float
    used_at: float
    #: The last take ahead found the counters short: the sale is nearly sold out.
    short: bool = False

    def due(self, idle: float, most: float) -> float:
        """When it goes back (with nothing left, the registration ends then). At once near the
        end of the sale: another process's buyer is told busy while it is held."""
        if self.short:
            return self.used_at
        return min(self.used_at + idle, self.taken_at + most)


def _key(item: Item) -> tuple[int, int | None]:
    return item.pk, item.current_sale_id


class Holding:
    """What one process holds of each sale's units, and its registration as their holder.

    `serve` and `take` are called by the batch being written (one at a time in a process),
    `give_back` by a thread of its own when units are due back, and by a checkout that found
    the counters short. A take ahead (its script registers the process) and a give-back (its
    script ends the registration) never run at once.
    """

    def __init__(
        self,
        *,
        idle: float = IDLE_SECONDS,
        most: float = MOST_SECONDS,
        lease_ms: int = LEASE_MS,
        least_batch: int = LEAST_BATCH,
    ) -> None:
        self.idle = idle
        self.most = most
        self.lease_ms = lease_ms
        self.least_batch = least_batch
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # A forked child holds nothing (its parent's units are its parent's), and its locks are
        # new: a thread of the parent may have held them at the fork.
        self._lock = threading.Lock()
        self._due = threading.Condition(self._lock)
        #: Held against a give-back while a batch registers and takes units ahead.
        self._refill = threading.Lock()
        self.token = uuid.uuid4().hex
        self._held: dict[tuple[int, int | None], _Held] = {}
        #: The generation of the counters the units held of each sale were taken in.
        self._registered: dict[tuple[int, int | None], str] = {}
        #: Until when no units are taken ahead for a sale (`units_to_take`).
        self._short: dict[tuple[int, int | None], float] = {}
        self._thread: threading.Thread | None = None

    def serve(self, item: Item, qty: int) -> dict[int, int] | None:
        """Units for a checkout of `qty` from what is held of item's sale (stock row ->
        units), or None when less than `qty` is held."""
        with self._lock:
            held = self._held.get(_key(item))
            if held is None or sum(held.units.values()) < qty:
                return None
            if time.monotonic() > held.taken_at + self.most:
                return None  # due back (its process was stopped a while, say): not served
            plan: dict[int, int] = {}
            for index in sorted(held.units, key=held.units.__getitem__, reverse=True):
                units = min(held.units[index], qty - sum(plan.values()))
                if units:
                    plan[index] = units
                    held.units[index] -= units
            held.used_at = time.monotonic()
            return plan

    def take(self, item: Item, takes: list[Take], more: int) -> list[dict[int, int] | None | Claim]:
        """A batch's `takes`, and `more` units of item's sale to hold, in one script call,
        which registers this process as their holder before it takes them (and renews the
        lease): held units are always under a registration Redis has, even when Redis lost its
        keys since the last take (and reconnected without an error). Units held from an
        earlier generation of the counters are dropped: the counters set since count them.
        Returns the takes' results. Redis errors propagate, and drop what is held."""
        key = _key(item)
        registration = Registration(
            keys.holders(item), keys.generation(item), self.token, self.lease_ms, KEEP_MS
        )
        ahead = Take(keys.turn(item), keys.stripe_counters(item), more, holder=registration)
        with self._refill:
            now = time.monotonic()
            with self._lock:
                new = key not in self._held
                if new:
                    self._held[key] = _Held(item, {}, taken_at=now, used_at=now)
                self._start()
            try:
                *taken, extra = counter().take_spread_many([*takes, ahead])
                assert registration.seen is not None
                with self._lock:
                    self._keep(key, extra if isinstance(extra, dict) else {}, registration.seen)
            except REDIS_DOWN_ERRORS:
                self._forget(key)
                raise
            finally:
                with self._lock:
                    # The thread giving back sleeps until the earliest due: woken only when a
                    # holding is new or due at once, not on each refill.
                    held = self._held.get(key)
                    if new or (held is not None and held.short):
                        self._due.notify()
        return taken

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._give_back_when_due, name="lua-units-ahead", daemon=True
            )
            self._thread.start()

    def units_to_take(self, item: Item, units: int, checkouts: int) -> int:
        """How many units to take ahead of item's sale, beside the `units` of a batch of
        `checkouts`: none for a batch of fewer than `least_batch`, nor for SHORT_SECONDS after
        a take ahead found its counters short."""
        if checkouts < self.least_batch or self._short.get(_key(item), 0.0) > time.monotonic():
            return 0
        return min(BATCHES_AHEAD * units, int(item.stock * MOST_SHARE))

    def _keep(self, key: tuple[int, int | None], units: dict[int, int], generation: str) -> None:
        """Hold `units` (stock row -> units) taken ahead in `generation`; none: the counters
        were short. Called with the lock held."""
        now = time.monotonic()
        held = self._held[key]
        if self._registered.get(key, generation) != generation:
            held.units.clear()  # counted by the counters set since
        self._registered[key] = generation
        for index, added in units.items():
            held.units[index] = held.units.get(index, 0) + added
        held.used_at = now
        held.short = not units
        if held.short:
            self._short[key] = now + SHORT_SECONDS

    def held(self, item: Item) -> int:
        """Units held of item's sale."""
        with self._lock:
            held = self._held.get(_key(item))
            return sum(held.units.values()) if held else 0

    def give_back(self, item: Item | None = None) -> int:
        """Give back what is held of item's sale (of every sale: None) and end the
        registrations. Returns the units that went back to the counters."""
        with self._refill:
            with self._lock:
                chosen = [_key(item)] if item is not None else list(self._held)
                taken = [(key, self._held.pop(key, None)) for key in chosen]
            return sum(self._give_back(key, held) for key, held in taken)

    def _give_back(self, key: tuple[int, int | None], held: _Held | None) -> int:
        registered = self._registered.pop(key, None)
        if held is None or registered is None:
            return 0
        item = held.item
        units = {index: left for index, left in held.units.items() if left}
        try:
            added = holder_registry().give_back(
                keys.holders(item),
                keys.generation(item),
                self.token,
                registered,
                {keys.stripe_counter(item, index): left for index, left in units.items()},
            )
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            logger.warning(
                "could not give %s units of %s back: Redis is down", sum(units.values()), item.sku
            )
            return 0
        return sum(units.values()) if added else 0

    def drop(self, item: Item) -> None:
        """Forget what is held of item's sale once its counters were set from the database,
        which counts it. The set ended the registration."""
        with self._refill:
            self._forget(_key(item))

    def _forget(self, key: tuple[int, int | None]) -> None:
        with self._lock:
            self._held.pop(key, None)
            self._registered.pop(key, None)

    def _give_back_when_due(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                due = [
                    key for key, held in self._held.items() if held.due(self.idle, self.most) <= now
                ]
                if not due:
                    wake = min(
                        (held.due(self.idle, self.most) for held in self._held.values()),
                        default=None,
                    )
                    self._due.wait(None if wake is None else wake - now)
                    continue
            with self._refill:
                with self._lock:
                    now = time.monotonic()
                    taken = [
                        (key, self._held.pop(key))
                        for key in due
                        if key in self._held and self._held[key].due(self.idle, self.most) <= now
                    ]
                for key, held in taken:
                    self._give_back(key, held)


def held_elsewhere(item: Item, holder: Holding) -> bool:
    """Whether a holder other than `holder` (another process) has a lease on item's sale."""
    live, _ = holder_registry().count(keys.holders(item), besides=holder.token)
    return live > 0


def holders(item: Item, *, remove_ended: bool = False) -> tuple[int, int]:
    """The holders of item's sale whose lease runs, and those whose lease ran out: processes
    that died (or stopped) holding units they never gave back (removed with `remove_ended`)."""
    return holder_registry().count(keys.holders(item), remove_ended=remove_ended)


#: This process's units held ahead (`inventory.strategies.lua`).
holding = Holding()


@atexit.register
def _give_back_at_exit() -> None:
    try:
        holding.give_back()
    except Exception:  # noqa: BLE001 - the process is going: what it held is rebuilt later
        logger.exception("could not give the units held ahead back at exit")
