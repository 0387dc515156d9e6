"""Every scenario of the lab, by name, in the order the lab runs them."""

from __future__ import annotations

from .base import ARTICLES, VARIANTS, Event, Outcome, Scenario, Variant
from .contention import CoarseLock, PollingHerd
from .expiry import ExpiryMidWork, SetnxExpireGap
from .failover import FailoverLosesLock
from .ownership import ForeignRelease, GetDelRace, ReentrantDeadlock, SetTimeoutSucceeded
from .sales import LostUpdate, RedisDown, StallPastTtl, TrustTheLock

SCENARIOS: dict[str, Scenario] = {
    scenario.name: scenario
    for scenario in [
        SetnxExpireGap(),
        ExpiryMidWork(),
        ForeignRelease(),
        GetDelRace(),
        SetTimeoutSucceeded(),
        PollingHerd(),
        CoarseLock(),
        FailoverLosesLock(),
        ReentrantDeadlock(),
        TrustTheLock(),
        StallPastTtl(),
        LostUpdate(),
        RedisDown(),
    ]
}

__all__ = ["ARTICLES", "SCENARIOS", "VARIANTS", "Event", "Outcome", "Scenario", "Variant"]
