"""The per-step dispatch of tokens to clients: the outbox each request's events wait in, and the inter-token
latency histogram that takes a whole step's equal gaps in one observation."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from lockstep.coordinator import service
from lockstep.coordinator.config import CoordinatorConfig
from lockstep.coordinator.events import Event, EventKind
from lockstep.coordinator.generation import GenerateSpec, TokenEvent
from lockstep.coordinator.metrics import LATENCY_BUCKETS, Metrics, forget_group_series
from lockstep.coordinator.outbox import Outbox
from lockstep.coordinator.request import FinishReason
from lockstep.coordinator.request_events import RequestEvents
from lockstep.coordinator.service import Coordinator
from lockstep.steps import SamplingParams

ITL = "lockstep_inter_token_latency_seconds"


class Group:
    """The group interface the coordinator uses, recording what it is asked to abort."""

    name, serving, up, draining, down_reason, load, capacity_tokens = "g0", True, True, False, "", 0, 0

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def counts(self) -> tuple[int, int]:
        return 0, 0

    def cannot_hold(self, request) -> str:
        return ""

    def submit(self, request) -> None:
        pass

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def adopt(self, requests) -> None:
        self.adopted = [r.request_id for r in requests]


def _coordinator() -> tuple[Coordinator, Group]:
    coord = Coordinator(CoordinatorConfig(), tokenizer=None, model_name="m", max_model_len=64)
    group = coord.groups["g0"] = Group()
    coord.metrics.init_group("g0", 1)
    return coord, group


def _generate(coord: Coordinator, rid: str) -> RequestEvents:
    return coord.generate(rid, GenerateSpec([1, 2, 3], SamplingParams(), 8))


def _token(rid: str, token: int) -> Event:
    return Event(rid, EventKind.TOKEN, token_id=token)


def _itl_lines(text: str, group: str) -> dict[str, float]:
    """The group's ITL samples but `_created`, keyed by series name and `le`."""
    out = {}
    for m in re.finditer(rf'^{ITL}_(bucket|count|sum)\{{group="{group}"(?:,le="([^"]+)")?\}} (\S+)$', text, re.M):
        out[m[1] + (f"@{m[2]}" if m[2] else "")] = float(m[3])
    return out


# ----- the outbox


def test_the_outbox_hands_out_events_in_order_whether_put_before_or_while_the_consumer_waits():
    async def main() -> None:
        box: Outbox[int] = Outbox()
        assert box.empty()
        box.put(1)
        box.put(2)
        assert await box.get() == 1 and await box.get() == 2 and box.empty()  # no wait while events are there
        waiting = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing there: it waits
        box.put(3)
        box.put(4)
        assert await asyncio.wait_for(waiting, 1) == 3 and await box.get() == 4

    asyncio.run(main())


def test_a_consumer_cancelled_while_waiting_leaves_the_outbox_working():
    async def main() -> None:
        box: Outbox[int] = Outbox()
        waiting = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        box.put(5)  # no wakeup of the cancelled waiter, no error
        assert await box.get() == 5
        again = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        box.put(6)
        assert await asyncio.wait_for(again, 1) == 6

    asyncio.run(main())


# ----- a request's events, through a real coordinator


def test_a_client_reads_the_tokens_of_every_step_in_order_and_stops_after_the_finish():
    async def main() -> None:
        coord, group = _coordinator()
        events = _generate(coord, "r1")
        coord._dispatch("g0", [_token("r1", 10)])
        coord._dispatch("g0", [_token("r1", 11)])
        got = [(await events.__anext__()).token_id, (await events.__anext__()).token_id]
        reading = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0)
        assert not reading.done()  # the outbox is empty: the client waits for the next step
        coord._dispatch("g0", [_token("r1", 12), Event("r1", EventKind.FINISHED, finish_reason=FinishReason.LENGTH)])
        got.append((await asyncio.wait_for(reading, 1)).token_id)
        rest = [ev async for ev in events]
        assert got == [10, 11, 12] and [ev.finish_reason for ev in rest] == [FinishReason.LENGTH]
        assert "r1" not in coord.live and group.aborted == []  # it finished: forgotten, not aborted

    asyncio.run(main())


def test_a_client_that_leaves_early_or_is_cancelled_while_waiting_aborts_its_request():
    async def main() -> None:
        coord, group = _coordinator()
        first, second = _generate(coord, "r1"), _generate(coord, "r2")
        coord._dispatch("g0", [_token("r1", 10)])
        assert (await first.__anext__()).token_id == 10
        await first.aclose()
        waiting = asyncio.ensure_future(second.__anext__())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert group.aborted == ["r1", "r2"] and not coord.live
        coord._dispatch("g0", [_token("r1", 11), _token("r2", 11)])  # a step already under way: dropped
        with pytest.raises(StopAsyncIteration):
            await first.__anext__()

    asyncio.run(main())


