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
