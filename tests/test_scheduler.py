"""The scheduler driven against simulated ranks (`sim_ranks`): chunking, prefixes, flushes, preemption,
refusals, aborts and replays, each checked against the tokens an undisturbed run draws."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lockstep.coordinator.request import Request, RequestStatus
from lockstep.coordinator.scheduler import FINISHED, PREEMPTED, TOKEN, Event, Scheduler
from lockstep.kv.page_keys import page_keys
from lockstep.steps import Admit, Chunk, Plan, Probe, ProbeAnswer, Report, Sampled, SamplingParams
from sim_ranks import SALT, Group, SimRank, computed_tokens, fake_sample, finished, make_sched, reference


def test_chunked_prefill_then_decode_with_positions_and_sample_index():
    sched = make_sched(budget=8, caching=False)
    g = Group(sched, [64], caching=False)
    req = Request("a", list(range(1, 21)), max_tokens=3)
    sched.add(req)
    while sched.has_work():
        g.run_step()
    batches = [[(c.start, len(c.token_ids), c.sample, c.sample_index) for c in p.batch] for p in g.plans]
    assert [b for b in batches if b] == [
        [(0, 8, False, 0)], [(8, 8, False, 0)], [(16, 4, True, 0)], [(20, 1, True, 1)], [(21, 1, True, 2)]
    ]
    assert req.generated == reference(req) and req.finish_reason == "length"
    assert req.sampling.seed is None  # greedy: it draws nothing, so its parameters are every greedy request's
    hot = SamplingParams(temperature=1.0)
    drawn = Request("a", [1], hot, max_tokens=1).sampling.seed
    assert 0 <= drawn < 1 << 63 and Request("a", [1], hot, max_tokens=1).sampling.seed != drawn  # the id draws afresh
    assert [e.kind for e in g.events] == [TOKEN, TOKEN, TOKEN, FINISHED]
    assert "a" in g.plans[-1].releases
    g.ranks[0].assert_idle()


def test_stop_token_finishes_and_releases():
    seeded = SamplingParams(seed=11)  # the probe draws what the request will: an unseeded one draws afresh
    probe = Request("s", [3, 4, 5], seeded, max_tokens=50)
    ref = reference(probe)
    stop = ref[2]
    req = Request("s", [3, 4, 5], seeded, max_tokens=50, stop_token_ids=[stop])
    sched = make_sched()
    g = Group(sched, [32])
    sched.add(req)
    g.run()
    assert req.generated[-1] == stop and stop not in req.generated[:-1]
    assert req.finish_reason == "stop" and req.generated == reference(req)


def test_probe_then_admit_with_the_prefix_every_rank_holds():
    sched = make_sched(ranks=2, budget=64)
    g = Group(sched, [40, 40])
    prompt = list(range(1, 23))  # 5 full pages of 4, and 2 tokens
    g.ranks[0].warm(prompt[:20])
    g.ranks[1].warm(prompt[:12])
    req = Request("p", prompt, max_tokens=2)
    sched.add(req)
    g.run_step()
    g.run_step()
    first, plan = g.plans
    assert [p.request_id for p in first.probes] == ["p"] and not first.admits  # no pool states yet
    assert [a.request_id for a in plan.admits] == ["p"] and not plan.probes  # admitted from report 0
    assert plan.admits[0].prefix_keys == tuple(page_keys(prompt, 4, SALT)[:3])
    assert plan.batch[0].start == 12 and plan.batch[0].token_ids == tuple(prompt[12:])
    g.run()
    assert req.cached_tokens == 12 and req.generated == reference(req)
    assert sched.stats.prefix_agreed_pages == 3 and sched.stats.prefix_offered_pages == [5, 3]


def test_exact_page_prompt_reuses_all_but_the_last_page():
    sched = make_sched(ranks=1, budget=64)
    g = Group(sched, [40])
    prompt = list(range(1, 17))  # exactly 4 pages
    g.ranks[0].warm(prompt)
    req = Request("x", prompt, max_tokens=1)
    sched.add(req)
    g.run()
    admit_plan = next(p for p in g.plans if p.admits)
    assert len(admit_plan.admits[0].prefix_keys) == 3
    assert admit_plan.batch[0].start == 12 and admit_plan.batch[0].sample
    assert req.generated == reference(req)


def test_prefix_caching_off_sends_no_probe_and_admits_at_once():
    sched = make_sched(ranks=2, caching=False)
    g = Group(sched, [32, 32], caching=False)
    sched.add(Request("a", list(range(1, 12)), max_tokens=2))
    g.run_step()  # no reports yet: nothing can be admitted
    assert not g.plans[0].admits and not g.plans[0].probes
    g.run_step()
    assert [a.request_id for a in g.plans[1].admits] == ["a"] and not g.plans[1].probes
    g.run()


def test_short_prompt_needs_no_probe():
    sched = make_sched(ranks=2)
    g = Group(sched, [32, 32])
    g.run_step()
    sched.add(Request("a", [1, 2, 3, 4], max_tokens=1))  # one page: the cap leaves nothing to reuse
    g.run_step()
    assert [a.request_id for a in g.plans[1].admits] == ["a"] and not g.plans[1].probes


def test_shared_prefix_second_request_reuses_what_the_first_committed():
    sched = make_sched(ranks=2, budget=64)
    g = Group(sched, [40, 24])
    prefix = list(range(1, 17))
    a = Request("a", prefix + [30, 31], max_tokens=2)
    sched.add(a)
    g.run()
    b = Request("b", prefix + [40, 41, 42], max_tokens=2)
    sched.add(b)
    g.run()
    assert b.cached_tokens == 16 and b.generated == reference(b)


def test_flushed_rank_lowers_the_agreed_prefix():
    sched = make_sched(ranks=2, budget=64)
    g = Group(sched, [40, 40])
    prompt = list(range(1, 18))
    g.ranks[0].warm(prompt)
    g.ranks[1].warm(prompt)
    g.run_step(flush=(1,))
    req = Request("f", prompt, max_tokens=1)
    sched.add(req)
    g.run()
    assert req.cached_tokens == 0 and req.generated == reference(req)


def test_flush_in_the_admitting_step_admits_without_a_prefix():
    sched = make_sched(ranks=2, budget=64)
    g = Group(sched, [40, 40])
    prompt = list(range(1, 18))
    for r in g.ranks:
        r.warm(prompt)
    g.run_step()
    sched.add(Request("f", prompt, max_tokens=1))
    g.run_step()  # probed
    g.run_step(flush=(0,))  # would be admitted with 4 pages; rank 0 drops them before pinning
    admits = [a for p in g.plans for a in p.admits]
    assert admits and admits[0].prefix_keys == ()
    g.run()
    assert not any(e.error for e in g.events)


def test_a_flush_comes_after_the_pins_of_its_own_plan():
    """The engine flushes after the step's pins and commits, so an admit agreed on a cached prefix survives a
    flush in the same plan, and the probes answer from the flushed state (the pinned prefix stays indexed).
    The ranks simulated here once flushed before pinning, and refused this plan; they now run the engine's
    own bookkeeping, so that order can no longer drift from the engine's."""
    rank = SimRank(0, 16, 4)
    prompt = list(range(1, 15))  # 3 full pages and 2 tokens
    rank.warm(prompt)
    keys = tuple(page_keys(prompt, 4, SALT))
    seed = SamplingParams(seed=7)
    plan = Plan(
        step=0,
        admits=(Admit("x", keys[:2]),),
        batch=(Chunk("x", tuple(prompt[8:]), 8, sample=True, sampling=seed),),
        probes=(Probe("y", keys),),
        flush_prefix_cache=True,
    )
    assert rank.prepare(plan) == ""
    report = rank.finish(plan, "")
    assert not report.error
    assert report.sampled == (Sampled("x", fake_sample(7, 0, prompt)),)
    # x's two pinned pages stay; the flush took the cached third page (x's own copy of it stays private).
    assert report.probes == (ProbeAnswer("y", 2, 2),)
    assert report.pools[0].evictable == 0


