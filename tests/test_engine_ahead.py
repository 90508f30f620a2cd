"""A rank whose device runs ahead of its host (CUDA) prepares step k + 1 while step k's forward runs
(`Engine.stage`, called from the `ahead` hook): the same tokens, the same reports and the same pages as a rank
that prepares each step in its turn. Here on the CPU with `runs_ahead` forced on: the order of the host's work
is what changes, and it is what these tests hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpoints import random_prompt as prompt
from lockstep.engine import Engine
from lockstep.engine_config import EngineConfig
from lockstep.steps import PENDING_TOKEN, Admit, Chunk, GroupBroken, Plan, Report, SamplingParams

PS = 16
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def checkpoint(tiny_llama):
    torch.set_num_threads(2)
    return str(tiny_llama)


def _engine(checkpoint: str, ahead: bool, kv_pages: int = 64) -> Engine:
    engine = Engine.create(EngineConfig(checkpoint, page_size=PS, kv_pages=kv_pages))
    engine.runs_ahead = ahead
    return engine


def _plans() -> list[Plan]:
    """Overlap's plans: a's prefill, then decodes that name the token of the step before (pending), b admitted
    and prefilled beside them (a step that mixes a prompt chunk and pending tokens), a released early."""
    a, b = prompt(1, 21), prompt(2, 37)
    plans = [Plan(0, admits=(Admit("a"),), batch=(Chunk("a", tuple(a), 0, True, SEEDED, 0),))]
    for i in range(1, 7):
        batch = [Chunk("a", (PENDING_TOKEN,), len(a) + i - 1, True, SEEDED, i)] if i < 5 else []
        admits: tuple[Admit, ...] = ()
        if i == 2:
            admits, batch = (Admit("b"),), [Chunk("b", tuple(b), 0, True, GREEDY, 0), *batch]  # a's token after b's
        elif i > 2:
            batch.append(Chunk("b", (PENDING_TOKEN,), len(b) + i - 3, True, GREEDY, i - 2))
        plans.append(Plan(i, admits=admits, batch=tuple(batch), releases=("a",) if i == 6 else ()))
    plans.append(Plan(7, releases=("b",)))
    return plans


def _drive(engine: Engine, plans: list[Plan]) -> tuple[list[Report], list[int]]:
    """Every plan in order; each step's `ahead` stages the next plan, as the rank service does. Returns the
    reports (timings zeroed) and the steps staged."""
    staged: list[int] = []
    reports = []
    for k, plan in enumerate(plans):
        after = plans[k + 1] if k + 1 < len(plans) else None

        def ahead(busy: object, after: Plan | None = after) -> None:
            if after is not None:
                staged.append(after.step)
                engine.stage(after)

        report = engine.step(plan, ahead)
        assert not report.error, report.error
        reports.append(dataclasses.replace(report, timings=type(report.timings)()))
    engine.cache.check()
    return reports, staged


def test_preparing_ahead_changes_no_token_no_report_and_no_page(checkpoint):
    plans = _plans()
    in_turn, none = _drive(_engine(checkpoint, ahead=False), plans)
    ahead_engine = _engine(checkpoint, ahead=True)
    ahead, staged = _drive(ahead_engine, plans)
    assert none == [] and staged == [1, 2, 3, 4, 5, 6, 7]  # during every step with a forward (0 to 6)
    assert ahead == in_turn
    assert [len(r.sampled) for r in ahead[1:6]] == [1, 2, 2, 2, 1]
    assert ahead[-1].pools[0].used == 0 and ahead_engine.cache.pool.owners() == []


def test_a_step_prepared_ahead_that_this_rank_refuses_is_refused_in_its_turn(checkpoint):
    engine = _engine(checkpoint, ahead=True)
    p = tuple(prompt(3, 20))
    first = Plan(0, admits=(Admit("c"),), batch=(Chunk("c", p, 0, True, GREEDY, 0),))
    twice = Plan(1, admits=(Admit("c"),), batch=(Chunk("c", (PENDING_TOKEN,), len(p), True, GREEDY, 1),))
    assert not engine.step(first, lambda busy: engine.stage(twice)).error
    refused = engine.step(twice)
    assert "admitted twice" in refused.error or "already" in refused.error, refused.error
    assert refused.sampled == () and refused.pools[0].used == 2  # c keeps its pages; nothing of step 1 stays
    engine.cache.check()


def test_a_plan_other_than_the_one_prepared_ahead_breaks_the_rank(checkpoint):
    """Its prepare is done and cannot be taken back; carrying out another plan on top would leave pages no plan
    accounts for."""
    engine = _engine(checkpoint, ahead=True)
    p = tuple(prompt(4, 20))
    plans = [Plan(0, admits=(Admit("d"),), batch=(Chunk("d", p, 0, True, GREEDY, 0),)),
             Plan(1, batch=(Chunk("d", (PENDING_TOKEN,), len(p), True, GREEDY, 1),))]
    engine.step(plans[0], lambda busy: engine.stage(plans[1]))
    with pytest.raises(GroupBroken, match="step 1 was prepared ahead"):
        engine.step(dataclasses.replace(plans[1]))


def test_a_failure_taking_the_tokens_after_the_pages_moved_breaks_the_rank_even_alone(checkpoint, monkeypatch):
    """Before the pages are advanced a failed forward is a refused step (TP 1); after, the report could not say
    what the rank holds, so the rank goes (GroupBroken) instead of refusing a step it half carried out."""
    engine = _engine(checkpoint, ahead=True)

    def broken(*args: object) -> None:
        raise RuntimeError("the device reported a fault")

    monkeypatch.setattr(engine, "_collect", broken)
    with pytest.raises(GroupBroken, match="after its pages were advanced"):
        engine.step(Plan(0, admits=(Admit("e"),), batch=(Chunk("e", tuple(prompt(5, 20)), 0, True, GREEDY, 0),)))


def _every_kind_of_step(salt: bytes, ps: int) -> list[Plan]:
    """Penalized sampling, a prefix pinned off another request's committed pages, probes, a flush, a step this
    rank refuses (then explicit tokens, none drawn), a fence, release_all: each prepared ahead or in turn."""
    from lockstep.kv.page_keys import page_keys
    from lockstep.steps import Probe

    penal = SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.3, frequency_penalty=0.5,
                           presence_penalty=0.2, logit_bias=((7, 3.0),))
    a = prompt(6, 21)
    b = a[:2 * ps] + prompt(7, 9)
    keys = page_keys(a, ps, salt)
    pend = PENDING_TOKEN

    def dec(rid: str, at: int, i: int, token: int = pend, sp: SamplingParams = penal) -> Chunk:
        return Chunk(rid, (token,), at, True, sp, i)

    return [
        Plan(0, admits=(Admit("a"),), batch=(Chunk("a", tuple(a), 0, True, penal, 0),)),
        Plan(1, admits=(Admit("b", tuple(keys[:2])),), probes=(Probe("a", tuple(keys)),),
             batch=(dec("a", 21, 1), Chunk("b", tuple(b[2 * ps:]), 2 * ps, True, GREEDY, 0))),
        Plan(2, flush_prefix_cache=True, probes=(Probe("x", tuple(keys)),),
             batch=(dec("a", 22, 2), dec("b", len(b), 1, sp=GREEDY))),
        Plan(3, admits=(Admit("a"),), batch=(dec("a", 23, 3), dec("b", len(b) + 1, 2, sp=GREEDY))),
        Plan(4, batch=(dec("a", 23, 3, 5), dec("b", len(b) + 1, 2, 6, GREEDY))),
        Plan(5, batch=(dec("a", 24, 4), dec("b", len(b) + 2, 3, 9, GREEDY))),  # one pending among decodes
        Plan(6, pool_fence=(("full", 60),)),
        Plan(7, release_all=True, admits=(Admit("c"),), batch=(Chunk("c", tuple(a[:13]), 0, True, penal, 0),)),
        Plan(8, batch=(dec("c", 13, 1),)),
        Plan(9, releases=("c",)),
    ]


def _carry_out(engine: Engine, plans: list[Plan]) -> tuple[list[Report], list[int], dict]:
    """`_drive`, refused steps allowed; and which requests each pool holds pages for at the end."""
    reports, staged = [], []
    for k, plan in enumerate(plans):
        after = plans[k + 1] if k + 1 < len(plans) else None

        def hook(busy: object, after: Plan | None = after) -> None:
            if after is not None:
                staged.append(after.step)
                engine.stage(after)

        reports.append(dataclasses.replace(engine.step(plan, hook), timings=Report(0, 0).timings))
    engine.cache.check()
    return reports, staged, {n: p.owners() for n, p in engine.cache.pools.items()}


@pytest.mark.parametrize("kind", ["llama_gqa", "sliding"])
def test_every_kind_of_step_prepared_ahead_reports_and_holds_what_it_does_in_turn(checkpoint_dir, kind):
    outcomes = []
    for ahead in (False, True):
        engine = Engine.create(EngineConfig(str(checkpoint_dir(kind)), page_size=4, kv_pages=64))
        engine.runs_ahead = ahead
        outcomes.append(_carry_out(engine, _every_kind_of_step(engine.cache.salt, 4)))
    (in_turn, none, held), (ahead, staged, held_ahead) = outcomes
    assert none == [] and staged == [1, 2, 3, 5, 6, 8, 9]  # the steps after a forward; step 3 is refused
    assert [bool(r.error) for r in in_turn] == [False] * 3 + [True] + [False] * 6, [r.error for r in in_turn]
    assert ahead == in_turn and held_ahead == held


def test_a_step_after_one_that_broke_the_rank_takes_no_stale_pending_token(checkpoint, monkeypatch):
    """Step 1 breaks the rank after its pages moved (GroupBroken), with step 2 prepared ahead: step 2 still runs
    (it counts as started). Its pending token is step 1's, which was never drawn: it must be refused, not run
    on the token step 0 drew (the last the rank kept), which would report a token of a wrong context."""
    engine = _engine(checkpoint, ahead=True)
    p = tuple(prompt(8, 20))
    plans = [Plan(0, admits=(Admit("f"),), batch=(Chunk("f", p, 0, True, GREEDY, 0),)),
             Plan(1, batch=(Chunk("f", (PENDING_TOKEN,), len(p), True, GREEDY, 1),)),
             Plan(2, batch=(Chunk("f", (PENDING_TOKEN,), len(p) + 1, True, GREEDY, 2),))]
    assert not engine.step(plans[0]).error
    collect = engine._collect

    def broken(*args: object) -> None:
        raise RuntimeError("the device reported a fault")

    monkeypatch.setattr(engine, "_collect", broken)
    with pytest.raises(GroupBroken):
        engine.step(plans[1], lambda busy: engine.stage(plans[2]))
    monkeypatch.setattr(engine, "_collect", collect)
    after = engine.step(plans[2])
    assert after.sampled == () and "no token drawn" in after.error, after


def test_a_forward_probe_that_fails_after_the_pages_moved_breaks_the_rank_even_alone(checkpoint, monkeypatch):
    """`_busy` (a CUDA event recorded after the launch) meets a device fault there as readily as the sync in
    `_collect` does: the pages moved on already, so it is no refused step either."""
    engine = _engine(checkpoint, ahead=True)

    def faulted(launched: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine, "_busy", faulted)
    plan = Plan(0, admits=(Admit("g"),), batch=(Chunk("g", tuple(prompt(9, 20)), 0, True, GREEDY, 0),))
    with pytest.raises(GroupBroken, match="after its pages were advanced"):
        engine.step(plan, lambda busy: None)
