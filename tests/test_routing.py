"""The routing decision alone (coordinator/routing.py): prefix hits, the balance threshold, groups that cannot
serve, the LRU bound and forgetting, and the setting that chooses the policy."""

from __future__ import annotations

import pytest

from lockstep.coordinator.config import CoordinatorConfig, parse_config
from lockstep.coordinator.metrics import ROUTING_REASONS, Metrics
from lockstep.coordinator.routing import (
    LEAST_LOADED,
    PREFIX,
    GroupLoad,
    PrefixRouter,
    Route,
    RoutingPolicy,
    parse_policy,
)
from lockstep.kv.page_keys import key_salt, page_keys

PAGE = 16
SALT = key_salt("m", PAGE, "lockstep-routing")


def keys(seed: int, pages: int, shared: int = 0) -> list[bytes]:
    """Page keys of a prompt: `shared` pages of the common prefix 0, then pages of its own (seed)."""
    tokens = [7] * (shared * PAGE) + [(seed * 31 + i) % 997 + 3 for i in range((pages - shared) * PAGE)]
    return page_keys(tokens, PAGE, SALT)


def loads(**by_group: int) -> list[GroupLoad]:
    return [GroupLoad(name, load) for name, load in by_group.items()]


def router(**policy) -> PrefixRouter:
    return PrefixRouter(PAGE, RoutingPolicy(**policy))


def test_no_match_goes_to_the_least_loaded_group_first_in_order_on_ties():
    r = router()
    assert r.choose(keys(1, 8), loads(g0=3, g1=1, g2=1), 8 * PAGE) == Route("g1", "least_loaded", 0)
    assert r.choose([], loads(g0=0, g1=0), 5) == Route("g0", "least_loaded", 0)


def test_new_prefixes_spread_over_equally_loaded_groups_by_footprint():
    r = router()
    placed = []
    for seed in range(6):
        route = r.choose(keys(seed, 4), loads(g0=0, g1=0), 4 * PAGE)
        r.record(keys(seed, 4), route.group)
        placed.append(route.group)
    assert placed == ["g0", "g1"] * 3 and r.footprint("g0") == r.footprint("g1") == 12
    assert r.choose(keys(9, 4), loads(g0=1, g1=2), 4 * PAGE).group == "g0"  # load first
    assert router(policy=LEAST_LOADED).choose(keys(9, 4), loads(g0=0, g1=0), 4 * PAGE).group == "g0"


def test_footprints_follow_eviction_forgetting_and_shared_pages():
    r = router(max_entries=10)
    r.record(keys(1, 6, shared=2), "g0")
    r.record(keys(2, 6, shared=2), "g1")  # shares 2 pages with g0's: 10 entries, g0 in 6, g1 in 6
    assert (len(r), r.footprint("g0"), r.footprint("g1")) == (10, 6, 6)
    r.record(keys(3, 2), "g1")  # evicts g0's two deepest pages
    assert (len(r), r.footprint("g0"), r.footprint("g1")) == (10, 4, 8)
    r.forget("g1")
    assert (r.footprint("g0"), r.footprint("g1")) == (4, 0)
    r.record(keys(4, 4), "g0")  # evicts g0's two oldest pages, and two of forgotten g1's (not counted again)
    assert (len(r), r.footprint("g0"), r.footprint("g1")) == (10, 6, 0)
    for g in range(10):
        r.record(keys(5, 1), f"h{g}")
    assert sum(r.footprint(f"h{g}") for g in range(10)) == 8  # at most MAX_HOLDERS per page


def test_a_prefix_goes_back_to_the_group_it_was_sent_to_even_when_that_group_is_busier():
    r = router()
    r.record(keys(1, 8), "g1")
    assert r.choose(keys(1, 10), loads(g0=0, g1=5), 10 * PAGE + 3) == Route("g1", "prefix", 8)
    assert r.choose(keys(2, 10), loads(g0=0, g1=5), 10 * PAGE) == Route("g0", "least_loaded", 0)


