"""What a rebalance shows on /metrics and in the log: every rank's pool totals, the count per group, the
`rebalance` agreement wait, one log line with the old and new split and why (DESIGN.md: pinned metrics)."""

from __future__ import annotations

import logging

from prometheus_client.parser import text_string_to_metric_families

from lockstep.coordinator.metrics import Metrics
from lockstep.steps import PoolState


def pools(full: int, sliding: int, free: int = 0) -> list[PoolState]:
    return [PoolState("full", full, free, 0, full - free), PoolState("sliding", sliding, free, 0, sliding - free)]


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_pool_totals_per_rank_follow_the_reports():
    """Ranks may start apart (rank 1 has less memory); after a rebalance both report the same split."""
    m = Metrics()
    m.init_group("g0", 2)
    m.observe_pools("g0", {0: pools(100, 60, free=10), 1: pools(80, 40, free=10)})
    got = {(r, p): sample(m, "lockstep_rank_pool_pages", group="g0", rank=r, pool=p)
           for r in ("0", "1") for p in ("full", "sliding")}
    assert got == {("0", "full"): 100, ("0", "sliding"): 60, ("1", "full"): 80, ("1", "sliding"): 40}
    m.observe_pools("g0", {0: pools(90, 70), 1: pools(90, 70)})
    assert {sample(m, "lockstep_rank_pool_pages", group="g0", rank=r, pool="sliding") for r in "01"} == {70}
    assert sample(m, "lockstep_rank_pages", group="g0", rank="1", pool="full", state="used") == 90


def test_a_group_exports_the_rebalance_series_before_any_rebalance():
    """Dashboards and LockstepPoolTotalsDiverged read these from the start, at zero."""
    m = Metrics()
    m.init_group("g0", 2)
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert sample(m, "lockstep_rebalances_total", group="g0") == 0
    assert sample(m, "lockstep_agreement_wait_seconds_count", group="g0", kind="rebalance") == 0
    assert sample(m, "lockstep_agreement_wait_seconds_sum", group="g0", kind="rebalance") == 0
    assert families["lockstep_rank_pool_pages"].type == "gauge"


def test_observe_rebalance_counts_and_logs_the_old_and_new_split(caplog):
    m = Metrics()
    m.init_group("g0", 2)
    m.init_group("g1", 2)
    with caplog.at_level(logging.INFO, logger="lockstep.rebalance"):
        m.observe_rebalance("g0", {"full": 120, "sliding": 40}, {"full": 80, "sliding": 100},
                            "sliding pool 2.5x under its target")
    assert sample(m, "lockstep_rebalances_total", group="g0") == 1
    assert sample(m, "lockstep_rebalances_total", group="g1") == 0  # groups decide, and count, on their own
    [record] = [r for r in caplog.records if r.name == "lockstep.rebalance"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == ("group g0: rebalanced the KV pools from full=120 sliding=40 to "
                                   "full=80 sliding=100 pages per rank (sliding pool 2.5x under its target)")


def test_a_pool_on_one_side_only_still_logs():
    m = Metrics()
    m.init_group("g0", 1)
    m.observe_rebalance("g0", {"full": 10}, {"full": 6, "sliding": 4}, "test")
    assert sample(m, "lockstep_rebalances_total", group="g0") == 1


def test_a_group_that_comes_up_again_restarts_its_rebalance_count():
    """Its new ranks start from their own pool sizes, which may differ until it rebalances again: the count
    restarting is what keeps LockstepPoolTotalsDiverged quiet in between."""
    m = Metrics()
    m.init_group("g0", 2)
    m.observe_rebalance("g0", {"full": 10}, {"full": 12}, "test")
    m.observe_rebalance("g0", {"full": 12}, {"full": 14}, "test")
    assert sample(m, "lockstep_rebalances_total", group="g0") == 2
    m.forget_scheduler("g0")
    assert sample(m, "lockstep_rebalances_total", group="g0") == 0  # the series stays, at zero
    m.forget_scheduler("g9")  # a group never seen: nothing to restart, no error
    assert sample(m, "lockstep_rebalances_total", group="g9") == 0