def test_a_failed_request_ends_its_stream_with_the_error():
    async def main() -> None:
        coord, group = _coordinator()
        events = _generate(coord, "r1")
        reading = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0)
        coord._fail(coord.live["r1"].request, "group g0 is down")
        ev: TokenEvent = await asyncio.wait_for(reading, 1)
        assert ev.error == "group g0 is down" and ev.token_id is None
        with pytest.raises(StopAsyncIteration):
            await events.__anext__()
        assert "r1" not in coord.live and group.aborted == []

    asyncio.run(main())


# ----- the inter-token latency histogram


def test_ending_the_streams_at_shutdown_ends_every_open_one_with_the_error_and_aborts_its_request():
    """Past the shutdown grace the coordinator ends the streams itself instead of waiting for aiohttp to cancel
    their handlers: a waiting client and one with tokens unread both read on to the error, then stop."""
    async def main() -> None:
        coord, group = _coordinator()
        waiting, behind = _generate(coord, "r1"), _generate(coord, "r2")
        reading = asyncio.ensure_future(waiting.__anext__())
        await asyncio.sleep(0)
        coord._dispatch("g0", [_token("r2", 7)])
        coord.end_streams("the server is shutting down")
        assert (await asyncio.wait_for(reading, 1)).error == "the server is shutting down"
        assert (await behind.__anext__()).token_id == 7 and (await behind.__anext__()).error
        for events in (waiting, behind):
            with pytest.raises(StopAsyncIteration):
                await events.__anext__()
        assert sorted(group.aborted) == ["r1", "r2"] and not coord.live

    asyncio.run(main())


def test_dispatch_observes_each_tokens_gap_once_and_the_first_token_none(monkeypatch):
    async def main() -> None:
        coord, _ = _coordinator()
        clock = SimpleNamespace(now=100.0)
        monkeypatch.setattr(service, "time", SimpleNamespace(monotonic=lambda: clock.now))
        for rid in ("a", "b", "c"):
            _generate(coord, rid)
        coord._dispatch("g0", [_token("a", 1), _token("b", 1)])  # first tokens: time to first token only
        clock.now = 100.3
        coord._dispatch("g0", [_token("a", 2), _token("b", 2), _token("c", 1)])  # two gaps of 0.3 s
        clock.now = 103.3
        coord._dispatch("g0", [_token("a", 3), _token("c", 2)])  # two gaps of 3 s
        lines = _itl_lines(coord.metrics_text().decode(), "g0")
        assert lines["count"] == 4 and lines["sum"] == pytest.approx(2 * 0.3 + 2 * 3.0)
        assert (lines["bucket@0.25"], lines["bucket@0.5"], lines["bucket@2.5"], lines["bucket@5.0"]) == (0, 2, 2, 4)
        assert lines["bucket@+Inf"] == 4

    asyncio.run(main())


def test_the_itl_histogram_counts_cumulative_buckets_sum_and_count_as_prometheus_clients_own():
    metrics = Metrics()
    metrics.init_group("g0", 1)
    registry = CollectorRegistry()
    reference = Histogram(ITL, "Time between two tokens of a request", ["group"], buckets=LATENCY_BUCKETS,
                          registry=registry)
    for value, count in ((0.0005, 3), (0.001, 2), (0.25, 4), (1.5, 1), (200.0, 2)):  # 0.001, 0.25: on a bound
        metrics.itl.observe("g0", value, count)
        for _ in range(count):
            reference.labels("g0").observe(value)
    ours, theirs = _itl_lines(metrics.render().decode(), "g0"), _itl_lines(generate_latest(registry).decode(), "g0")
    assert ours.pop("sum") == pytest.approx(theirs.pop("sum"), rel=1e-12)  # v * n, not n additions of v
    assert ours == theirs
    assert (ours["bucket@0.001"], ours["bucket@0.25"], ours["bucket@1.0"], ours["bucket@120.0"]) == (5, 9, 9, 10)
    assert ours["bucket@+Inf"] == ours["count"] == 12


def test_a_groups_itl_series_exist_at_zero_from_init_group_and_leave_with_the_group():
    metrics = Metrics()
    for g in ("g0", "g1"):
        metrics.init_group(g, 1)
    text = metrics.render().decode()
    zero = _itl_lines(text, "g1")
    assert len(zero) == len(LATENCY_BUCKETS) + 3 and set(zero.values()) == {0.0}
    assert f'{ITL}_created{{group="g1"}}' in text  # as every other histogram of the group
    metrics.itl.observe("g1", 0.02, 5)
    forget_group_series(metrics, "g1")
    text = metrics.render().decode()
    assert 'group="g1"' not in text and _itl_lines(text, "g0")["count"] == 0
    metrics.init_group("g1", 1)  # a group added back at the same name starts from zero
    assert _itl_lines(metrics.render().decode(), "g1")["count"] == 0


def test_a_second_metric_of_the_itl_name_is_refused():
    metrics = Metrics()
    with pytest.raises(ValueError):
        Histogram(ITL, "again", ["group"], registry=metrics.registry)