def test_the_longest_match_wins_and_equal_matches_go_to_the_less_loaded_then_the_more_recent():
    r = router()
    r.record(keys(1, 4, shared=4), "g0")  # the common 4 pages only
    r.record(keys(1, 8, shared=4), "g1")  # the common 4 pages and 4 of its own
    assert r.matches(keys(1, 8, shared=4)) == {"g1": (8, 0), "g0": (4, 1)}
    assert r.choose(keys(1, 8, shared=4), loads(g0=0, g1=3), 8 * PAGE) == Route("g1", "prefix", 8)
    assert r.choose(keys(2, 8, shared=4), loads(g0=2, g1=1), 8 * PAGE) == Route("g1", "prefix", 4)
    assert r.choose(keys(2, 8, shared=4), loads(g0=1, g1=2), 8 * PAGE) == Route("g0", "prefix", 4)
    assert r.choose(keys(2, 8, shared=4), loads(g0=1, g1=1), 8 * PAGE) == Route("g1", "prefix", 4)  # recent


@pytest.mark.parametrize(("busy", "idle", "reason"), [
    (16, 0, "prefix"),  # 16 more: a difference of exactly balance_abs is still within it
    (17, 0, "least_loaded"),  # 17 more, and more than 1.5 times
    (40, 24, "prefix"),  # 16 more
    (51, 34, "prefix"),  # 17 more, but not more than 1.5 x 34 = 51
    (52, 34, "least_loaded"),  # 18 more, and 52 > 51
])
def test_a_prefix_group_far_busier_than_the_least_loaded_is_passed_over(busy, idle, reason):
    r = router()
    r.record(keys(1, 8), "g0")
    got = r.choose(keys(1, 8), loads(g0=busy, g1=idle), 8 * PAGE)
    assert (got.group, got.reason) == (("g0", "prefix") if reason == "prefix" else ("g1", "least_loaded"))


def test_an_overloaded_prefix_group_gives_way_to_the_next_best_match():
    r = router(balance_abs=4)
    r.record(keys(1, 8), "g0")
    r.record(keys(1, 6), "g1")
    assert r.choose(keys(1, 8), loads(g0=9, g1=4, g2=0), 8 * PAGE) == Route("g1", "prefix", 6)
    assert r.choose(keys(1, 8), loads(g0=9, g1=5, g2=0), 8 * PAGE) == Route("g2", "least_loaded", 0)


def test_a_short_match_does_not_steer():
    r = router()
    r.record(keys(1, 2, shared=2), "g1")
    assert r.choose(keys(2, 8, shared=2), loads(g0=0, g1=1), 8 * PAGE) == Route("g0", "least_loaded", 0)
    assert r.choose(keys(2, 6, shared=2), loads(g0=0, g1=1), 6 * PAGE) == Route("g1", "prefix", 2)  # 1/3 >= 0.3
    r = router(min_match_ratio=0)
    r.record(keys(1, 2, shared=2), "g1")
    assert r.choose(keys(2, 8, shared=2), loads(g0=0, g1=1), 8 * PAGE) == Route("g1", "prefix", 2)


def test_groups_down_draining_or_too_small_are_excluded():
    r = router()
    r.record(keys(1, 8), "g0")
    down = [GroupLoad("g0", 0, serving=False), GroupLoad("g1", 7), GroupLoad("g2", 3)]
    assert r.choose(keys(1, 8), down, 8 * PAGE) == Route("g2", "least_loaded", 0)
    assert r.choose(keys(1, 8), [GroupLoad("g0", 0, serving=False)], 8 * PAGE) is None
    assert r.choose(keys(1, 8), [], 8 * PAGE) is None
    small = [GroupLoad("g0", 0, capacity_tokens=200), GroupLoad("g1", 9, capacity_tokens=1000)]
    assert r.choose(keys(1, 8), small, 8 * PAGE, need_tokens=300) == Route("g1", "least_loaded", 0)
    assert r.choose(keys(1, 8), small, 8 * PAGE, need_tokens=200) == Route("g0", "prefix", 8)
    nowhere = [GroupLoad("g0", 4, capacity_tokens=200), GroupLoad("g1", 2, capacity_tokens=200)]
    assert r.choose(keys(1, 8), nowhere, 8 * PAGE, need_tokens=300).group == "g0"  # which then answers 400


