"""Redis locks and atomic stock counters for the flash sale.

Depends on redis-py only (never on Django) so it can be reused on its own. The lock
exceptions are redis-py's own classes, so ``except redis.exceptions.LockError`` catches
errors from :class:`Lock` (and its variants, `ReentrantLock`, `ReplicatedLock`, `WakeHubLock`)
exactly as it does from :class:`redis.lock.Lock`.
"""

from redis.exceptions import LockError, LockNotOwnedError

from .core import LockCore
from .counter import Claim, KeyClaimed, StockCounter
from .handover import release_each_call
from .lock import Lock, ReentrantLock, ReplicatedLock, WakeHubLock
from .quorum import ProcessFences, QuorumLock

__all__ = [
    "Claim",
    "KeyClaimed",
    "Lock",
    "LockCore",
    "LockError",
    "LockNotOwnedError",
    "ProcessFences",
    "QuorumLock",
    "ReentrantLock",
    "ReplicatedLock",
    "StockCounter",
    "WakeHubLock",
    "release_each_call",
]