def test_preemption_under_pressure_recomputes_and_resumes():
    sched = make_sched(ranks=2, budget=32, seqs=4, caching=False)
    g = Group(sched, [12, 9], caching=False)
    reqs = [Request(f"r{i}", [i + 1] * 6, max_tokens=20) for i in range(3)]
    for r in reqs:
        sched.add(r)
    g.run()
    assert sched.stats.preemptions > 0
    preempted = {e.request_id for e in g.events if e.kind == PREEMPTED}
    assert preempted and "r0" not in preempted  # the newest give way, never the oldest first
    for r in reqs:
        assert r.finish_reason == "length" and r.generated == reference(r), r
    assert any(r.num_preemptions for r in reqs)


def test_preempted_request_recompute_starts_at_prompt_plus_generated():
    sched = make_sched(ranks=1, budget=32, seqs=4, caching=False)
    g = Group(sched, [8], caching=False)
    a = Request("a", [1] * 8, max_tokens=16)
    b = Request("b", [2] * 8, max_tokens=16)
    sched.add(a)
    sched.add(b)
    while not any(e.kind == PREEMPTED for e in g.events):
        g.run_step()
    victim = next(r for r in (a, b) if r.num_preemptions)
    assert victim is b and victim.status is RequestStatus.WAITING and victim.num_computed == 0
    kept = list(victim.generated)
    assert kept
    while not any(a.request_id == "b" for a in g.plans[-1].admits):
        g.run_step()
    chunks = [c for c in g.plans[-1].batch if c.request_id == "b"]
    recompute = tuple([2] * 8 + kept)
    assert chunks[0].start == 0 and chunks[0].token_ids == recompute[: len(chunks[0].token_ids)]
    g.run()
    assert b.generated[: len(kept)] == kept and b.generated == reference(b)