def _counted(coord: Coordinator) -> tuple[float, float]:
    """(requests in lockstep_request_duration_seconds, lockstep_prompt_tokens_total) of g0."""
    text = coord.metrics_text().decode()
    duration = re.search(r'^lockstep_request_duration_seconds_count\{group="g0"\} (\S+)$', text, re.M)
    prompt = re.search(r'^lockstep_prompt_tokens_total\{group="g0"\} (\S+)$', text, re.M)
    return float(duration[1]) if duration else 0.0, float(prompt[1]) if prompt else 0.0


def test_a_request_ended_at_a_stop_string_counts_as_finished_and_one_whose_client_left_does_not():
    """A stop string is found by the request's reader, which then closes its events: the request is aborted (its
    group would generate on) but it finished, so its duration and prompt tokens are counted as for an end the
    group saw (about a tenth of the requests of a mixed workload were missing). A client gone is not counted."""
    from lockstep.coordinator.generation import collect, text_stream
    from test_generation import TOK, tid

    async def main() -> None:
        coord, group = _coordinator()
        spec = GenerateSpec([1, 2, 3], SamplingParams(), 8, stop=["ld sto"])
        pieces = text_stream(TOK, spec, coord.generate("r1", spec))
        coord._dispatch("g0", [_token("r1", tid(p)) for p in ("Hello", " wor", "ld", " sto", "p!")])
        done = await collect(pieces)
        assert done.text == "Hello wor" and done.finish_reason == FinishReason.STOP
        assert group.aborted == ["r1"] and "r1" not in coord.live
        assert _counted(coord) == (1.0, 3.0)

        gone = coord.generate("r2", GenerateSpec([1, 2, 3, 4], SamplingParams(), 8))
        coord._dispatch("g0", [_token("r2", tid("Hello"))])
        await gone.__anext__()
        await gone.aclose()  # the client went away
        assert group.aborted == ["r1", "r2"] and _counted(coord) == (1.0, 3.0)

        whole = _generate(coord, "r3")  # ended by its group: counted once, as before
        coord._dispatch("g0", [_token("r3", 7), Event("r3", EventKind.FINISHED, finish_reason=FinishReason.LENGTH)])
        assert [e.finish_reason async for e in whole] == [None, FinishReason.LENGTH]
        assert _counted(coord) == (2.0, 6.0) and group.aborted == ["r1", "r2"]

    asyncio.run(main())


def test_a_request_a_group_takes_up_again_after_it_came_back_did_not_move():
    """A group down, then up again, takes its own held requests back (the only group): a replay, but no request
    moved to another group, so lockstep_requests_migrated_total ("moved from this group to another") stays 0."""
    async def main() -> None:
        coord, group = _coordinator()
        _generate(coord, "r1")
        coord._place([coord.live["r1"].request], "group g0 is down")
        assert group.adopted == ["r1"] and coord.live["r1"].group == "g0"
        text = coord.metrics_text().decode()
        assert 'lockstep_requests_migrated_total{group="g0"} 0.0' in text
        assert 'lockstep_routing_decisions_total{group="g0",reason="replay"} 1.0' in text

    asyncio.run(main())


def test_with_one_group_no_prompt_is_hashed_for_routing_and_with_two_the_map_learns():
    """With one group there is nothing to choose: the routing map stays empty (no hashing, none of its memory per
    prompt); once a second group is there, prompts are recorded again."""
    async def main() -> None:
        coord, _ = _coordinator()
        coord.generate("r1", GenerateSpec(list(range(1, 40)), SamplingParams(), 8))
        assert len(coord.router) == 0
        other = Group()
        other.name = "g1"
        coord.groups["g1"] = other
        coord.metrics.init_group("g1", 1)
        coord.generate("r2", GenerateSpec(list(range(1, 40)), SamplingParams(), 8))
        assert len(coord.router) == 39 // coord.config.page_size

    asyncio.run(main())


def test_a_request_held_from_a_removed_group_moves_without_bringing_its_series_back():
    """Found by a fault-finding helper: requests held after their group was removed from the groups file were
    counted as migrated on the removed group when another group took them, which brought its series back to
    /metrics for good (a removed group leaves every series)."""
    async def main() -> None:
        coord, group = _coordinator()
        other = Group()
        other.name = "g1"
        coord.groups["g1"] = other
        coord.metrics.init_group("g1", 1)
        _generate(coord, "r1")
        coord.live["r1"].group = "g1"
        del coord.groups["g1"]
        forget_group_series(coord.metrics, "g1")
        assert 'group="g1"' not in coord.metrics_text().decode()
        coord._place([coord.live["r1"].request], "group g1 was removed")
        assert group.adopted == ["r1"] and coord.live["r1"].group == "g0"
        assert 'group="g1"' not in coord.metrics_text().decode()

    asyncio.run(main())
