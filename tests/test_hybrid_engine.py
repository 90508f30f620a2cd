"""A hybrid model (tiny Gemma 3: sliding window 8 on three layers of four) served by real rank processes at
TP 2 (gloo) and driven by the real scheduler: greedy outputs equal `transformers` with the prefix cache on
or off, with one rank flushed, with one rank's pools smaller; a long request holds only its window in the
`sliding` pool; and once idle, both pools hold nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from checkpoints import random_prompt
from lockstep.coordinator.rebalance import RebalancePolicy, Rebalancer
from lockstep.coordinator.request import Request
from lockstep.coordinator.scheduler import TOKEN, Scheduler
from lockstep.kv.page_keys import key_salt
from lockstep.kv.paging import pages_for, peak_pages
from lockstep.local_group import LocalGroup
from lockstep.steps import Report

PS = 4
WINDOW = 8
PREFIX = random_prompt(900, 36)  # nine pages: four and a half windows
PROMPTS = [PREFIX + random_prompt(910 + i, 5 + 3 * i) for i in range(4)] + [random_prompt(920, 50)]


@pytest.fixture(scope="module")
def gemma(checkpoint_dir) -> str:
    return str(checkpoint_dir("gemma3_hybrid"))


@pytest.fixture(scope="module")
def reference(gemma):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32)
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(tokens: list[int], n: int) -> list[int]:
        key = (tuple(tokens), n)
        if key not in memo:
            out = model.generate(torch.tensor([tokens]), max_new_tokens=n, eos_token_id=None, do_sample=False)
            memo[key] = out[0, len(tokens):].tolist()
        return memo[key]

    return greedy


class Served:
    """The scheduler over a LocalGroup, as the coordinator's step loop drives it (no HTTP)."""

    def __init__(self, group: LocalGroup, caching: bool, budget: int = 24, policy: RebalancePolicy | None = None
                 ) -> None:
        info = group.infos[0]
        assert info.sliding_window == WINDOW and dict(info.pools).keys() == {"full", "sliding"}
        self.group = group
        rebalancer = None if policy is None else Rebalancer(policy, PS, WINDOW, dict(info.page_bytes),
                                                            info.max_model_len)
        self.sched = Scheduler(PS, key_salt(info.model_id, PS), budget, 4, len(group.infos), caching,
                               info.max_model_len, window=info.sliding_window, rebalancer=rebalancer)
        self.step = 0
        self.reports: list[Report] = []
        self.history: list[list[Report]] = []

    def run(self, prompts: list[list[int]], n: int, flush_rank: int | None = None) -> list[list[int]]:
        """Serve the prompts together (greedy, n tokens each); flush `flush_rank` at the third step."""
        reqs = [Request(f"r{self.step}-{i}", p, max_tokens=n) for i, p in enumerate(prompts)]
        for r in reqs:
            self.sched.add(r)
        out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        first = self.step
        while self.sched.has_work():
            flush = flush_rank is not None and self.step == first + 2
            plan = self.sched.plan(self.step, self.reports, flush=flush)
            plans = [replace(plan, flush_prefix_cache=flush and r == flush_rank) for r in range(len(self.group.infos))]
            self.reports = self.group.step(plans)
            assert not any(r.error for r in self.reports), [r.error for r in self.reports]
            self.history.append(self.reports)
            for e in self.sched.apply(self.reports):
                if e.kind == TOKEN:
                    out[e.request_id].append(e.token_id)
            self.step += 1
            assert self.step < first + 2000
        return [out[r.request_id] for r in reqs]

    def assert_idle(self) -> None:
        for report in self.reports:
            for pool in report.pools:
                assert pool.used == 0 and pool.pinned == 0 and pool.free + pool.evictable + pool.fenced == pool.total


def test_hybrid_outputs_equal_transformers_with_the_cache_on_flushed_and_off(gemma, reference):
    want = [reference(p, 6) for p in PROMPTS]
    with LocalGroup(gemma, 2, page_size=PS, kv_pages=64) as group:
        served = Served(group, caching=True)
        assert served.run(PROMPTS, 6) == want
        assert served.run(PROMPTS, 6, flush_rank=1) == want  # rank 1 drops its cache mid-way
        assert served.sched.stats.prefix_hit_tokens >= 3 * 32  # the shared prefix was skipped
        served.assert_idle()
    with LocalGroup(gemma, 2, page_size=PS, kv_pages=64, prefix_caching=False) as group:
        served = Served(group, caching=False)
        assert served.run(PROMPTS, 6) == want
        assert served.sched.stats.prefix_hit_tokens == 0
        served.assert_idle()


def test_a_rank_with_smaller_pools_agrees_and_outputs_do_not_change(gemma, reference):
    with LocalGroup(gemma, 2, page_size=PS, kv_pages=[64, 22]) as group:
        served = Served(group, caching=True, budget=16)
        for _ in range(2):
            assert served.run(PROMPTS, 10) == [reference(p, 10) for p in PROMPTS]
        assert served.sched.stats.preemptions > 0  # rank 1's pools were the limit
        assert served.sched.stats.prefix_hit_tokens > 0
        served.assert_idle()


def test_a_long_request_holds_its_context_in_full_and_its_window_in_sliding(gemma, reference):
    prompt = random_prompt(930, 60)
    with LocalGroup(gemma, 2, page_size=PS, kv_pages=64) as group:
        served = Served(group, caching=True)
        assert served.run([prompt], 40) == [reference(prompt, 40)]
        long_steps = 0
        for reports in served.history:
            for report in reports:
                pools = {p.pool: p for p in report.pools}
                if pools["full"].used >= pages_for(80, PS):  # the context is 80 positions and more
                    long_steps += 1
                    assert pools["sliding"].used <= peak_pages(WINDOW, PS, 100) == 3
        assert long_steps >= 2 * 15
        served.assert_idle()


def test_a_shifting_workload_rebalances_the_pools_and_outputs_stay_equal_to_transformers(gemma, reference):
    """Long prompts want full pages, short chats as many sliding ones: the split follows, at the same step on
    both ranks, and greedy tokens equal transformers' before, across and after every move."""
    long_prompts = [random_prompt(940 + i, 60) for i in range(4)]
    short_chats = [random_prompt(950 + i, 6) for i in range(12)]
    policy = RebalancePolicy(interval_steps=2, cooldown_s=0.0, min_samples=3, threshold=1.1)
    with LocalGroup(gemma, 2, page_size=PS, kv_pages=64) as group:
        served = Served(group, caching=True, policy=policy)
        for batch in (long_prompts[:2], long_prompts[2:], short_chats[:6], short_chats[6:]):
            assert served.run(batch, 6) == [reference(p, 6) for p in batch]
        splits = []
        for step, reports in enumerate(served.history):
            totals = [{p.pool: p.total for p in r.pools} for r in reports]
            assert totals[0] == totals[1], f"step {step}: the ranks hold different pools {totals}"
            if splits and totals[0] != splits[-1]:
                splits.append(totals[0])
            elif not splits:
                splits.append(totals[0])
        assert served.sched.rebalances >= 2 and len(splits) >= 3, splits
        assert splits[1]["full"] > splits[0]["full"]  # the long prompts took full pages
        assert splits[-1]["sliding"] > splits[1]["sliding"]  # the short chats took sliding ones back
        served.assert_idle()