def test_request_too_big_for_the_smallest_rank_fails_with_a_reason():
    sched = make_sched(ranks=2)
    g = Group(sched, [40, 6])
    big = Request("big", [1] * 20, max_tokens=8)  # 27 positions: 7 pages > 6
    ok = Request("ok", [1] * 20, max_tokens=4)  # 23 positions: 6 pages
    sched.add(big)
    sched.add(ok)
    g.run()
    assert big.finish_reason == "error" and "smallest rank pool holds 6" in big.error
    assert ok.finish_reason == "length" and ok.generated == reference(ok)


def test_abort_waiting_running_and_in_flight_leaks_nothing():
    sched = make_sched(ranks=2, budget=8, seqs=2, caching=False)
    g = Group(sched, [30, 20], caching=False)
    reqs = [Request(f"a{i}", list(range(1, 15)), max_tokens=30) for i in range(4)]
    for r in reqs:
        sched.add(r)
    g.run_step()
    g.run_step()
    g.run_step()
    assert reqs[0].status is RequestStatus.RUNNING and reqs[3].status is RequestStatus.WAITING
    assert sched.abort("a3") == [Event("a3", FINISHED, finish_reason="abort")]
    assert sched.abort("a0")[0].finish_reason == "abort"
    assert sched.abort("a0") == [] and sched.abort("nope") == []
    g.run_step()
    assert "a0" in g.plans[-1].releases and "a3" not in g.plans[-1].releases
    # abort while the plan runs: its report carries a token nobody wants, its pages go next plan
    in_flight: list[str] = []

    def abort_first(plan: Plan) -> None:
        in_flight.append(plan.batch[0].request_id)
        sched.abort(in_flight[0])

    events = g.run_step(between=abort_first)
    assert in_flight and not [e for e in events if e.request_id == in_flight[0]]
    g.run_step()
    assert in_flight[0] in g.plans[-1].releases
    g.run()
    assert all(r.finish_reason == "abort" for r in reqs if r.request_id in {"a0", "a3", in_flight[0]})
    assert all(r.generated == reference(r) for r in reqs if r.finish_reason == "length")


def test_step_refused_by_every_rank_fails_admits_and_replans_the_rest():
    sched = make_sched(ranks=2, budget=16, seqs=4, caching=False)
    g = Group(sched, [30, 30], caching=False)
    a = Request("a", [1, 2, 3, 4, 5], max_tokens=6)
    sched.add(a)
    g.run_step()
    g.run_step()
    g.run_step()
    c = Request("c", [6], max_tokens=1)
    sched.add(c)
    g.run_step()
    assert c.finish_reason == "length"
    b = Request("b", [7, 8, 9], max_tokens=3)
    sched.add(b)
    before = a.num_computed
    events = g.run_step(refuse={1: "rank 1: injected"})
    plan = g.plans[-1]
    assert [x.request_id for x in plan.admits] == ["b"] and plan.releases == ("c",)
    assert finished(events)["b"].finish_reason == "error" and "injected" in finished(events)["b"].error
    assert a.num_computed == before and a.status is RequestStatus.RUNNING
    g.next_start["a"] = before
    g.run_step()
    assert set(g.plans[-1].releases) == {"b", "c"}  # a refusing rank may not have carried them out
    assert [c.start for c in g.plans[-1].batch if c.request_id == "a"] == [before]
    g.run()
    assert a.generated == reference(a) and sched.stats.failed_steps == 1


