"""The in-process engine API: plans in, reports out, at TP 1 in this process and TP 2 in two processes."""

from __future__ import annotations

import pytest
import torch

from checkpoints import random_prompt as prompt
from lockstep.engine import Engine
from lockstep.engine_config import EngineConfig
from lockstep.kv.page_keys import key_salt, page_keys
from lockstep.local_group import LocalGroup
from lockstep.steps import Admit, Chunk, Plan, Probe

PS = 16



class Driver:
    """A minimal plan writer for tests: admit, prefill in one chunk, greedy decode, release."""

    def __init__(self, step_fn, salt: bytes) -> None:
        self.step_fn = step_fn
        self.salt = salt
        self.step = 0

    def send(self, plan_kwargs: dict):
        reports = self.step_fn(Plan(step=self.step, **plan_kwargs))
        self.step += 1
        return reports if isinstance(reports, list) else [reports]

    def keys(self, tokens: list[int]) -> tuple[bytes, ...]:
        return tuple(page_keys(tokens, PS, self.salt))

    def probe(self, rid: str, tokens: list[int]):
        reports = self.send({"probes": (Probe(rid, self.keys(tokens)),)})
        return [r.probes[0] for r in reports]

    def generate(self, rid: str, tokens: list[int], n: int, cached_pages: int = 0) -> list[list[int]]:
        """Greedy-generate n tokens; returns the tokens of the sampling rank (rank 0), once per rank so callers
        can compare groups of any size: the other ranks sample nothing (they get the tokens in the next plan)."""
        start = cached_pages * PS
        admit = Admit(rid, self.keys(tokens)[:cached_pages])
        chunk = Chunk(rid, tuple(tokens[start:]), start, sample=True)
        reports = self.send({"admits": (admit,), "batch": (chunk,)})
        assert all(not r.error for r in reports), [r.error for r in reports]
        assert all(r.sampled == () for r in reports[1:]), "only the sampling rank samples"
        out = [reports[0].sampled[0].token_id]
        pos = len(tokens)
        for i in range(1, n):
            chunk = Chunk(rid, (out[-1],), pos, sample=True, sample_index=i)
            reports = self.send({"batch": (chunk,)})
            assert all(r.sampled == () for r in reports[1:])
            out.append(reports[0].sampled[0].token_id)
            pos += 1
        return [out] * len(reports)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    torch.set_num_threads(2)
    return Engine.create(EngineConfig(str(tiny_llama), page_size=PS, kv_pages=64))


def test_greedy_matches_transformers(engine, tiny_llama):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    d = Driver(engine.step, engine.cache.salt)
    p = prompt(1, 37)
    ours = d.generate("a", p, 12)[0]
    d.send({"releases": ("a",)})
    theirs = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
    assert ours == theirs
    stats = engine.cache.pool.stats()
    assert stats.used == 0 and stats.free + stats.evictable == stats.total


def test_cached_prefix_gives_same_tokens_and_skips_pages(engine, tiny_llama):
    d = Driver(engine.step, engine.cache.salt)
    first = prompt(2, 40)
    d.generate("warm", first, 2)
    d.send({"releases": ("warm",)})
    second = first[:32] + prompt(3, 9)
    (answer,) = d.probe("b", second)
    assert answer.matched_pages == 2 and answer.pinned_pages == 0
    cached = d.generate("b", second, 8, cached_pages=2)[0]
    d.send({"releases": ("b",)})
    cold = Engine.create(EngineConfig(str(tiny_llama), page_size=PS, kv_pages=64, prefix_caching=False))
    uncached = Driver(cold.step, cold.cache.salt).generate("b", second, 8)[0]
    assert cached == uncached


def test_pin_beyond_match_is_refused_and_engine_survives(engine):
    d = Driver(engine.step, engine.cache.salt)
    p = prompt(4, 33)
    d.generate("c", p, 1)
    d.send({"releases": ("c",)})
    (answer,) = d.probe("d", p)
    assert answer.matched_pages == 2
    before = engine.cache.pool.stats()
    keys = d.keys(p + prompt(5, 16))
    (report,) = d.send({"admits": (Admit("d", keys[:3]),), "batch": (Chunk("d", tuple(p[48:] or [1]), 48),)})
    assert "asked to pin 3 prefix pages but the index holds only the first 2" in report.error
    assert engine.cache.pool.stats().used == before.used == 0
    assert d.generate("d", p, 2, cached_pages=2)[0]
    d.send({"releases": ("d",)})


