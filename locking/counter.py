"""Stock counters in Redis with an atomic check-and-decrement."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar

from .cluster import by_slot, is_cluster
from .scripts import counter as counter_scripts
from .scripts import script_for


def positive_qty(qty: int) -> int:
    """``qty``, checked to be a positive int."""
    # bool is an int subclass; True as a quantity is a bug, not "1".
    if isinstance(qty, bool) or not isinstance(qty, int) or qty <= 0:
        raise ValueError(f"qty must be a positive int, got {qty!r}")
    return qty


def _all_keys(counters: Sequence[Any]) -> bool:
    """Whether every counter named is a key (a str). A web process's batches name the same few
    tuples of its sales' counters, again and again: a tuple is checked once."""
    if type(counters) is tuple:
        try:
            return _all_keys_of(counters)
        except TypeError:  # something in it that cannot be hashed: not a key
            return False
    return all(isinstance(key, str) for key in counters)


@lru_cache(maxsize=1024)
def _all_keys_of(counters: tuple[Any, ...]) -> bool:
    return all(isinstance(key, str) for key in counters)


class KeyClaimed(Exception):
    """A twin checkout (same idempotency key) holds units taken under the key's claim: wait
    until the claim is gone, then take again (see :meth:`StockCounter.take_spread`)."""

    def __init__(self, claim: Claim) -> None:
        super().__init__(f"{claim.key} is held by a checkout in flight")
        self.claim = claim


@dataclass
class Claim:
    """A checkout's claim on its idempotency key: ``key`` names it, ``token`` is this taker's,
    ``ttl_ms`` how long it outlives a taker that never gives it up."""

    key: str
    ttl_ms: int
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: Whether a take of this taker's set it (only a take that got units does): there is
    #: nothing to give up, and no round trip to make, otherwise.
    held: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.ttl_ms, bool) or not isinstance(self.ttl_ms, int) or self.ttl_ms <= 0:
            raise ValueError(f"a claim needs a positive TTL in ms, got {self.ttl_ms!r}")

    def script_args(self) -> tuple[list[str], list[int | str]]:
        """The extra KEYS and ARGV of a take under this claim."""
        return [self.key], [self.ttl_ms, self.token]


@dataclass
class Registration:
    """A holder of the units a take gets, registered by the take itself (`Take.holder`), in
    its script: ``holder`` in the hash ``holders`` for ``lease_ms`` (the hash kept ``keep_ms``),
    as :meth:`locking.holders.Holders.register` does. ``generation`` is the key of the counters'
    generation; once the take ran, ``seen`` is the generation its units were taken in, which
    their give-back names (:meth:`locking.holders.Holders.give_back`)."""

    holders: str
    generation: str
    holder: str
    lease_ms: int
    keep_ms: int
    seen: str | None = field(default=None, compare=False)

    def script_args(self) -> tuple[list[str], list[int | str]]:
        """The extra KEYS and ARGV of a take under this registration."""
        return [self.holders, self.generation], [self.holder, self.lease_ms, self.keep_ms]


@dataclass(frozen=True)
class Take:
    """One take of :meth:`StockCounter.take_spread_many`: its arguments to ``take_spread``."""

    cursor: str
    counters: Sequence[str]
    qty: int
    claim: Claim | None = None
    #: Registers a holder of the units taken, in the same script (its keys in the take's slot).
    holder: Registration | None = None

    def __post_init__(self) -> None:
        positive_qty(self.qty)
        if not isinstance(self.cursor, str) or not isinstance(self.counters, (list, tuple)):
            raise ValueError("a take needs a cursor key and a list of counter keys")
        if not self.counters or not _all_keys(self.counters):
            raise ValueError("a take needs at least one counter, each a key")


@dataclass(frozen=True)
class LockFirst:
    """One call of :meth:`StockCounter.lock_first_holding_many`: its arguments to
    ``lock_first_holding``."""

    counters: Sequence[str]
    locks: Sequence[str]
    qty: int
    start: int
    token: str
    ttl_ms: int