def test_one_group_to_choose_from_is_least_loaded_routing():
    r = router()
    r.record(keys(1, 8), "g0")
    assert r.choose(keys(1, 8), loads(g0=4), 8 * PAGE) == Route("g0", "least_loaded", 0)
    both = [GroupLoad("g0", 4), GroupLoad("g1", 0, serving=False)]
    assert r.choose(keys(1, 8), both, 8 * PAGE).reason == "least_loaded"


def test_the_least_loaded_policy_never_reads_prefixes():
    r = router(policy=LEAST_LOADED)
    r.record(keys(1, 8), "g0")
    assert not r.wants_keys and router().wants_keys
    assert r.choose(keys(1, 8), loads(g0=1, g1=0), 8 * PAGE) == Route("g1", "least_loaded", 0)


def test_forgetting_a_group_drops_what_it_was_sent_and_not_what_others_were():
    r = router()
    r.record(keys(1, 8), "g0")
    r.record(keys(1, 8), "g1")
    r.forget("g1")
    assert r.matches(keys(1, 8)) == {"g0": (8, 1)}
    r.forget("g0")
    assert r.matches(keys(1, 8)) == {}
    assert r.choose(keys(1, 8), loads(g0=1, g1=0), 8 * PAGE) == Route("g1", "least_loaded", 0)
    r.record(keys(1, 8), "g0")  # sent again after it came back: it counts again
    assert r.matches(keys(1, 8)) == {"g0": (8, 0)}
    r.forget_all()
    assert len(r) == 0 and r.matches(keys(1, 8)) == {}


def test_the_map_is_bounded_and_evicts_the_least_recently_routed_prefix_deep_pages_first():
    r = router(max_entries=10)
    r.record(keys(1, 6), "g0")
    r.record(keys(2, 6), "g1")
    assert len(r) == 10
    assert r.matches(keys(2, 6)) == {"g1": (6, 0)}
    assert r.matches(keys(1, 6)) == {"g0": (4, 0)}  # its two deepest pages went first
    r.record(keys(1, 6), "g0")  # routed again: now the most recent
    assert r.matches(keys(1, 6)) == {"g0": (6, 0)} and r.matches(keys(2, 6)) == {"g1": (4, 0)}


def test_only_the_first_max_pages_are_read_or_recorded():
    r = router(max_pages=4)
    r.record(keys(1, 10), "g0")
    assert len(r) == 4 and r.matches(keys(1, 10)) == {"g0": (4, 0)}
    assert r.choose(keys(1, 10), loads(g0=1, g1=0), 10 * PAGE) == Route("g0", "prefix", 4)  # 4/10 >= 0.3


def test_holders_per_page_stay_few_and_most_recent_first():
    r = router()
    for g in range(12):
        r.record(keys(1, 2), f"g{g}")
    assert r.matches(keys(1, 2)) == {f"g{g}": (2, 11 - g) for g in range(4, 12)}


