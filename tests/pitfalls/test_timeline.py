"""A run's timeline as the lab page draws it: a lane per client, a hold from each acquisition to
what ended it, and the stretches where two or more clients held the lock at once, exactly."""

from __future__ import annotations

import pytest

from pitfalls.timeline import MIN_TAIL_MS, build, draw


def _event(at: float, client: str, what: str, detail: str = "") -> dict:
    return {"at": at, "client": client, "what": what, "detail": detail}


def test_a_lane_per_client_in_order_of_appearance_and_the_overlap_of_their_holds():
    # Given A holding 0-300 while B takes the lock at 100 and holds it to 200, and C handed it
    # as A lets go at 300 (events out of order, as threads may record them)
    timeline = build(
        [
            _event(300, "C", "acquired"),
            _event(0, "A", "acquired"),
            _event(100, "B", "acquired"),
            _event(200, "B", "released"),
            _event(300, "A", "released"),
            _event(350, "C", "released"),
        ]
    )

    # Then each client has its lane and its hold, and only A and B overlap: a hand-over is none
    assert [lane.client for lane in timeline.lanes] == ["A", "B", "C"]
    assert [lane.holds for lane in timeline.lanes] == [[(0, 300)], [(100, 200)], [(300, 350)]]
    assert timeline.overlaps == [(100, 200)]
    # and the run ends a twentieth of its length after its last event
    assert timeline.end == pytest.approx(350 + 17.5)


def test_an_overlap_lasts_while_any_two_hold_and_separate_ones_stay_apart():
    # Given A 0-400, B 100-250, C 200-500 (two or more from 100 to 400), then D 600-700 and
    # E 650-800 (two from 650 to 700)
    timeline = build(
        [
            _event(0, "A", "acquired"),
            _event(100, "B", "acquired"),
            _event(200, "C", "acquired"),
            _event(250, "B", "released"),
            _event(400, "A", "released"),
            _event(500, "C", "released"),
            _event(600, "D", "acquired"),
            _event(650, "E", "acquired"),
            _event(700, "D", "released"),
            _event(800, "E", "released"),
        ]
    )

    assert timeline.overlaps == [(100, 400), (650, 700)]


def test_a_crash_or_a_lost_lock_ends_the_hold_and_is_marked():
    # Given A crashing while it holds the lock, and B taking the lock once its TTL ended, then
    # losing it (as setnx-expire-gap's fixed run records it)
    timeline = build(
        [
            _event(8.7, "A", "acquired", "SET NX PX"),
            _event(11.4, "A", "crashed", "SIGKILL"),
            _event(594.8, "B", "acquired", "after 0.58 s"),
            _event(600.0, "B", "lost", "its lock had expired"),
        ]
    )

    # Then the dead A holds nothing beside B: no overlap
    a, b = timeline.lanes
    assert a.holds == [(8.7, 11.4)] and b.holds == [(594.8, 600.0)]
    assert timeline.overlaps == []
    # and the crash and the loss are marks, beside the acquisitions
    assert a.marks == [(8.7, "acquired", "SET NX PX"), (11.4, "crashed", "SIGKILL")]
    assert (600.0, "lost", "its lock had expired") in b.marks


def test_holds_nothing_ended_last_to_the_end_of_the_run_and_overlap_there():
    # Given A granted the lock on the primary, the primary dead, and B granted it on the
    # promoted replica, neither releasing before the run ends (failover-loses-lock's naive run)
    timeline = build(
        [
            _event(120.6, "A", "acquired", "on the primary"),
            _event(121.8, "primary", "died", "SIGKILL"),
            _event(122.4, "B", "acquired", "on the promoted replica"),
        ]
    )

    # Then both hold to the run's end, and overlap from B's grant to it
    end = 122.4 * 1.05
    assert timeline.end == pytest.approx(end)
    lanes = {lane.client: lane for lane in timeline.lanes}
    assert lanes["A"].holds == [(120.6, pytest.approx(end))]
    assert lanes["B"].holds == [(122.4, pytest.approx(end))]
    assert lanes["primary"].holds == [] and lanes["primary"].marks == [(121.8, "died", "SIGKILL")]
    assert timeline.overlaps == [(122.4, pytest.approx(end))]


def test_a_second_acquisition_or_a_stray_release_is_only_a_mark():
    timeline = build(
        [
            _event(0, "A", "acquired"),
            _event(10, "A", "acquired", "again"),
            _event(20, "A", "released"),
            _event(30, "A", "released", "once more"),
        ]
    )

    (lane,) = timeline.lanes
    assert lane.holds == [(0, 20)]
    assert lane.marks == [
        (0, "acquired", ""),
        (10, "acquired", "again"),
        (30, "released", "once more"),
    ]


def test_no_events_draw_an_empty_run():
    timeline = build([])

    assert (timeline.lanes, timeline.overlaps, timeline.end) == ([], [], MIN_TAIL_MS)
    drawing = draw(timeline)
    assert drawing.lanes == [] and drawing.overlaps == [] and drawing.ticks[0][1] == "0 ms"


def test_the_drawing_places_holds_and_overlaps_on_the_same_scale_with_their_titles():
    timeline = build(
        [
            _event(0, "A", "acquired"),
            _event(100, "B", "acquired"),
            _event(150, "B", "deleted A's lock"),
            _event(200, "A", "released"),
            _event(200, "B", "released"),
        ]
    )

    drawing = draw(timeline, width=500)

    (_, a, a_holds, _), (_, b, b_holds, b_marks) = drawing.lanes
    (overlap,) = drawing.overlaps
    assert (a, b) == ("A", "B")
    # B's hold is the overlap: same x, same width; A's is twice as wide
    assert overlap[:2] == b_holds[0][:2]
    assert a_holds[0][0] < overlap[0]
    assert a_holds[0][1] == pytest.approx(2 * overlap[1], abs=0.1)
    assert a_holds[0][2] == "held the lock from 0 to 200 ms"
    assert overlap[2] == "more than one holder from 100 to 200 ms"
    # every event but a hold's release is a mark; the damage is drawn as such
    assert [(damage, title) for _, damage, title in b_marks] == [
        (False, "100 ms: acquired"),
        (True, "150 ms: deleted A's lock"),
    ]
    assert drawing.ticks[0][1] == "0 ms" and 4 <= len(drawing.ticks) <= 11
    assert all(90 <= x <= 500 for x, _ in drawing.ticks)


def test_a_hold_open_at_the_end_says_so():
    drawing = draw(build([_event(0, "A", "acquired"), _event(50, "B", "refused")]))

    ((_, _, [(_, _, title)], _), _) = drawing.lanes
    assert title == "held the lock from 0 ms to the end of the run"
