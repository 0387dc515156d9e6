"""A run's timeline as a picture: who held the lock when, one lane per client, and the stretches
where more than one client held it at once (the overlap that went wrong).

`build` reads the events a variant recorded (`Event.as_dict()`s, as `pitfall run --json` gives
them) into lanes and overlaps; `draw` lays them out for an SVG of a given width. Both are pure:
the page's template only places what `draw` computed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The event that starts a client's hold (`Recorder.acquired`), and those that end it: it released
#: the lock, learned it had lost it, or died holding it (a dead client holds nothing, whatever
#: its key in Redis still says).
ACQUIRED = "acquired"
HOLD_ENDS = frozenset({"released", "lost", "expired", "crashed", "died"})
#: The run goes on a little after its last event (the variant returns its outcome): a hold still
#: open then is drawn this share of the run's length past it, at least MIN_TAIL_MS.
TAIL_SHARE, MIN_TAIL_MS = 0.05, 1.0
#: A mark whose event names one of these is drawn as damage (red).
DAMAGE_WORDS = ("stale", "deleted", "lost", "crashed", "died", "failed")


@dataclass
class Lane:
    client: str
    #: [start, end] in ms from the run's start: when the client held (or believed it held) the
    #: lock. A hold that nothing ended lasts to the end of the run.
    holds: list[tuple[float, float]] = field(default_factory=list)
    #: Everything else the client did or saw, a hold's end other than its release included:
    #: (at, what, detail).
    marks: list[tuple[float, str, str]] = field(default_factory=list)


@dataclass
class Timeline:
    lanes: list[Lane]
    #: [start, end] stretches where two or more clients held the lock at once.
    overlaps: list[tuple[float, float]]
    #: The run's end, in ms: its last event, plus its tail.
    end: float


def build(events: Iterable[Mapping[str, Any]]) -> Timeline:
    """Lanes (in the order clients first appear), holds, marks and overlaps from `events`
    (in any order; events at the same moment keep theirs).

    A client's hold runs from its `acquired` to its next event of HOLD_ENDS; a second
    `acquired` while it holds is only a mark. Holds still open at the last event last to the
    end of the run: the last event plus TAIL_SHARE of it (at least MIN_TAIL_MS)."""
    ordered = sorted(events, key=lambda event: float(event["at"]))
    last = max((float(event["at"]) for event in ordered), default=0.0)
    end = last + max(last * TAIL_SHARE, MIN_TAIL_MS)
    lanes: dict[str, Lane] = {}
    open_since: dict[str, float] = {}
    for event in ordered:
        client, what, at = str(event["client"]), str(event["what"]), float(event["at"])
        detail = str(event.get("detail", ""))
        lane = lanes.setdefault(client, Lane(client))
        if what == ACQUIRED:
            open_since.setdefault(client, at)
            lane.marks.append((at, what, detail))
            continue
        if what in HOLD_ENDS and client in open_since:
            lane.holds.append((open_since.pop(client), at))
            if what == "released":
                continue  # the bar's end says it
        lane.marks.append((at, what, detail))
    for client, since in open_since.items():
        lanes[client].holds.append((since, end))
    return Timeline(list(lanes.values()), _overlaps(lanes.values()), end)


def _overlaps(lanes: Iterable[Lane]) -> list[tuple[float, float]]:
    # A sweep over every hold's start (+1) and end (-1); at equal times ends come first, so
    # that a hand-over (one ends as the next starts) is no overlap.
    edges = sorted(
        (edge for lane in lanes for start, end in lane.holds for edge in ((start, 1), (end, -1))),
        key=lambda edge: (edge[0], edge[1]),
    )
    overlaps: list[tuple[float, float]] = []
    holding, since = 0, 0.0
    for at, step in edges:
        before, holding = holding, holding + step
        if before < 2 <= holding:
            since = at
        elif before >= 2 > holding and at > since:
            overlaps.append((since, at))
    return overlaps


@dataclass(frozen=True)
class Drawing:
    """An SVG's geometry: every number is in the SVG's user units."""

    width: int
    height: int
    #: (y of the lane's middle, client, [(x, width, title) of each hold], [(x, damage, title) of
    #: each mark]).
    lanes: list[tuple[float, str, list[tuple[float, float, str]], list[tuple[float, bool, str]]]]
    #: (x, width, title) of each overlap, drawn across every lane.
    overlaps: list[tuple[float, float, str]]
    #: (x, label) of the time axis' ticks.
    ticks: list[tuple[float, str]]
    axis_y: float


#: Room on the left for the client's name, and the height of one lane.
LABEL_WIDTH, LANE_HEIGHT, AXIS_HEIGHT = 90, 34, 24


def draw(timeline: Timeline, *, width: int = 760) -> Drawing:
    """Where each lane, hold, mark, overlap and tick goes in an SVG `width` wide, with the
    text each one's <title> shows."""
    span = max(timeline.end, 1.0)
    plot = width - LABEL_WIDTH - 40  # room on the right for the last tick's label

    def x(at: float) -> float:
        return round(LABEL_WIDTH + plot * at / span, 1)

    def w(start: float, end: float) -> float:
        return max(round(plot * (end - start) / span, 1), 2.0)

    def during(start: float, end: float) -> str:
        if end >= timeline.end:
            return f"from {start:g} ms to the end of the run"
        return f"from {start:g} to {end:g} ms"

    lanes = []
    for index, lane in enumerate(timeline.lanes):
        middle = LANE_HEIGHT * index + LANE_HEIGHT / 2
        holds = [(x(start), w(start, end), f"held the lock {during(start, end)}")
                 for start, end in lane.holds]  # fmt: skip
        marks = [(x(at), any(word in what for word in DAMAGE_WORDS),
                  f"{at:g} ms: {what}{': ' + detail if detail else ''}")
                 for at, what, detail in lane.marks]  # fmt: skip
        lanes.append((middle, lane.client, holds, marks))
    overlaps = [(x(start), w(start, end), f"more than one holder {during(start, end)}")
                for start, end in timeline.overlaps]  # fmt: skip
    axis_y = LANE_HEIGHT * len(timeline.lanes) + 4
    ticks = [(x(at), f"{at:g} ms") for at in _range(0.0, span, _tick_step(span))]
    return Drawing(
        width=width,
        height=int(axis_y + AXIS_HEIGHT),
        lanes=lanes,
        overlaps=overlaps,
        ticks=ticks,
        axis_y=axis_y,
    )


def _tick_step(span: float) -> float:
    """A round step giving 4 to 10 ticks over `span`."""
    step = 1.0
    while span / step > 10:
        for factor in (2, 2.5, 2):
            step *= factor
            if span / step <= 10:
                break
    return step


def _range(start: float, stop: float, step: float) -> list[float]:
    count = int(stop // step) + 1
    return [start + step * n for n in range(count)]