def test_policy_and_setting_validation(capsys):
    assert parse_policy(" Least_Loaded ") == LEAST_LOADED and parse_policy("prefix") == PREFIX
    with pytest.raises(ValueError, match="must be one of prefix, least-loaded"):
        parse_policy("random")
    for bad in ({"policy": "random"}, {"balance_rel": 0.5}, {"balance_abs": -1}, {"min_match_ratio": 2},
                {"max_entries": 0}):
        with pytest.raises(ValueError):
            RoutingPolicy(**bad)
    with pytest.raises(ValueError):
        PrefixRouter(0)
    assert CoordinatorConfig().routing == "prefix"
    with pytest.raises(ValueError, match="routing must be one of"):
        CoordinatorConfig(routing="random")
    group = ["--group", "g0=127.0.0.1:1"]
    assert parse_config(group, env={}).routing == "prefix"
    assert parse_config(group, env={"LOCKSTEP_ROUTING": "least-loaded"}).routing == "least-loaded"
    assert parse_config([*group, "--routing", "prefix"], env={"LOCKSTEP_ROUTING": "least-loaded"}).routing == PREFIX
    with pytest.raises(SystemExit):
        parse_config(group, env={"LOCKSTEP_ROUTING": "random"})
    assert "LOCKSTEP_ROUTING must be one of prefix, least-loaded" in capsys.readouterr().err


def test_serve_forwards_the_setting_and_every_group_starts_with_a_prefix_series():
    from lockstep.serve import coordinator_settings, parse_args

    assert coordinator_settings(parse_args(["--routing", "least-loaded"], env={}))["routing"] == LEAST_LOADED
    assert coordinator_settings(parse_args([], env={"LOCKSTEP_ROUTING": "least_loaded"}))["routing"] == LEAST_LOADED
    assert coordinator_settings(parse_args([], env={}))["routing"] == PREFIX
    assert "prefix" in ROUTING_REASONS
    m = Metrics()
    m.init_group("g0", 1)
    assert 'lockstep_routing_decisions_total{group="g0",reason="prefix"} 0.0' in m.render().decode()


def test_footprints_and_matches_agree_with_a_brute_force_count_under_random_traffic():
    import random

    rng = random.Random(5)
    r = router(max_entries=40)
    groups = ["g0", "g1", "g2"]
    for _ in range(400):
        op = rng.random()
        if op < 0.05:
            r.forget(rng.choice(groups))
        elif op < 0.06:
            r.forget_all()
        else:
            r.record(keys(rng.randrange(6), rng.randint(1, 12), shared=rng.randint(0, 1)), rng.choice(groups))
        live = [(n, e) for holders in r._holders.values() for n, e in holders if r._epochs.get(n, 0) == e]
        assert len(r) <= 40
        assert {g: r.footprint(g) for g in groups} == {g: sum(n == g for n, _ in live) for g in groups}


class FakeGroup:
    """The group interface the coordinator's routing uses."""

    def __init__(self, name: str) -> None:
        self.name, self.serving, self.up, self.draining, self.down_reason = name, True, True, False, ""
        self.step = 0
        self.capacity_tokens = 0
        self.submitted: list[str] = []

    @property
    def load(self) -> int:
        return len(self.submitted)

    def counts(self) -> tuple[int, int]:
        return 0, self.load

    def cannot_hold(self, request) -> str:
        return ""

    def submit(self, request) -> None:
        self.submitted.append(request.request_id)

    def adopt(self, requests) -> None:
        self.submitted.extend(r.request_id for r in requests)

    async def flush(self, rank) -> None:
        return None