def test_admitting_a_request_this_rank_holds_is_refused_and_leaves_it_running(engine):
    """Bug fix: a refused step released every request its plan admitted, even one the rank already held
    (admitted twice), so the rank dropped a running request's pages; now only what the step pinned goes back."""
    d = Driver(engine.step, engine.cache.salt)
    p = prompt(12, 20)
    d.send({"admits": (Admit("n"),), "batch": (Chunk("n", tuple(p), 0),)})
    used = engine.cache.pool.stats().used
    (report,) = d.send({"admits": (Admit("n"),)})
    assert "request n is admitted twice" in report.error
    assert report.pools[0].used == used == 2
    (report,) = d.send({"batch": (Chunk("n", (5,), 20, sample=True),)})
    assert not report.error and len(report.sampled) == 1
    d.send({"releases": ("n",)})
    assert engine.cache.pool.stats().used == 0


def test_info_names_the_one_pool_full(engine):
    """Bug fix: the pool was named "default"; DESIGN.md names pools after the attention kind whose KV they
    hold, and a model with one kind has the one pool `full` (the `pool` label of lockstep_rank_pages)."""
    info = engine.info()
    assert info.pool_totals == {"full": 64} and info.page_size == PS and info.last_step == -1
    assert [p.pool for p in engine.step(Plan(step=0)).pools] == ["full"]


def test_tp2_refusal_on_one_rank_is_taken_by_the_group(tiny_llama):
    """Rank 1 has a smaller pool: a step it cannot take is refused by both ranks, and nothing hangs."""
    with LocalGroup(str(tiny_llama), 2, page_size=PS, kv_pages=[64, 3]) as group:
        salt = key_salt(group.infos[0].model_id, PS)
        d = Driver(group.step, salt)
        big = prompt(7, 70)
        reports = d.send({"admits": (Admit("f"),), "batch": (Chunk("f", tuple(big), 0, sample=True),)})
        assert reports[1].error and "rank 1" in reports[1].error
        assert reports[0].error
        assert [r.pools[0].used for r in reports] == [0, 0]
        small = prompt(8, 20)
        out = d.generate("g", small, 6)
        assert out[0] == out[1]
        d.send({"releases": ("g",)})


def test_tp2_flushed_rank_answers_its_own_match(tiny_llama):
    with LocalGroup(str(tiny_llama), 2, page_size=PS, kv_pages=64) as group:
        salt = key_salt(group.infos[0].model_id, PS)
        d = Driver(group.step, salt)
        p = prompt(9, 40)
        d.generate("h", p, 1)
        d.send({"releases": ("h",)})
        group.step([Plan(step=d.step), Plan(step=d.step, flush_prefix_cache=True)])
        d.step += 1
        answers = d.probe("i", p)
        assert [a.matched_pages for a in answers] == [2, 0]
        keys = d.keys(p)
        reports = d.send({"admits": (Admit("i", keys[:2]),), "batch": (Chunk("i", tuple(p[32:]), 32),)})
        assert all(r.error for r in reports)
        assert [r.pools[0].used for r in reports] == [0, 0]
        out = d.generate("i", p, 4)
        assert out[0] == out[1]
        d.send({"releases": ("i",)})