def test_step_refused_by_only_some_ranks_preempts_the_batch():
    sched = make_sched(ranks=2, budget=16, caching=False)
    g = Group(sched, [30, 30], caching=False)
    a = Request("a", [1, 2, 3, 4, 5], max_tokens=6)
    sched.add(a)
    g.run_step()
    g.run_step()

    def rank1_failed(reports: list[Report]) -> None:
        reports[1] = replace(reports[1], error="rank 1: lost its device")

    events = g.run_step(tamper=rank1_failed)
    assert [e.kind for e in events] == [PREEMPTED] and a.status is RequestStatus.WAITING
    assert a.num_preemptions == 1 and sched.stats.failed_steps == 1
    g.run_step()
    assert "a" in g.plans[-1].releases
    g.run()
    assert a.generated == reference(a)


def test_missing_sample_fails_only_that_request():
    sched = make_sched(ranks=1, caching=False)
    g = Group(sched, [30], caching=False)
    sched.add(Request("a", [1, 2], max_tokens=3))
    g.run_step()
    events = g.run_step(tamper=lambda reports: reports.__setitem__(0, replace(reports[0], sampled=())))
    assert finished(events)["a"].finish_reason == "error" and "no rank sampled" in finished(events)["a"].error
    g.run()


def test_duplicate_report_delivery_is_ignored_and_never_re_arms_a_probe():
    sched = make_sched(ranks=2, budget=64)
    g = Group(sched, [40, 40])
    prompt = list(range(1, 14))
    for r in g.ranks:
        r.warm(prompt)
    g.run_step()
    sched.add(Request("d", prompt, max_tokens=2))
    g.run_step()  # probe
    g.run_step()  # admitted with the answers
    assert g.plans[-1].admits and not g.plans[-1].probes
    assert sched.apply(g.reports) == []  # the same reports again
    g.run_step()
    assert not g.plans[-1].probes and not g.plans[-1].admits
    g.run()