def test_the_coordinator_routes_records_counts_and_forgets_a_group_that_went_down_or_was_flushed():
    import asyncio

    from lockstep.coordinator.generation import ApiError, GenerateSpec
    from lockstep.coordinator.service import Coordinator
    from lockstep.steps import SamplingParams

    def reasons(coord: Coordinator) -> dict[tuple[str, str], float]:
        return {(g, r): coord.metrics.routing_decisions.labels(g, r)._value.get()
                for g in ("g0", "g1") for r in ("prefix", "least_loaded")}

    async def main() -> None:
        coord = Coordinator(CoordinatorConfig(), tokenizer=None, model_name="m", max_model_len=512)
        g0, g1 = coord.groups["g0"], coord.groups["g1"] = FakeGroup("g0"), FakeGroup("g1")
        for g in ("g0", "g1"):
            coord.metrics.init_group(g, 1)
        shared = list(range(3, 3 + 64))
        spec = lambda i: GenerateSpec(shared + [200 + i] * 8, SamplingParams(), 4)
        coord.generate("a", spec(0))  # new prefix: least loaded (g0, the first on a tie)
        coord.generate("b", spec(1))  # g0 holds it, busier by one: still g0
        assert (g0.submitted, g1.submitted) == (["a", "b"], [])
        assert reasons(coord)[("g0", "least_loaded")] == 1 and reasons(coord)[("g0", "prefix")] == 1
        coord._replay("g0", [], "rank 0 of group g0 is down")
        coord.generate("c", spec(2))  # g0's prefixes are forgotten: least loaded is g1
        coord.generate("d", spec(3))  # and now g1 holds it
        assert g1.submitted == ["c", "d"] and reasons(coord)[("g1", "prefix")] == 1
        await coord.reset_prefix_cache(None)
        g1.submitted.clear()
        coord.generate("e", spec(4))
        assert reasons(coord)[("g1", "least_loaded")] == 2  # flushed: least loaded, though g1 had it
        g0.serving = g1.serving = False
        with pytest.raises(ApiError, match="no group can serve now"):
            coord.generate("f", spec(5))

    asyncio.run(main())
    coord = Coordinator(CoordinatorConfig(routing="least-loaded"), tokenizer=None, model_name="m", max_model_len=64)
    assert not coord.router.wants_keys


def test_a_prefix_moved_to_another_group_is_found_there_once_recorded():
    """What the coordinator does when it moves a request (its group went down, or drained with migrate): the
    old group is forgotten and the request's tokens are recorded on the group it lands on, so the next request
    with that prefix follows it there, even to the busier group."""
    r, moved = router(), keys(1, 6)
    r.record(moved, "g0")
    r.forget("g0")
    assert r.choose(keys(1, 8), loads(g0=0, g1=1), 8 * PAGE) == Route("g0", "least_loaded", 0)
    r.record(moved, "g1")
    assert r.choose(keys(1, 8), loads(g0=0, g1=1), 8 * PAGE) == Route("g1", "prefix", 6)


@pytest.mark.parametrize(("matched", "prompt_tokens", "expected"), [
    (0, 100, 0), (4, 100, 64), (4, 65, 64), (4, 64, 48), (4, 1, 0), (2, 100, 32)])
def test_the_expected_hit_tokens_stop_short_of_the_last_prompt_token(matched, prompt_tokens, expected):
    assert Route("g0", "prefix", matched).expected_hit_tokens(prompt_tokens, PAGE) == expected


def _two_fake_groups(coord) -> tuple[FakeGroup, FakeGroup]:
    g0, g1 = coord.groups["g0"], coord.groups["g1"] = FakeGroup("g0"), FakeGroup("g1")
    for g in ("g0", "g1"):
        coord.metrics.init_group(g, 1)
    return g0, g1


def test_a_request_moved_by_the_coordinator_takes_its_prefix_to_the_group_it_lands_on():
    import asyncio

    from lockstep.coordinator.generation import GenerateSpec
    from lockstep.coordinator.service import Coordinator
    from lockstep.steps import SamplingParams

    async def main() -> None:
        coord = Coordinator(CoordinatorConfig(), tokenizer=None, model_name="m", max_model_len=512)
        g0, g1 = _two_fake_groups(coord)
        shared = list(range(3, 3 + 64))
        coord.generate("a", GenerateSpec(shared + [200] * 8, SamplingParams(), 40))
        moving = coord.live["a"].request
        moving.generated.extend(range(500, 532))  # 32 tokens generated before its group went down
        g0.serving, g0.submitted = False, []
        coord._replay("g0", [moving], "rank 0 of group g0 is down")
        assert (coord.live["a"].group, g1.submitted) == ("g1", ["a"])
        g0.serving = True  # g0 is back and idle, g1 the busier: the prefix still goes where it moved
        follow_up = list(moving.token_ids()) + [300] * 8  # a next turn: the prompt, the answer, more
        pages = len(moving.token_ids()) // 16  # its answer's pages too: the new group recomputes them all
        assert coord.router.matches(coord._routing_keys(follow_up), {"g0", "g1"}) == {"g1": (pages, 0)}
        coord.generate("b", GenerateSpec(follow_up, SamplingParams(), 4))
        assert g1.submitted == ["a", "b"] and g0.submitted == []
        assert coord.metrics.routing_decisions.labels("g1", "prefix")._value.get() == 1

    asyncio.run(main())