def test_tp2_unexpected_error_on_one_rank_still_reaches_the_agreement(tiny_llama):
    """A bug while preparing a step on one rank (here a request id that cannot be hashed) must not leave
    the other rank alone in the agreement collective: both refuse the step, and the group goes on. A plan
    delivered again is answered by LocalGroup's StepGate from the last reports, never run twice."""
    with LocalGroup(str(tiny_llama), 2, page_size=PS, kv_pages=64, timeout_s=60) as group:
        p = tuple(prompt(10, 20))
        good = Plan(step=0, admits=(Admit("j"),), batch=(Chunk("j", p, 0, sample=True),))
        bad = Plan(step=0, admits=(Admit(["j"]),), batch=(Chunk("j", p, 0, sample=True),))  # type: ignore[arg-type]
        reports = group.step([good, bad])
        assert "TypeError while preparing the step" in reports[1].error
        assert reports[0].error == "another rank of the group refused this step"
        assert [r.pools[0].used for r in reports] == [0, 0]
        plan = Plan(step=1, admits=(Admit("k"),), batch=(Chunk("k", p, 0, sample=True),))
        again = group.step(plan)
        assert not again[0].error and len(again[0].sampled) == 1 and again[1].sampled == ()
        # Delivered twice: answered from the last reports, never run again (no second pin, no collective).
        assert group.step(plan) == again and [r.pools[0].used for r in again] == [2, 2]
        assert "already carried out with a different plan" in group.step(Plan(step=1))[0].error
        done = group.step(Plan(step=2, releases=("k",)))
        assert [r.pools[0].used for r in done] == [0, 0]


def test_a_failed_forward_is_reported_with_the_pools_and_the_engine_goes_on(tiny_llama, monkeypatch):
    """At TP 1 a forward that raises (here: injected) is a refused step whose report still carries the
    page counts the coordinator plans from; the same chunk then runs when planned again."""
    eng = Engine.create(EngineConfig(str(tiny_llama), page_size=PS, kv_pages=16))
    p = tuple(prompt(11, 20))
    real = eng.model.forward
    monkeypatch.setattr(eng.model, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
    report = eng.step(Plan(step=0, admits=(Admit("m"),), batch=(Chunk("m", p, 0, sample=True),)))
    assert "RuntimeError in the forward: injected" in report.error and report.pools[0].total == 16
    monkeypatch.setattr(eng.model, "forward", real)
    again = eng.step(Plan(step=1, batch=(Chunk("m", p, 0, sample=True),)))
    assert not again.error and len(again.sampled) == 1


class _TwoRanks:
    """This rank's view of a group of two whose peer accepts every step: the agreement returns what it sent."""

    rank, world_size = 0, 2

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def test_a_forward_that_fails_in_a_group_breaks_the_group_instead_of_refusing_the_step(tiny_llama, monkeypatch):
    """Seed 000's hang: a rank that leaves the forward early while its peers wait in one of its collectives. In a
    group of several ranks a failed forward is fatal to the rank (GroupBroken: it exits, its group is made
    again), never a refused step that the peers, stuck in the forward, would not see."""
    from lockstep.steps import GroupBroken

    eng = Engine.create(EngineConfig(str(tiny_llama), page_size=PS, kv_pages=16))
    monkeypatch.setattr(eng, "comm", _TwoRanks())
    monkeypatch.setattr(eng.model, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(GroupBroken, match="step 0 failed inside the forward"):
        eng.step(Plan(step=0, admits=(Admit("m"),), batch=(Chunk("m", tuple(prompt(11, 20)), 0, sample=True),)))


@pytest.mark.parametrize("ranks", [1, 2])
def test_an_agreed_split_that_this_rank_cannot_carry_out_breaks_the_group(tiny_llama, monkeypatch, ranks):
    """Found by a review against seed 001: every rank agreed to a rebalance and had moved its page bookkeeping to
    the new split; then one rank's tensors could not be resized (out of memory: a layer's new tensor is made
    while the old one lives). That rank reported an ordinary error and stayed up, with its bookkeeping at the new
    split and its tensors at the old one, while the coordinator took the split as refused and its peers had
    carried it out; later plans could hand it pages past its tensors. It now breaks the group (GroupBroken: the
    rank exits and its group is made again, from nothing)."""
    from lockstep.steps import GroupBroken

    eng = Engine.create(EngineConfig(str(tiny_llama), page_size=PS, kv_pages=16))
    if ranks > 1:
        monkeypatch.setattr(eng, "comm", _TwoRanks())

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(eng.kv, "resize", out_of_memory)
    with pytest.raises(GroupBroken, match="the KV split agreed at step 0 .*out of memory"):
        eng.step(Plan(step=0, pool_split=(("full", 12),)))