def test_bad_protocol_use_gets_specific_errors():
    sched = make_sched(ranks=2)
    sched.add(Request("a", [1, 2, 3], max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(Request("a", [1], max_tokens=1))
    plan = sched.plan(0, [])
    with pytest.raises(ValueError, match="not applied"):
        sched.plan(1, [])
    one = Report(step=0, rank=0)
    with pytest.raises(ValueError, match=r"ranks \[1\] are missing"):
        sched.apply([one])
    with pytest.raises(ValueError, match="two reports from rank 0"):
        sched.apply([one, Report(step=0, rank=0)])
    with pytest.raises(ValueError, match="do not answer a plan in flight"):
        sched.apply([Report(step=5, rank=0), Report(step=5, rank=1)])
    sched.apply([Report(step=0, rank=r) for r in range(2)])
    with pytest.raises(ValueError, match="must come after"):
        sched.plan(plan.step, [])
    # reports without pools (a refusal of an unreadable plan) no longer stop the loop: nothing is scheduled
    assert sched.plan(1, [Report(step=0, rank=r) for r in range(2)]).admits == ()
    with pytest.raises(ValueError, match="exceed the model's 8 positions"):
        make_sched(max_model_len=8).add(Request("long", [1] * 5, max_tokens=4))
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(4, SALT, 16, 0, 1)


def test_pages_a_release_frees_count_only_from_the_next_report():
    sched = make_sched(ranks=1, budget=64, caching=False)
    g = Group(sched, [5], caching=False)
    a = Request("a", [1] * 8, max_tokens=1)  # holds 2 pages
    b = Request("b", [2] * 16, max_tokens=1)  # needs 4 pages at once
    sched.add(a)
    sched.add(b)
    g.run_step()
    g.run_step()
    assert a.finish_reason == "length" and [x.request_id for x in g.plans[1].admits] == ["a"]
    g.run_step()
    assert g.plans[2].releases == ("a",) and not g.plans[2].admits  # report 1 still shows a's pages
    g.run_step()
    assert [x.request_id for x in g.plans[3].admits] == ["b"]
    assert sched.stats.deferred["pages"] == 2
    g.run()


def test_a_refusal_that_repeats_preempts_instead_of_replanning_forever():
    sched = make_sched(ranks=2, budget=16, caching=False)
    g = Group(sched, [30, 30], caching=False)
    a = Request("a", [1, 2, 3, 4, 5], max_tokens=6)
    sched.add(a)
    g.run_step()
    g.run_step()
    assert a.status is RequestStatus.RUNNING
    g.run_step(refuse={0: "rank 0: keeps refusing", 1: "rank 1: keeps refusing"})
    assert a.status is RequestStatus.RUNNING  # once: planned again as it was
    events = g.run_step(refuse={0: "rank 0: keeps refusing", 1: "rank 1: keeps refusing"})
    assert [e.kind for e in events] == [PREEMPTED] and a.status is RequestStatus.WAITING
    g.run()
    assert a.generated == reference(a)


# ----- a prompt that a running request is computing now is waited for, not computed twice (prefix_sharing)

PROMPT = list(range(1, 23))  # 5 full pages of 4, and 2 tokens


def _admitted(g: Group) -> list[list[str]]:
    return [[a.request_id for a in p.admits] for p in g.plans]


def test_identical_prompts_arriving_together_compute_the_prompt_once():
    sched = make_sched(ranks=2, budget=64, seqs=4)
    g = Group(sched, [40, 40])
    reqs = [Request(f"n-{i}", PROMPT, max_tokens=3) for i in range(4)]
    for r in reqs:
        sched.add(r)
    g.run()
    assert _admitted(g)[:3] == [[], ["n-0"], ["n-1", "n-2", "n-3"]]  # held one step, then admitted together
    assert computed_tokens(g.plans) == {"n-0": 22 + 2, "n-1": 2 + 2, "n-2": 2 + 2, "n-3": 2 + 2}
    assert [r.cached_tokens for r in reqs] == [0, 20, 20, 20]
    assert sched.stats.prefix_hit_tokens == 3 * 20 and sched.stats.deferred["prefix_pending"] == 3
    assert sched.stats.prefix_queried_tokens == 4 * len(PROMPT)  # the hit rate's denominator, at admission
    for r in reqs:
        assert r.generated == reference(r) and r.finish_reason == "length"


def test_held_request_waits_for_the_whole_chunked_prefill_of_its_sibling():
    sched = make_sched(ranks=1, budget=8, seqs=4)
    g = Group(sched, [40])
    a, b = Request("a", PROMPT, max_tokens=2), Request("b", PROMPT + [9, 9], max_tokens=2)
    sched.add(a)
    sched.add(b)
    g.run()
    assert computed_tokens(g.plans) == {"a": 22 + 1, "b": 4 + 1}  # b: the 6th page is only its own
    assert b.cached_tokens == 20  # held while a's chunks left budget to spare, else the budget deferred it
    assert sched.stats.deferred == {"prefix_pending": 1, "token_budget": 2}
    assert [p.request_id for p in g.plans[2].probes] == [] and [p.request_id for p in g.plans[3].probes] == ["b"]
    assert a.generated == reference(a) and b.generated == reference(b)


def test_prefix_caching_off_or_a_scored_prompt_holds_nothing():
    sched = make_sched(ranks=1, budget=64, caching=False)
    g = Group(sched, [40], caching=False)
    reqs = [Request(f"n-{i}", PROMPT, max_tokens=2) for i in range(3)]
    for r in reqs:
        sched.add(r)
    g.run()
    assert _admitted(g)[1] == ["n-0", "n-1", "n-2"] and not sched.stats.deferred["prefix_pending"]
    assert computed_tokens(g.plans) == dict.fromkeys(("n-0", "n-1", "n-2"), 23)
    sched = make_sched(ranks=1, budget=64)
    g = Group(sched, [40])
    sched.add(Request("a", PROMPT, max_tokens=2))
    sched.add(Request("scored", PROMPT, SamplingParams(prompt_logprobs=0), max_tokens=2))
    g.run_step()
    g.run_step()
    assert _admitted(g)[1] == ["a", "scored"]  # it computes every position anyway: nothing to wait for


def test_unrelated_requests_behind_a_held_one_are_admitted_and_it_keeps_its_place():
    sched = make_sched(ranks=2, budget=64, seqs=4)
    g = Group(sched, [60, 60])
    s, w = Request("s", PROMPT, max_tokens=2), Request("w", PROMPT, max_tokens=2)
    x, z = Request("x", [7] * 9, max_tokens=12), Request("z", [8] * 9, max_tokens=12)
    for r in (s, w, x, z):
        sched.add(r)
    g.run()
    assert _admitted(g)[:3] == [[], ["s", "x", "z"], ["w"]]  # w held: x and z go past it
    assert w.cached_tokens == 20 and sched.stats.deferred == {"prefix_pending": 1}
    for r in (s, w, x, z):
        assert r.generated == reference(r)


def test_a_held_request_waits_its_turn_once_its_pages_are_committed():
    sched = make_sched(ranks=1, budget=64, seqs=2)
    g = Group(sched, [60])
    s, w = Request("s", PROMPT, max_tokens=6), Request("w", PROMPT, max_tokens=2)
    later = [Request(f"l{i}", [5, 6, i], max_tokens=16) for i in range(2)]
    for r in (s, w, *later):
        sched.add(r)
    g.run()
    admitted = _admitted(g)
    assert admitted[1] == ["s", "l0"]  # w held, l0 takes the last seat
    assert [rid for a in admitted for rid in a] == ["s", "l0", "w", "l1"]  # w's seat, not the later one's
    assert w.cached_tokens == 20 and w.generated == reference(w)


def test_aborting_the_computing_sibling_releases_the_held_one_with_what_it_committed():
    sched = make_sched(ranks=2, budget=8, seqs=4)
    g = Group(sched, [40, 40])
    s, w = Request("s", PROMPT, max_tokens=2), Request("w", PROMPT, max_tokens=2)
    sched.add(s)
    sched.add(w)
    g.run_step()
    g.run_step()
    g.run_step()  # s computed 16 positions: 4 pages committed; w held
    assert s.num_computed == 16 and w.status is RequestStatus.WAITING
    sched.abort("s")
    g.run()
    assert w.cached_tokens == 16 and computed_tokens(g.plans[3:])["w"] == 6 + 1
    assert w.generated == reference(w)


def test_preempting_the_computing_sibling_releases_the_held_one():
    sched = make_sched(ranks=2, budget=8, seqs=4)
    g = Group(sched, [40, 40])
    s, w = Request("s", PROMPT, max_tokens=2), Request("w", PROMPT, max_tokens=2)
    sched.add(s)
    sched.add(w)
    g.run_step()
    g.run_step()

    def rank1_failed(reports: list[Report]) -> None:
        reports[1] = replace(reports[1], error="rank 1: lost its device")

    g.run_step(tamper=rank1_failed)
    assert s.status is RequestStatus.WAITING and s.num_preemptions == 1
    g.run_step()
    assert {p.request_id for p in g.plans[-1].probes} == {"s", "w"}  # w waits on nothing now
    g.run()
    assert s.generated == reference(s) and w.generated == reference(w)
    assert w.cached_tokens > 0


def test_same_prompt_as_a_request_that_finished_long_ago_is_probed_as_usual():
    sched = make_sched(ranks=1, budget=64)
    g = Group(sched, [40])
    sched.add(Request("old", PROMPT, max_tokens=2))
    g.run()
    new = Request("new", PROMPT, max_tokens=2)
    sched.add(new)
    g.run()
    assert new.cached_tokens == 20 and not sched.stats.deferred["prefix_pending"]


def test_computing_sibling_compares_the_one_page_the_running_request_fills_next():
    from lockstep.coordinator.prefix_sharing import computing_sibling

    def running(rid: str, tokens: list[int], computed: int) -> Request:
        r = Request(rid, tokens)
        r.status, r.num_computed = RequestStatus.RUNNING, computed
        return r

    w = Request("w", PROMPT)  # probes 5 pages
    same, other = running("s", PROMPT, 8), running("o", [99] + PROMPT[1:], 0)
    assert computing_sibling(w, [other, same], 5, 4, SALT) is same
    assert computing_sibling(w, [same], 0, 4, SALT) is None  # nothing to probe (caching off, scored prompt)
    assert computing_sibling(w, [same], 2, 4, SALT) is None  # it filled the two pages w would probe
    assert computing_sibling(w, [same], 5, 4, SALT, {"s": 20}) is None  # filled by the step being planned
    assert computing_sibling(w, [same], 5, 4, SALT, {"s": 19}) is same
    assert computing_sibling(w, [running("short", PROMPT[:10], 8)], 5, 4, SALT) is None  # page 2 never full
    w.status = RequestStatus.RUNNING
    assert computing_sibling(w, [w], 5, 4, SALT) is None  # never itself


def test_pages_gone_when_the_held_request_is_admitted_are_just_computed_again():
    sched = make_sched(ranks=2, budget=64)
    g = Group(sched, [40, 40])
    s, w = Request("s", PROMPT, max_tokens=2), Request("w", PROMPT, max_tokens=2)
    sched.add(s)
    sched.add(w)
    g.run_step()
    g.run_step()  # s computes the prompt; w is held
    g.run_step(flush=(1,))  # rank 1 drops its cache as w is admitted: agreement leaves w nothing to skip
    g.run()
    assert _admitted(g)[:3] == [[], ["s"], ["w"]]
    assert w.cached_tokens == 0 and computed_tokens(g.plans)["w"] == 22 + 1
    assert s.generated == reference(s) and w.generated == reference(w)


def test_pages_one_victim_frees_serve_every_request_that_cannot_grow_in_that_step():
    """Three short requests need a new page at the same step of a full pool; preempting the newest (a long one
    holding ~26 pages) covers all three. Found by a helper: each request preempted a victim of its own (here the
    long one, then a short one), up to 5x the preemptions of a benchmark-shaped load."""
    for pool in range(33, 40):
        sched = make_sched(budget=128, seqs=8, caching=False)
        g = Group(sched, [pool], caching=False)
        reqs = [Request(rid, [ord(rid)] * 8, max_tokens=30) for rid in "abc"]
        for r in reqs:
            sched.add(r)
        g.run_step()
        reqs.append(Request("d", [5] * 100, max_tokens=30))
        sched.add(reqs[-1])
        preempted: list[str] = []
        while sched.has_work():
            preempted += [e.request_id for e in g.run_step() if e.kind == PREEMPTED]
            assert g.step < 2000
        assert set(preempted) <= {"d"}, (pool, preempted)
        assert [r.finish_reason for r in reqs] == ["length"] * 4


def _first_token_step(long_prefill_token_threshold: int) -> tuple[int, list[int]]:
    """A 400-token prompt prefills in chunks of a 32-token budget; a 3-token request arrives at step 2. Returns the
    step of the short one's first token and the long one's chunk sizes."""
    sched = make_sched(budget=32, seqs=4, long_prefill_token_threshold=long_prefill_token_threshold)
    g = Group(sched, [200])
    long, short = Request("long", list(range(1, 401)), max_tokens=2), Request("short", [7, 8, 9], max_tokens=2)
    sched.add(long)
    first = -1
    while sched.has_work() or g.step < 2:
        if g.step == 2:
            sched.add(short)
        events = g.run_step()
        if first < 0 and any(e.request_id == "short" and e.kind == TOKEN for e in events):
            first = g.step
        assert g.step < 200
    chunks = [len(c.token_ids) for p in g.plans for c in p.batch if c.request_id == "long" and len(c.token_ids) > 1]
    assert long.generated == reference(long) and short.generated == reference(short)
    return first, chunks


def test_a_long_prefill_threshold_lets_a_short_request_in_beside_a_long_prompt():
    """vLLM's --long-prefill-token-threshold: a prefill chunk takes at most that many tokens of a step, so a short
    request arriving meanwhile is admitted beside it instead of after the whole prompt (found by a helper: 80 s
    to a short request's first token behind a 4000-token prompt)."""
    off, off_chunks = _first_token_step(0)
    on, on_chunks = _first_token_step(16)
    assert max(off_chunks) == 32 and max(on_chunks) == 16
    assert off > 12 and on <= 4, (off, on)  # 400 / 32 steps behind the prompt, against a step or two