def test_expected_against_agreed_hit_tokens_show_a_prefix_the_group_lost_behind_the_coordinators_back():
    """Routing expects a prefix's pages where it sent them; at a request's first token the tokens its group's
    ranks agreed to skip are counted against that. A group whose ranks dropped the prefix without the
    coordinator knowing (their own eviction, a flush it did not ask for) shows expected > agreed."""
    import asyncio

    from lockstep.coordinator.events import Event, EventKind
    from lockstep.coordinator.generation import GenerateSpec
    from lockstep.coordinator.service import Coordinator
    from lockstep.steps import SamplingParams

    def totals(coord: Coordinator) -> tuple[float, float]:
        m = coord.metrics
        return (m.routing_expected_hit_tokens.labels("g0")._value.get(),
                m.routing_agreed_hit_tokens.labels("g0")._value.get())

    def first_token(coord: Coordinator, rid: str, agreed: int) -> None:
        coord.live[rid].request.cached_tokens = agreed  # what the scheduler sets at the first admission
        coord._dispatch("g0", [Event(rid, EventKind.TOKEN, token_id=5)])
        coord._dispatch("g0", [Event(rid, EventKind.TOKEN, token_id=6)])  # only the first token settles

    async def main() -> None:
        coord = Coordinator(CoordinatorConfig(), tokenizer=None, model_name="m", max_model_len=512)
        _two_fake_groups(coord)
        shared = list(range(3, 3 + 64))
        spec = lambda i: GenerateSpec(shared + [200 + i] * 8, SamplingParams(), 4)
        coord.generate("a", spec(0))  # a new prefix: nothing expected
        first_token(coord, "a", 0)
        assert totals(coord) == (0, 0)
        coord.generate("b", spec(1))  # routed for its prefix: 4 pages expected
        first_token(coord, "b", 64)  # and the ranks agreed on them all
        assert totals(coord) == (64, 64)
        coord.generate("c", spec(2))  # the ranks evicted the prefix, the map still says g0 holds it
        first_token(coord, "c", 0)
        assert totals(coord) == (128, 64)  # expected > agreed: the map is stale
        coord.generate("d", spec(3))
        first_token(coord, "d", 80)  # more than expected (another request's pages): counted up to expected
        assert totals(coord) == (192, 128)

    asyncio.run(main())


def test_health_is_ready_while_some_group_is_up_and_says_per_group_why_not():
    """With one group down the coordinator still serves (200), and /health says which group is down and why;
    a drained group is up but takes nothing new (`serving` false); with no group up it is not ready (503)."""
    from lockstep.coordinator.service import Coordinator

    coord = Coordinator(CoordinatorConfig(), tokenizer=None, model_name="m", max_model_len=64)
    g0, g1 = _two_fake_groups(coord)
    g1.up = g1.serving = False
    g1.down_reason = "rank 1 of group g1 is down; now: waiting for rank 1 at 10.0.0.7:50051"
    assert coord.healthy()
    assert coord.health_detail() == {
        "g0": {"up": True, "reason": "", "step": 0, "draining": False, "serving": True, "requests_in_flight": 0},
        "g1": {"up": False, "reason": g1.down_reason, "step": 0, "draining": False, "serving": False,
               "requests_in_flight": 0}}
    g0.draining, g0.serving = True, False
    assert coord.healthy() and coord.health_detail()["g0"] | {"draining": True, "serving": False} == \
        coord.health_detail()["g0"]
    g0.up = False
    assert not coord.healthy()
