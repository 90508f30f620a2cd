"""GroupRunner's own bookkeeping, without ranks: flushes, /health's reason, and what it can hold."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from lockstep.coordinator.events import Event, EventKind
from lockstep.coordinator.group import GroupRunner
from lockstep.coordinator.metrics import Metrics
from lockstep.coordinator.request import Request
from lockstep.coordinator.scheduler import SchedulerStats
from lockstep.steps import Plan, RankInfo, Report


class PlanOnly:
    """A scheduler that plans empty steps: enough for the runner's own bookkeeping."""

    def plan(self, step: int, reports: list[Report], flush: bool = False, now: float = 0.0) -> Plan:
        return Plan(step=step)

    def cannot_hold(self, request: Request) -> str:
        return ""

    def requeue_all(self) -> list:
        return []

    requests: dict = {}


def _runner() -> GroupRunner:
    runner = GroupRunner("g0", ["127.0.0.1:1", "127.0.0.1:2"], Metrics(), print, print, print)
    runner.scheduler = PlanOnly()
    return runner


def _reports(plan: Plan) -> list[Report]:
    return [Report(plan.step, r) for r in range(2)]


def test_a_flush_asked_while_another_is_in_flight_waits_for_its_own_step():
    """Bug fix: a second caller shared the first flush's future and was told "done" when the plan already in
    flight finished, before any plan carried its own flush."""

    async def main() -> None:
        runner = _runner()
        first = asyncio.ensure_future(runner.flush(0))
        await asyncio.sleep(0)
        plan = runner._next_plan()
        assert set(runner.flush_sent) == {0}
        second = asyncio.ensure_future(runner.flush(0))
        await asyncio.sleep(0)
        runner._observe(plan, _reports(plan), 0.0)
        await asyncio.sleep(0.01)
        assert first.done() and not second.done()
        runner.step += 1
        plan = runner._next_plan()
        assert set(runner.flush_sent) == {0}
        runner._observe(plan, _reports(plan), 0.0)
        await asyncio.sleep(0.01)
        assert second.done()
        await runner.close()

    asyncio.run(main())


def test_health_says_what_took_the_group_down_and_what_it_waits_for_now():
    """Bug fix: /health kept the first reason for ever while the coordinator waited for a new group."""

    async def main() -> None:
        runner = _runner()
        runner._go_down("rank(s) [1] of group g0 silent for 30 s at step 9", [1])
        runner._waiting("rank 1 at 127.0.0.1:2 does not answer (UNAVAILABLE)")
        runner._waiting("the ranks stopped at different steps [9, 10] (a broken group, to be recreated)")
        assert runner.down_reason == ("rank(s) [1] of group g0 silent for 30 s at step 9; now: the ranks stopped "
                                      "at different steps [9, 10] (a broken group, to be recreated)")
        await runner.close()

    asyncio.run(main())


def test_a_request_larger_than_the_smallest_pool_is_named_before_it_is_queued():
    async def main() -> None:
        runner = _runner()
        infos = [RankInfo(r, 2, "m", 16, (("full", pages),), 512, 100) for r, pages in enumerate((64, 10))]
        runner._come_up(infos)
        assert runner.cannot_hold(Request("ok", list(range(30)), max_tokens=130)) == ""
        assert runner.cannot_hold(Request("big", list(range(30)), max_tokens=200)) == (
            "request big needs up to 15 KV pages but the smallest rank pool holds 10")
        await runner.close()

    asyncio.run(main())