def claim_args(claim: Claim | None) -> tuple[list[str], list[int | str]]:
    return ([], []) if claim is None else claim.script_args()


def registration_args(holder: Registration | None) -> tuple[list[str], list[int | str]]:
    return ([], []) if holder is None else holder.script_args()


class StockCounter:
    """Integer stock counters, one Redis string key each.

    ``take`` never lets a counter go below zero and never creates one: the check and
    the DECRBY run in one Lua script, so concurrent takers cannot oversell.
    Redis errors propagate unchanged.

    On a Redis Cluster, what one call must do atomically must share a slot (hash tags): one
    ``take_spread``'s cursor, counters and claim; one ``take_spread_many`` take's; a
    ``give_back_once``'s marker and counters; a counter and its version. Calls over many
    counters that need no atomicity between them (``set_many``, ``get_many``,
    ``give_back_many``, ``set_newer``, ``take_spread_many``'s takes, ``lock_first_holding``'s
    rows) go slot by slot there.
    """

    #: ``take``/``give_back`` result: the counter key does not exist.
    MISSING: ClassVar[int] = -2
    #: ``take`` result: the counter holds less than the requested quantity.
    INSUFFICIENT: ClassVar[int] = -1
    #: ``take_spread`` result: a twin checkout holds the idempotency claim.
    CLAIMED: ClassVar[int] = -3

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._take = script_for(redis, counter_scripts.STOCK_TAKE)
        self._take_spread = script_for(redis, counter_scripts.STOCK_TAKE_SPREAD)
        self._take_spread_many = script_for(redis, counter_scripts.STOCK_TAKE_SPREAD_MANY)
        self._lock_first = script_for(redis, counter_scripts.LOCK_FIRST_HOLDING)
        self._give_back = script_for(redis, counter_scripts.STOCK_GIVE_BACK)
        self._give_back_once = script_for(redis, counter_scripts.STOCK_GIVE_BACK_ONCE)
        self._delete_if_equal = script_for(redis, counter_scripts.DELETE_IF_EQUAL)
        self._set_newer = script_for(redis, counter_scripts.STOCK_SET_NEWER)

    def take(self, key: str, qty: int) -> int:
        """Decrement ``key`` by ``qty`` if it holds at least ``qty``.

        Returns the new value (>= 0), :attr:`MISSING` or :attr:`INSUFFICIENT` (then the
        counter is unchanged). Raises ValueError unless ``qty`` is a positive int.
        """
        return int(self._take(keys=[key], args=[positive_qty(qty)], client=self.redis))

    def take_spread(
        self,
        cursor: str,
        keys: Sequence[str],
        qty: int,
        *,
        claim: Claim | None = None,
    ) -> dict[int, int] | None:
        """Take ``qty`` units from the counters ``keys`` (one per stock row) in one script.

        Returns the units taken per position in ``keys``: from a single counter that holds
        them all when there is one (the counters are tried in turn, ``cursor`` keeping the
        turn), else from several, lowest position first; an empty dict when the counters hold
        fewer than ``qty`` together (nothing taken); None when a counter does not exist
        (nothing taken). Raises ValueError unless ``qty`` is a positive int.

        ``claim`` (naming the checkout's idempotency key) makes twins wait for each other:
        units taken set it for ``claim.ttl_ms``, and while it exists a take under the same
        key raises :class:`KeyClaimed` and takes nothing. Whoever set it gives it up once
        its checkout is over (:meth:`release_claim`).
        """
        if not keys:
            raise ValueError("take_spread needs at least one counter")
        claim_keys, claim_argv = claim_args(claim)
        reply = self._take_spread(
            keys=[cursor, *keys, *claim_keys],
            args=[positive_qty(qty), *claim_argv],
            client=self.redis,
        )
        if reply[0] == self.CLAIMED and claim is not None:
            raise KeyClaimed(claim)
        if reply[0] == self.MISSING:
            return None
        if reply[0] == self.INSUFFICIENT:
            return {}
        if claim is not None:
            claim.held = True
        return {int(reply[i]): int(reply[i + 1]) for i in range(0, len(reply), 2)}

    def take_spread_many(self, takes: Sequence[Take]) -> list[dict[int, int] | None | Claim]:
        """Many :meth:`take_spread` calls in one script, in order, each as if run alone.

        Returns one result per take: what ``take_spread`` returns, or the take's claim where
        ``take_spread`` would raise :class:`KeyClaimed` (nothing taken).
        """
        if is_cluster(self.redis):
            groups = by_slot(takes, lambda take: take.cursor)
            if len(groups) > 1:
                merged: list[dict[int, int] | None | Claim] = [None] * len(takes)
                for group in groups.values():
                    done = self.take_spread_many([take for _, take in group])
                    for (position, _), result in zip(group, done, strict=True):
                        merged[position] = result
                return merged
        if not takes:
            return []
        keys, args = take_spread_many_arguments(takes)
        reply = self._take_spread_many(keys=keys, args=args, client=self.redis)
        return take_spread_many_results(takes, reply)

    def lock_first_holding(
        self,
        counters: Sequence[str],
        locks: Sequence[str],
        qty: int,
        *,
        start: int,
        token: str,
        ttl_ms: int,
    ) -> tuple[int | None, list[int], int | None]:
        """Lock, in one script, the first row (from ``start``, in turn) whose counter holds
        ``qty`` and whose lock is free (``SET NX PX``, and the grant's fencing token: hold it
        with ``Lock.adopt(token, fence)``).

        Returns (that row's position, or -1 when every row holding qty is locked or none does;
        the counters' levels; the fence of the lock taken, None when none was), or
        (None, [], None) when a counter does not exist (nothing locked).
        """
        if len(counters) != len(locks) or not counters:
            raise ValueError("one lock per counter, and at least one of each")
        if is_cluster(self.redis) and len(counters) > 1:
            return self._lock_first_apart(counters, locks, positive_qty(qty), start, token, ttl_ms)
        reply = self._lock_first(
            keys=[*counters, *locks],
            args=[positive_qty(qty), start, token, ttl_ms],
            client=self.redis,
        )
        return self._first_holding(reply)

    def lock_first_holding_many(
        self, calls: Sequence[LockFirst]
    ) -> list[tuple[int | None, list[int], int | None]]:
        """Many :meth:`lock_first_holding` calls in one round trip, in order, each as if run
        alone (a later call finds the locks an earlier one took). Not on a Redis Cluster."""
        if is_cluster(self.redis):
            raise ValueError("lock_first_holding_many spans slots: not on a Redis Cluster")
        if not calls:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for call in calls:
            if len(call.counters) != len(call.locks) or not call.counters:
                raise ValueError("one lock per counter, and at least one of each")
            self._lock_first(
                keys=[*call.counters, *call.locks],
                args=[positive_qty(call.qty), call.start, call.token, call.ttl_ms],
                client=pipe,
            )
        return [self._first_holding(reply) for reply in pipe.execute()]

    def _first_holding(self, reply: list[Any]) -> tuple[int | None, list[int], int | None]:
        if reply[0] == self.MISSING:
            return None, [], None
        row = int(reply[0])
        return row, [int(level) for level in reply[2:]], int(reply[1]) if row >= 0 else None

    def _lock_first_apart(
        self,
        counters: Sequence[str],
        locks: Sequence[str],
        qty: int,
        start: int,
        token: str,
        ttl_ms: int,
    ) -> tuple[int | None, list[int], int | None]:
        """``lock_first_holding`` over rows each in a slot of its own: read every counter, then
        lock the first row in turn that holds qty, one row per script."""
        raw = self.get_many(counters)
        if any(level is None for level in raw):
            return None, [], None
        levels = [int(level or 0) for level in raw]
        n = len(counters)
        for step in range(n):
            index = (start + step) % n
            if levels[index] < qty:
                continue
            reply = self._lock_first(
                keys=[counters[index], locks[index]],
                args=[qty, 0, token, ttl_ms],
                client=self.redis,
            )
            if reply[0] == self.MISSING:
                return None, [], None
            levels[index] = int(reply[2])
            if int(reply[0]) == 0:
                return index, levels, int(reply[1])
        return -1, levels, None

    def release_claim(self, claim: Claim) -> None:
        """Give up ``claim`` if it is still this taker's (a twin may take again); nothing to
        do for a claim none of its takes set."""
        if claim.held:
            self._delete_if_equal(keys=[claim.key], args=[claim.token], client=self.redis)
            claim.held = False

    def claim_held(self, claim: Claim) -> bool:
        """Whether anyone (this taker or a twin) holds the claim's key."""
        return bool(self.redis.exists(claim.key))

    def give_back_many(self, amounts: Mapping[str, int]) -> None:
        """Increment each counter by its amount (one round trip); missing counters stay
        missing, as with :meth:`give_back`."""
        if is_cluster(self.redis):
            for key, qty in amounts.items():
                self._give_back(keys=[key], args=[positive_qty(qty)], client=self.redis)
            return
        pipe = self.redis.pipeline(transaction=False)
        for key, qty in amounts.items():
            self._give_back(keys=[key], args=[positive_qty(qty)], client=pipe)
        pipe.execute()

    def give_back(self, key: str, qty: int) -> int:
        """Increment ``key`` by ``qty``; returns the new value, or :attr:`MISSING`.

        A missing counter stays missing: stock is not resurrected for a product whose
        counter was removed. Raises ValueError unless ``qty`` is a positive int.
        """
        return int(self._give_back(keys=[key], args=[positive_qty(qty)], client=self.redis))

    def give_back_once(
        self, marker: str, amounts: Mapping[str, int], *, marker_ttl: int = 7 * 24 * 3600
    ) -> bool:
        """Increment each counter by its amount, unless ``marker`` says this was done already.

        Returns True when the units were given back by this call, False when an earlier call
        with the same marker did it. Missing counters stay missing. The marker expires after
        ``marker_ttl`` seconds.
        """
        keys = [marker, *amounts]
        args = [marker_ttl, *(positive_qty(qty) for qty in amounts.values())]
        return bool(self._give_back_once(keys=keys, args=args, client=self.redis))

    def set(self, key: str, value: int) -> None:
        """Set ``key`` to ``value`` (a non-negative int)."""
        self.redis.set(key, stock_value(value))

    def set_many(self, mapping: Mapping[str, int]) -> None:
        """Set several counters at once (one MSET); values are non-negative ints."""
        if mapping:
            values = {key: stock_value(value) for key, value in mapping.items()}
            if is_cluster(self.redis):
                self.redis.mset_nonatomic(values)
            else:
                self.redis.mset(values)

    def set_newer(
        self,
        levels: Mapping[str, tuple[int, int]],
        *,
        create: bool = True,
        force: bool = False,
    ) -> int:
        """Set each counter to its value unless it holds a value of a later version already
        (one script; each counter's version is kept in ``<key>:version``).

        ``levels`` maps a counter to (value, version): a non-negative value and the version
        of the record it was read from, which grows with every change of that record. Writers
        racing to copy the same records, each what it read, leave every counter at its
        latest. ``create=False`` leaves missing counters missing; ``force`` sets them whatever
        version they hold (a repair). Returns how many counters were set.
        """
        if not levels:
            return 0
        if is_cluster(self.redis):
            groups = by_slot(levels.items(), lambda pair: pair[0])
            if len(groups) > 1:
                return sum(
                    self.set_newer(dict(pair for _, pair in group), create=create, force=force)
                    for group in groups.values()
                )
        _, keys, args = self.set_newer_call(levels, create=create, force=force)
        return int(self._set_newer(keys=keys, args=args, client=self.redis))

    @staticmethod
    def set_newer_call(
        levels: Mapping[str, tuple[int, int]], *, create: bool = True, force: bool = False
    ) -> tuple[str, list[str], list[int]]:
        """:meth:`set_newer` as (its script's source, keys, arguments), for a caller that sends
        it with something else in one call (`Lock.release(after=...)`). On a cluster every
        counter must share the slot of whatever it goes with."""
        args: list[int] = [int(create), int(force)]
        for value, version in levels.values():
            if isinstance(version, bool) or not isinstance(version, int):
                raise ValueError(f"version must be an int, got {version!r}")
            args += [stock_value(value), version]
        names = list(levels)
        return (
            counter_scripts.STOCK_SET_NEWER,
            [*names, *(version_key(name) for name in names)],
            args,
        )

    def get(self, key: str) -> int | None:
        """Current value of ``key``, None if it does not exist."""
        raw = self.redis.get(key)
        return None if raw is None else int(raw)

    def get_many(self, keys: Iterable[str]) -> list[int | None]:
        """Current values of ``keys`` in order (one MGET), None for missing ones."""
        keys = list(keys)
        if not keys:
            return []
        fetch = self.redis.mget_nonatomic if is_cluster(self.redis) else self.redis.mget
        return [None if raw is None else int(raw) for raw in fetch(keys)]


