"""Pending tokens on real ranks (engine.py): a decode planned before its token was sampled runs on the token the
sampling rank drew, which reaches every rank in the step's agreement collective (real torch.distributed)."""

from __future__ import annotations

import pytest
import torch

from checkpoints import random_prompt as prompt
from lockstep.engine import AGREEMENT_SLOTS, Engine
from lockstep.engine_config import EngineConfig
from lockstep.local_group import LocalGroup
from lockstep.steps import PENDING_TOKEN, Admit, Chunk, Plan, SamplingParams

PS = 16
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)


def _run(step_fn, prompts: dict[str, list[int]], n: int, pending: bool) -> dict[str, list[int]]:
    """Prefill every prompt in one step, then n - 1 decode steps: with `pending`, each decode names the token of
    the step before instead of its value, as a plan built ahead does."""
    batch = tuple(Chunk(rid, tuple(p), 0, sample=True, sampling=SAMPLED) for rid, p in prompts.items())
    reports = step_fn(Plan(0, admits=tuple(Admit(rid) for rid in prompts), batch=batch))
    out = {s.request_id: [s.token_id] for s in reports[0].sampled}
    for i in range(1, n):
        batch = tuple(Chunk(rid, (PENDING_TOKEN,) if pending else (toks[-1],), len(prompts[rid]) + i - 1, True,
                            SAMPLED, i) for rid, toks in out.items())
        reports = step_fn(Plan(i, batch=batch))
        assert all(not r.error for r in reports), [r.error for r in reports]
        for s in reports[0].sampled:
            out[s.request_id].append(s.token_id)
    step_fn(Plan(n, releases=tuple(prompts)))
    return out


@pytest.mark.parametrize("n_requests", [2, AGREEMENT_SLOTS + 6])
def test_tp2_pending_tokens_give_the_tokens_of_explicit_ones(tiny_llama, n_requests):
    """Up to AGREEMENT_SLOTS pending tokens ride in the agreement collective; the rest in a second one."""
    prompts = {f"r{i}": prompt(i + 1, 9 if i else 21) for i in range(n_requests)}
    n = 8 if n_requests == 2 else 4
    with LocalGroup(str(tiny_llama), 2, page_size=PS, kv_pages=2 * n_requests + 8) as group:
        explicit = _run(group.step, prompts, n, pending=False)
    with LocalGroup(str(tiny_llama), 2, page_size=PS, kv_pages=2 * n_requests + 8) as group:
        ahead = _run(group.step, prompts, n, pending=True)
        reports = group.step(Plan(n + 1, probes=()))
        assert [r.pools[0].used for r in reports] == [0, 0]
    assert ahead == explicit and all(len(t) == n for t in ahead.values()) and len(ahead) == n_requests


@pytest.fixture(scope="module")
def engine(tiny_llama):
    torch.set_num_threads(2)
    return Engine.create(EngineConfig(str(tiny_llama), page_size=PS, kv_pages=64))


def test_a_pending_token_after_a_refused_step_is_refused_with_a_reason(engine):
    p = prompt(3, 10)
    engine.step(Plan(0, admits=(Admit("c"),), batch=(Chunk("c", tuple(p), 0, sample=True),)))
    refused = engine.step(Plan(1, admits=(Admit("c"),)))  # admitted twice: refused, so nothing was drawn
    assert refused.error
    report = engine.step(Plan(2, batch=(Chunk("c", (PENDING_TOKEN,), len(p), True, sample_index=1),)))
    assert "no token drawn at step 1 for pending request c" in report.error
    report = engine.step(Plan(3, releases=("c",)))
    assert not report.error and report.pools[0].used == 0


def test_tp2_a_rank_abstaining_from_a_step_whose_plan_has_pending_tokens_meets_the_others(tiny_llama):
    """A coordinator that died between writing a plan built ahead to rank 0 and to rank 1: its successor has rank 1
    abstain from that step. Rank 1's refusal must meet rank 0's agreement collective whatever rank 0's plan
    carries (bug: the pending tokens rode in that collective, so its shape differed, rank 0 read a refusal
    that was not there and went into the forward alone until the collective timed out)."""
    p = prompt(4, 12)
    with LocalGroup(str(tiny_llama), 2, page_size=PS, kv_pages=64, timeout_s=40) as group:
        first = group.step(Plan(0, admits=(Admit("d"),), batch=(Chunk("d", tuple(p), 0, sample=True),)))
        ahead = Plan(1, batch=(Chunk("d", (PENDING_TOKEN,), len(p), True, sample_index=1),))
        reports = group.step([ahead, Plan(1, abstain=True)])
        assert "abstains from step 1" in reports[1].error
        assert reports[0].error == "another rank of the group refused this step"
        token = first[0].sampled[0].token_id
        again = group.step(Plan(2, batch=(Chunk("d", (token,), len(p), True, sample_index=1),)))
        assert all(not r.error for r in again) and len(again[0].sampled) == 1
        group.step(Plan(3, releases=("d",)))


class RecordingComm:
    """Rank 0 of two whose peer adds zeros: records the shape of every all-reduce the engine joins."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(t.shape))
        return t


@pytest.mark.parametrize(("error", "pending", "collectives"), [
    ("", 0, 1), ("", 3, 1), ("", AGREEMENT_SLOTS, 1), ("refused", 5, 1), ("", AGREEMENT_SLOTS + 6, 2),
])
def test_the_agreement_collective_has_one_shape_and_carries_the_pending_tokens(error, pending, collectives):
    """Every rank's first collective of a step has the same shape whatever its plan (a rank that abstains meets one
    that carries pending tokens); up to AGREEMENT_SLOTS pending tokens need no second one."""
    engine = object.__new__(Engine)
    engine.comm, engine.device = RecordingComm(), torch.device("cpu")
    drawn = [1000 + i for i in range(pending)]
    refused, shared = engine._agree(1, error, drawn)
    assert refused == bool(error)
    assert engine.comm.shapes[0] == (1 + AGREEMENT_SLOTS,) and len(engine.comm.shapes) == collectives
    if not error:
        assert shared == drawn
