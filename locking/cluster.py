"""What :mod:`locking` needs to know about a Redis Cluster: whether a client is one, and which
keys share a slot (a script may only touch keys of one slot; the braces of a hash tag decide
it: ``{item:1}:a`` and ``{item:1}:b`` share one)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, TypeVar

from redis.crc import key_slot

T = TypeVar("T")


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a redis-py cluster client (RedisCluster or its pipeline)."""
    return hasattr(client, "nodes_manager")


def has_hash_tag(key: str | bytes) -> bool:
    """Whether ``key`` has a non-empty ``{...}``, which alone then picks its slot."""
    text = key.decode() if isinstance(key, bytes) else key
    opening = text.find("{")
    return opening >= 0 and text.find("}", opening + 1) > opening + 1


def slot(key: str | bytes) -> int:
    return key_slot(key.encode() if isinstance(key, str) else key)


def by_slot(items: Iterable[T], key_of: Any) -> dict[Hashable, list[tuple[int, T]]]:
    """``items`` grouped by the slot of ``key_of(item)``, each with its position, in order."""
    groups: dict[Hashable, list[tuple[int, T]]] = {}
    for position, item in enumerate(items):
        groups.setdefault(slot(key_of(item)), []).append((position, item))
    return groups