def version_key(key: str) -> str:
    """Where :meth:`StockCounter.set_newer` keeps the version of ``key``'s value."""
    return f"{key}:version"


def stock_value(value: int) -> int:
    """``value``, checked to be a non-negative int (a counter's level)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"stock must be a non-negative int, got {value!r}")
    return value


def take_spread_many_arguments(takes: Sequence[Take]) -> tuple[list[str], list[int | str]]:
    """KEYS and ARGV of `STOCK_TAKE_SPREAD_MANY` for these takes (all in one slot)."""
    # Takes from the same counters send them once (a batch of one sale's checkouts).
    keys: list[str] = []
    sizes: list[int] = []
    group_of: dict[tuple[str, tuple[str, ...]], int] = {}
    extra_keys: list[str] = []
    per_take: list[int | str] = []
    for take in takes:
        counters = tuple(take.counters)
        number = group_of.get((take.cursor, counters))
        if number is None:
            number = group_of[take.cursor, counters] = len(sizes) + 1
            keys.append(take.cursor)
            keys += counters
            sizes.append(len(counters))
        claim_keys, claim_argv = claim_args(take.claim)
        holder_keys, holder_argv = registration_args(take.holder)
        extra_keys += claim_keys + holder_keys
        per_take += [number, take.qty, *(claim_argv or ("", "")), *(holder_argv or ("", "", ""))]
    keys += extra_keys
    return keys, [len(sizes), *sizes, *per_take]


def take_spread_many_results(
    takes: Sequence[Take], reply: Sequence[Any]
) -> list[dict[int, int] | None | Claim]:
    """`StockCounter.take_spread_many`'s results from the script's reply."""
    results: list[dict[int, int] | None | Claim] = []
    position = 0
    for take in takes:
        size = int(reply[position])
        one = reply[position + 1 : position + 1 + size]
        position += 1 + size
        if take.holder is not None:
            seen = reply[position]
            take.holder.seen = seen.decode() if isinstance(seen, bytes) else str(seen)
            position += 1
        if one[0] == StockCounter.CLAIMED and take.claim is not None:
            results.append(take.claim)
        elif one[0] == StockCounter.MISSING:
            results.append(None)
        elif one[0] == StockCounter.INSUFFICIENT:
            results.append({})
        else:
            if take.claim is not None:
                take.claim.held = True
            results.append({int(one[i]): int(one[i + 1]) for i in range(0, size, 2)})
    return results