class OneGroup:
    """The group interface the coordinator uses, recording what it is asked."""

    name = "g0"
    serving = True
    load = 0
    capacity_tokens = 0

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    def counts(self) -> tuple[int, int]:
        return 0, len(self.submitted)

    def cannot_hold(self, request: Request) -> str:
        return ""

    def submit(self, request: Request) -> None:
        self.submitted.append(request.request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_client_gone_before_its_first_event_aborts_its_request():
    """Bug fix: generate() returned an async generator, whose cleanup does not run when it is closed before
    it started, so a client that dropped before its first event left its request running to the end."""
    from lockstep.coordinator.config import CoordinatorConfig
    from lockstep.coordinator.generation import GenerateSpec
    from lockstep.coordinator.service import Coordinator
    from lockstep.steps import SamplingParams

    async def main() -> None:
        coord = Coordinator(CoordinatorConfig(), tokenizer=None, model_name="m", max_model_len=64)
        group = coord.groups["g0"] = OneGroup()
        events = coord.generate("r1", GenerateSpec([1, 2, 3], SamplingParams(), 4))
        assert group.submitted == ["r1"] and "r1" in coord.live
        await events.aclose()
        assert group.aborted == ["r1"] and "r1" not in coord.live

    asyncio.run(main())


def test_a_replayed_request_goes_only_to_a_group_that_can_hold_it_and_waits_otherwise():
    """Bug fix: a group's requests were re-admitted on a group whose smallest pool was too small for them,
    and then failed with a non-retriable 400 after they had streamed tokens. Now they go where they fit,
    oldest first, or wait for such a group (then a retriable 503 past --replay-timeout)."""
    from lockstep.coordinator.config import CoordinatorConfig
    from lockstep.coordinator.generation import GenerateSpec
    from lockstep.coordinator.service import Coordinator
    from lockstep.steps import SamplingParams

    class Small(OneGroup):
        name = "small"

        def cannot_hold(self, request: Request) -> str:
            return "too small" if request.max_tokens > 8 else ""

        def adopt(self, requests: list[Request]) -> None:
            self.adopted = [r.request_id for r in requests]

    async def main() -> None:
        coord = Coordinator(CoordinatorConfig(replay_timeout=60), tokenizer=None, model_name="m", max_model_len=64)
        coord.groups["g0"] = OneGroup()
        small = coord.groups["small"] = Small()
        small.serving = False  # routing sends everything to g0 first
        for i, n in enumerate((4, 20, 6)):
            coord.generate(f"r{i}", GenerateSpec([1, 2, 3], SamplingParams(), n))
        small.serving = True
        reqs = [coord.live[f"r{i}"].request for i in range(3)]
        coord._replay("g0", reqs, "rank 1 of group g0 is down")
        assert small.adopted == ["r0", "r2"]  # oldest first, only what fits
        assert list(coord._parked) == ["r1"] and coord.live["r1"].queue.empty()  # waits, not failed
        assert coord.live["r0"].group == "small" and coord.live["r1"].group == "g0"
        # a held request is waiting, on the group it left (found by fault injection: the gauge showed none while
        # every request of a group that went down was held, so the queue alerts saw an empty server)
        assert 'lockstep_requests{group="g0",state="waiting"} 1.0' in coord.metrics_text().decode()

    asyncio.run(main())


def test_a_request_held_twice_for_a_group_waits_its_full_replay_timeout_the_second_time():
    """Bug fix (found by fault injection): the first hold's timer was never cancelled when a group took the request
    up again, so a second hold ended at the first hold's deadline, long before its own replay timeout."""
    from lockstep.coordinator.config import CoordinatorConfig
    from lockstep.coordinator.generation import GenerateSpec
    from lockstep.coordinator.service import Coordinator
    from lockstep.steps import SamplingParams

    class Adopting(OneGroup):
        def adopt(self, requests: list[Request]) -> None:
            self.adopted = [r.request_id for r in requests]

    async def main() -> None:
        coord = Coordinator(CoordinatorConfig(replay_timeout=0.4), tokenizer=None, model_name="m", max_model_len=64)
        g0 = coord.groups["g0"] = Adopting()
        coord.generate("r1", GenerateSpec([1, 2, 3], SamplingParams(), 4))
        req = coord.live["r1"].request
        g0.serving = False
        coord._replay("g0", [req], "rank 1 of group g0 is down")  # held: its timer runs out at 0.4 s
        await asyncio.sleep(0.25)
        g0.serving = True
        coord._group_up("g0")  # the group is back and takes it up
        assert g0.adopted == ["r1"] and not coord._parked
        g0.serving = False
        coord._replay("g0", [req], "rank 1 of group g0 is down again")  # held again, at 0.25 s: until 0.65 s
        await asyncio.sleep(0.3)  # past the first hold's deadline
        assert list(coord._parked) == ["r1"] and coord.live["r1"].queue.empty()
        await asyncio.sleep(0.3)  # past its own
        assert not coord._parked
        ev = coord.live["r1"].queue._items[0]
        assert "down again" in ev.error and "no group came back" in ev.error
        coord._end("r1", finished=True)

    asyncio.run(main())


def test_a_report_of_the_plan_sent_ahead_that_comes_during_the_wait_is_kept_for_the_next_wait():
    """With overlap a fast rank answers plan k + 1 before a slow one answers plan k: the early report is kept for
    the next agreement wait (dropped, that wait would stall until the dead-rank timeout took the group down)."""

    async def main() -> None:
        runner = _runner()
        inbox = runner.ranks.inbox
        for item in (Report(4, 0), Report(5, 0), Report(4, 1), Report(5, 1)):
            inbox.put_nowait((item.rank, item))
        first = await asyncio.wait_for(runner.ranks.gather(4), 2)
        assert [(r.step, r.rank) for r in first] == [(4, 0), (4, 1)]
        second = await asyncio.wait_for(runner.ranks.gather(5), 2)
        assert [(r.step, r.rank) for r in second] == [(5, 0), (5, 1)]
        await runner.close()

    asyncio.run(main())


class _Link:
    """A rank link that only answers health checks (a stopped process does not; one blocked in a collective does)."""

    def __init__(self, rank: int, alive: bool) -> None:
        self.rank, self.alive, self.streaming = rank, alive, True

    async def responsive(self, timeout: float = 1.0) -> bool:
        return self.alive


def test_a_wait_that_times_out_blames_the_ranks_that_do_not_answer_at_all(caplog):
    """Bug fix (found by fault injection, SIGSTOP of rank 1 mid-step): its peers, blocked in the step's collective
    waiting for it, had not answered either, so the group went down blaming every rank: lockstep_rank_up fell to 0
    on all of them and the log said "every rank answered" as the wait ended with no answer. Now the ranks that do
    not answer a health check are the ones blamed; the wait is logged as the failure it is and still observed."""
    from lockstep.coordinator.group_ranks import GroupDown, GroupRanks

    async def main() -> None:
        metrics = Metrics()
        ranks = GroupRanks("g0", ["a:1", "a:2", "a:3"], metrics, stall_threshold=0.05, dead_rank_timeout=0.3)
        ranks.links = [_Link(0, True), _Link(1, False), _Link(2, True)]
        try:
            await asyncio.wait_for(ranks.gather(7), 5)
        except GroupDown as exc:
            return exc
        raise AssertionError("the wait did not end the group")

    with caplog.at_level("WARNING", logger="lockstep.group"):
        down = asyncio.run(main())
    assert down.ranks == [1] and "rank(s) [1] of group g0" in str(down)
    assert "every rank answered" not in caplog.text and "step 7: the wait ended with the group down" in caplog.text


def test_a_wait_whose_ranks_all_answer_health_checks_blames_every_silent_one():
    """No process to single out (each answers its health check, none its step): all of the silent ones are named."""
    from lockstep.coordinator.group_ranks import GroupDown, GroupRanks

    async def main() -> list[int] | None:
        metrics = Metrics()
        ranks = GroupRanks("g0", ["a:1", "a:2"], metrics, stall_threshold=0.05, dead_rank_timeout=0.3)
        ranks.links = [_Link(0, True), _Link(1, True)]
        try:
            await ranks.gather(3)
        except GroupDown as exc:
            count = metrics.agreement_wait.labels("g0", "step")._sum.get()
            assert count >= 0.3  # the failed wait is observed too: the longest waits are these
            return exc.ranks
        return None

    assert asyncio.run(main()) == [0, 1]


def test_a_wait_that_stalls_and_dies_in_one_check_leaves_the_stalled_gauge_at_zero():
    """Found by a helper at TP 3 with --dead-rank-timeout 5 (the stall threshold's 5 s): the check that counted
    the wait as stalled also took the group down, and the gauge it raised was never lowered:
    lockstep_agreements_stalled stayed 1 after the group recovered, and its alert fired for ever."""
    from lockstep.coordinator.group_ranks import GroupDown, GroupRanks

    async def main() -> Metrics:
        metrics = Metrics()
        ranks = GroupRanks("g0", ["a:1", "a:2"], metrics, stall_threshold=0.3, dead_rank_timeout=0.3)
        ranks.links = [_Link(0, True), _Link(1, False)]
        try:
            await asyncio.wait_for(ranks.gather(5), 5)
        except GroupDown:
            return metrics
        raise AssertionError("the wait did not end the group")

    metrics = asyncio.run(main())
    assert metrics.agreement_stalls.labels("g0")._value.get() == 1  # it was counted as a stall
    assert metrics.agreements_stalled.labels("g0")._value.get() == 0  # and is no longer one


class _SlowLink(_Link):
    async def responsive(self, timeout: float = 1.0) -> bool:
        await asyncio.sleep(timeout)
        return self.alive


def test_an_idle_group_whose_rank_answers_no_health_check_goes_down_blaming_that_rank(monkeypatch):
    """Bug fix (found by fault injection): a rank stopped while its group was idle went unnoticed (/health 200,
    lockstep_rank_up 1) until a request found it silent and waited out the stall and dead-rank timeouts."""
    from lockstep.coordinator import group_ranks
    from lockstep.coordinator.group_ranks import GroupDown, GroupRanks

    monkeypatch.setattr(group_ranks, "IDLE_CHECK_S", 0.05)

    async def main() -> GroupDown:
        ranks = GroupRanks("g0", ["a:1", "a:2"], Metrics(), stall_threshold=0.05, dead_rank_timeout=0.3)
        ranks.links = [_Link(0, True), _Link(1, False)]
        try:
            await asyncio.wait_for(ranks.idle(asyncio.Event()), 5)
        except GroupDown as exc:
            return exc
        raise AssertionError("idle returned")

    down = asyncio.run(main())
    assert down.ranks == [1] and "while the group was idle" in str(down)


class _FreezingLink(_Link):
    """Answers health checks until `frozen_at`, then lets each one time out after `check_s` (a stopped process)."""

    def __init__(self, rank: int, frozen_at: float, check_s: float) -> None:
        super().__init__(rank, True)
        self.frozen_at, self.check_s = frozen_at, check_s

    async def responsive(self, timeout: float = 1.0) -> bool:
        if time.monotonic() < self.frozen_at:
            return True
        await asyncio.sleep(self.check_s)
        return False


def test_an_idle_group_whose_rank_freezes_goes_down_a_check_period_past_the_dead_rank_timeout_at_most(monkeypatch):
    """Bug fix: the silence was counted from the end of the first check the rank failed, and the checks went on
    every period, so a rank frozen while its group idled took it down up to two periods and two check timeouts past
    the dead-rank timeout (30 s: 36 s after the freeze; 20 s: 30 s, half as long again). Now it counts from that
    check's start and the rank is checked again as its timeout ends: down within the timeout, one period and one
    check's time of the freeze, and never before the timeout."""
    from lockstep.coordinator import group_ranks
    from lockstep.coordinator.group_ranks import GroupDown, GroupRanks

    period, timeout, check_s = 1.0, 2.5, 0.1
    monkeypatch.setattr(group_ranks, "IDLE_CHECK_S", period)

    async def main() -> float:
        ranks = GroupRanks("g0", ["a:1", "a:2"], Metrics(), stall_threshold=5, dead_rank_timeout=timeout)
        frozen_at = time.monotonic() + period + 0.05  # just after a check it answered: the longest way to its end
        ranks.links = [_Link(0, True), _FreezingLink(1, frozen_at, check_s)]
        try:
            await asyncio.wait_for(ranks.idle(asyncio.Event()), 20)
        except GroupDown as exc:
            assert exc.ranks == [1]
            return time.monotonic() - frozen_at
        raise AssertionError("idle returned")

    took = asyncio.run(main())
    assert timeout <= took <= timeout + period + check_s + 0.3, f"down {took:.2f} s after the freeze"


def test_an_idle_group_wakes_at_once_with_a_health_check_in_flight_and_stays_up_while_ranks_answer(monkeypatch):
    from lockstep.coordinator import group_ranks
    from lockstep.coordinator.group_ranks import GroupRanks

    monkeypatch.setattr(group_ranks, "IDLE_CHECK_S", 0.01)

    async def main() -> float:
        ranks = GroupRanks("g0", ["a:1", "a:2"], Metrics(), stall_threshold=0.05, dead_rank_timeout=0.1)
        ranks.links = [_SlowLink(0, True), _Link(1, True)]
        wakeup = asyncio.Event()
        idle = asyncio.ensure_future(ranks.idle(wakeup))
        await asyncio.sleep(0.5)  # many checks, each answered (the slow one in 1 s): never down
        assert not idle.done()
        wakeup.set()
        t0 = time.monotonic()
        await asyncio.wait_for(idle, 5)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 0.2  # not held by the check in flight


def test_a_request_of_n_choices_is_counted_against_max_waiting_requests_once_as_it_arrives():
    """Bug fix (found by fuzzing the API): each choice was checked against --max-waiting-requests with its siblings
    already queued, so n above the cap got 503 "retry later" on an idle server, forever. A request is now counted
    as it arrives (its first choice); a later one finds them all waiting."""
    from lockstep.coordinator.choices import choice_ids, choice_specs
    from lockstep.coordinator.config import CoordinatorConfig
    from lockstep.coordinator.generation import ApiError, GenerateSpec
    from lockstep.coordinator.service import Coordinator
    from lockstep.steps import SamplingParams

    class Queueing(OneGroup):
        def counts(self) -> tuple[int, int]:
            return len(self.submitted), 0  # everything waits

    async def main() -> None:
        coord = Coordinator(CoordinatorConfig(max_waiting_requests=3), tokenizer=None, model_name="m",
                            max_model_len=64)
        group = coord.groups["g0"] = Queueing()
        spec = GenerateSpec([1, 2, 3], SamplingParams(temperature=1.0, seed=5), 4, n=6)
        for rid, one in zip(choice_ids("r", 6), choice_specs(spec), strict=True):
            coord.generate(rid, one)
        assert len(group.submitted) == 6
        try:
            coord.generate("late", GenerateSpec([1, 2, 3], SamplingParams(), 4))
            raise AssertionError("an overloaded coordinator took the request")
        except ApiError as exc:
            assert exc.status == 503 and "6 requests are waiting" in exc.message
        rejected = coord.metrics.requests_rejected
        assert rejected.labels("server_overloaded")._value.get() == 1  # an operator sees the refusals
        assert rejected.labels("request_too_large")._value.get() == 0  # every reason's series is there from start

    asyncio.run(main())


def test_a_migrating_drain_then_resume_leaves_no_migration_behind_for_the_next_request():
    """Bug fix (found by fuzzing the API): drain?migrate=true of an idle group returned at once with its migration
    still asked; resume cleared only `draining`, so the next step handed the next request over (to no other group:
    it waited out --replay-timeout, 300 s, then got 503)."""

    class Idle(PlanOnly):
        def has_work(self) -> bool:
            return False

    async def main() -> None:
        runner = _runner()
        runner.scheduler = Idle()
        await asyncio.wait_for(runner.drain(migrate=True), 2)  # holds nothing: returns at once
        runner.resume()
        assert not runner.draining and not runner.migrate_asked
        runner.migrate_asked = True  # a migration asked while requests were held is dropped by resume too
        runner.resume()
        assert not runner.migrate_asked
        await runner.close()

    asyncio.run(main())


def test_a_flush_of_a_rank_the_group_lacks_names_it_cut_short():
    """Found by fuzzing the API: /admin/reset_prefix_cache with rank 1e300 answered with all 300 digits."""

    async def main() -> str:
        runner = _runner()
        try:
            await runner.flush(10**300)
        except ValueError as exc:
            return str(exc)
        finally:
            await runner.close()
        raise AssertionError("a flush of rank 10**300 was taken")

    message = asyncio.run(main())
    assert message.startswith("group g0 has ranks 0..1, not 1000000") and len(message) < 100, message


def test_a_request_too_large_for_the_pool_names_the_prompt_when_the_prompt_alone_is_too_large():
    """Found by fuzzing the API: a prompt longer than the KV pool, sent with no max_tokens, was a 400 naming
    max_tokens, which the client never sent."""
    from lockstep.coordinator.config import CoordinatorConfig
    from lockstep.coordinator.generation import ApiError, GenerateSpec
    from lockstep.coordinator.service import Coordinator
    from lockstep.steps import SamplingParams

    class Small(OneGroup):
        capacity_tokens = 64

        def cannot_hold(self, request: Request) -> str:
            return "too large" if request.max_positions > self.capacity_tokens else ""

    async def main() -> list[str | None]:
        coord = Coordinator(CoordinatorConfig(), tokenizer=None, model_name="m", max_model_len=512)
        coord.groups["g0"] = Small()
        params = []
        for i, (prompt, max_tokens, given) in enumerate(((70, 400, False), (70, 4, True), (30, 100, True))):
            try:
                coord.generate(f"r{i}", GenerateSpec(list(range(1, prompt + 1)), SamplingParams(), max_tokens,
                                                     max_tokens_given=given))
            except ApiError as exc:
                assert exc.status == 400 and exc.code == "request_too_large"
                params.append(exc.param)
        return params

    assert asyncio.run(main()) == ["prompt", "prompt", "max_tokens"]


@pytest.mark.parametrize(("change", "words"), [
    ({"page_size": 32}, "rank 1 uses page size 32, the coordinator 16"),
    ({"model_id": "other"}, "rank 1 serves other, rank 0 m"),
    ({"sliding_window": 512}, "rank 1 has pools"),
    ({"pools": (("full", 64),)}, "rank 1 has pools"),
    ({"page_bytes": (("full", 4096), ("sliding", 8192))}, "rank 1 prices a page at"),
])
def test_ranks_that_cannot_be_one_group_are_refused_before_it_forms(change, words):
    """Every check on the ranks' Info before a group forms; seed 001's decision from one rank's view: the
    rebalance trades pages at rank 0's page bytes, so a rank that prices them otherwise (another dtype or KV
    layout) would carry out a split of another size in bytes than the one decided."""
    from dataclasses import replace

    from lockstep.coordinator.config import CoordinatorConfig
    from lockstep.coordinator.service import Coordinator
    from lockstep.steps import RankInfo

    coord = Coordinator(CoordinatorConfig(), tokenizer=None, model_name="m", max_model_len=64)
    one = RankInfo(0, 2, "m", 16, (("full", 64), ("sliding", 32)), 64, 100, sliding_window=256,
                   page_bytes=(("full", 2048), ("sliding", 2048)))
    assert coord._make_scheduler([one, replace(one, rank=1)]) is not None
    with pytest.raises(ValueError, match=re.escape(words)):
        coord._make_scheduler([one, replace(one, rank=1, **change)])


class _StepsOnly:
    """A scheduler that plans `steps` decode steps (each one ahead where the runner asks) and makes one token
    event per step: what the step loop's ordering needs, with no requests behind it."""

    def __init__(self, steps: int) -> None:
        self.steps, self.applied = steps, 0
        self.stats = SchedulerStats(prefix_offered_pages=[0, 0])
        self.requests: dict = {}

    def plan(self, step: int, reports: list[Report], flush: bool = False, now: float = 0.0) -> Plan:
        return Plan(step=step)

    def plan_ahead(self, step: int) -> Plan | None:
        return Plan(step=step) if step <= self.steps else None

    def apply(self, reports: list[Report]) -> list[Event]:
        self.applied += 1
        return [Event(f"step-{reports[0].step}", EventKind.TOKEN, token_id=reports[0].step)]

    def has_work(self) -> bool:
        return self.applied < self.steps

    def requeue_all(self) -> None:
        pass


class _Ranks:
    """Every rank answers each plan at once; what the runner queues, what a writer task puts on the wire (as
    `RankLink`'s does, when the loop lets it run) and what the runner hands on are written into `log`."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.sent, self.outbox = log, set(), asyncio.Queue()
        self.writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        while True:
            self.log.append(f"write {await self.outbox.get()}")

    def __len__(self) -> int:
        return 2

    def send(self, plan: Plan, flushed: set[int]) -> None:
        self.outbox.put_nowait(plan.step)
        self.sent.add(plan.step)

    async def gather(self, step: int) -> list[Report]:
        assert step in self.sent
        self.log.append(f"gather {step}")
        return _reports(Plan(step=step))

    async def idle(self, wakeup: asyncio.Event) -> None:
        self.log.append("idle")
        await wakeup.wait()

    def poke_survivors(self, dead: list[int], step: int) -> None:
        pass

    async def close(self) -> None:
        self.writer.cancel()


def _logging_runner(steps: int) -> tuple[GroupRunner, list[str]]:
    log: list[str] = []
    runner = GroupRunner("g0", ["127.0.0.1:1", "127.0.0.1:2"], Metrics(),
                         lambda group, events: log.extend(f"events {e.token_id}" for e in events),
                         lambda group, requests, reason: log.append("down"), print)
    runner.scheduler, runner.ranks, runner.step, runner.last_reports = _StepsOnly(steps), _Ranks(log), 1, []
    return runner, log


def test_a_steps_tokens_reach_their_clients_only_once_the_plan_after_next_is_sent():
    """Bug fix (issue 11, the control plane's critical path): the tokens of report k went to their clients'
    queues (a wake-up per streaming client: about 0.5 ms at batch 256) before plan k + 2 was built, and the
    links' writers put it on the wire only at the loop's next await, after both: measured from the coordinator's
    send to the rank's reader, 0.98 ms at batch 256 before, 0.26 ms after. Clients run only at that await too,
    so they get their tokens no later."""

    async def main() -> None:
        runner, log = _logging_runner(4)
        for _ in range(3):
            await runner._run_step()
        assert log == ["gather 1", "write 1", "write 2",
                       "write 3", "events 1", "gather 2",
                       "write 4", "events 2", "gather 3"]
        assert len(runner.step_timings) == 3
        await runner.close()

    asyncio.run(main())


def test_the_last_steps_tokens_reach_their_clients_before_the_group_waits_idle_or_goes_down():
    """With nothing left to plan, the last report's tokens are handed on before the loop waits for work (held
    back, they would wait for the next request); and a group that goes down hands on what its ranks made before
    its requests move to another group (which goes on from those tokens)."""

    async def main() -> None:
        runner, log = _logging_runner(2)
        loop = asyncio.ensure_future(runner._loop())
        for _ in range(100):
            await asyncio.sleep(0.01)
            if "idle" in log:
                break
        assert log[-3:] == ["gather 2", "events 2", "idle"]
        loop.cancel()
        runner.undelivered = [Event("late", EventKind.TOKEN, token_id=9)]
        runner._go_down("rank 1 died")
        assert log[-2:] == ["events 9", "down"]
        await runner.close()

    asyncio.run(main())


class _LastFinishes(_StepsOnly):
    """Step 1 finishes the group's last request; the plan after it only releases its pages, so from then on the
    group holds nothing (`holds_nothing`) while step 1's finish may still wait to be handed on."""

    def __init__(self) -> None:
        super().__init__(1)
        self.releases = False

    def plan(self, step: int, reports: list[Report], flush: bool = False, now: float = 0.0) -> Plan:
        self.releases = False
        return Plan(step=step)

    def plan_ahead(self, step: int) -> Plan | None:
        return None

    def apply(self, reports: list[Report]) -> list[Event]:
        self.applied += 1
        self.releases = self.applied == 1
        return [Event("last", EventKind.FINISHED)] if self.applied == 1 else []

    def has_work(self) -> bool:
        return self.applied < 1 or self.releases


def test_a_group_removed_while_its_last_plan_is_written_still_hands_on_its_last_events():
    """Bug fix: a step's events wait for the loop turn after the next plan is sent, and a group closed in that
    turn (`Coordinator._remove_group`: its drain returns at once, since the release plan left the group holding
    nothing, and `close` cancels the loop at its `sleep(0)`) dropped them: the request's client never heard of
    its end, its stream hung and its record stayed (requests_in_flight)."""

    async def main() -> None:
        runner, log = _logging_runner(1)
        runner.scheduler = _LastFinishes()
        runner.task = asyncio.ensure_future(runner._loop())
        send = runner.ranks.send

        async def remove() -> None:  # what Coordinator._remove_group does
            await runner.drain(migrate=True)
            await runner.close()

        def send_then_remove(plan: Plan, flushed: set[int]) -> None:
            send(plan, flushed)
            if plan.step == 2:  # the group list changes in the loop turn that writes the release plan
                asyncio.ensure_future(remove())

        runner.ranks.send = send_then_remove
        for _ in range(100):
            await asyncio.sleep(0.01)
            if runner.task.done():
                break
        assert runner.task.cancelled()
        assert "events None" in log  # the finish reached its client (the fake's on_events logs its token_id)

    asyncio.run(main())


def test_deliver_s_is_the_hand_over_of_the_tokens_not_the_loop_turn_before_it():
    """Bug fix: deliver_s (/admin/steps, the bench's deliver column, `part="hidden"`) timed the loop turn given to
    the links' writers too: their writes of the plans, and whatever else ran in that turn (another group's step,
    HTTP handlers), none of it the handing of tokens to clients. That turn is spent waiting for the ranks, as
    before the turn was added: it counts in wait_s."""

    async def main() -> None:
        runner, log = _logging_runner(4)

        async def slow_write() -> None:  # a write that takes 30 ms of the loop (a big plan, a busy loop)
            while True:
                log.append(f"write {await runner.ranks.outbox.get()}")
                time.sleep(0.03)

        runner.ranks.writer.cancel()
        runner.ranks.writer = asyncio.ensure_future(slow_write())
        for _ in range(3):
            await runner._run_step()
        delivered = runner.step_timings[-1]
        assert delivered.deliver_s < 0.01 and delivered.wait_s >= 0.03
        await runner.close()

    asyncio.run(main())
