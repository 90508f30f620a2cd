"""The coordinator's Prometheus metrics: every name DESIGN.md pins, and nothing the dashboards do not use.

Each coordinator process owns one registry (not the global one), so tests can run several
coordinators in one process and `/metrics` shows only this coordinator's series.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Iterable, Sequence
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from lockstep.coordinator.admission import DEFERRAL_REASONS
from lockstep.coordinator.scheduler import SchedulerStats
from lockstep.steps import PoolState

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# a new request by load; a request moved off a group that went down; a new request to the group last sent
# its prefix (coordinator/routing.py)
ROUTING_REASONS = ("least_loaded", "replay", "prefix")
rebalance_log = logging.getLogger("lockstep.rebalance")
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


REJECTION_REASONS = ("server_overloaded", "group_unavailable", "request_too_large", "request_id_in_use",
                     "frontend_unlinked")


class _Series:
    """One group's histogram: per-bucket (not cumulative) counts, the sum, and when the series was created."""

    __slots__ = ("counts", "sum", "created")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.sum = 0.0
        self.created = time.time()


class GroupHistogram(Collector):
    """A histogram labelled by `group` alone that takes many equal observations in one call.

    prometheus_client's Histogram takes one value per call (~6 us under profile, a lock and a bucket scan);
    at batch 256 a decode step observes 256 inter-token gaps, nearly all equal. Its /metrics text is the
    Histogram's own: the same `_bucket`/`_count`/`_sum` series, and `_created` where the client emits it.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = (*(float(b) for b in buckets), math.inf)
        self._le = tuple(floatToGoString(b) for b in self._bounds)
        self._series: dict[str, _Series] = {}
        self._lock = threading.Lock()  # as the client's metrics: /metrics may be read from another thread
        registry.register(self)

    def add_group(self, group: str) -> None:
        """Export the group's series (at zero until observed); one that exists keeps its counts."""
        with self._lock:
            self._series.setdefault(group, _Series(len(self._bounds)))

    def observe(self, group: str, value: float, count: int = 1) -> None:
        """`count` observations of `value` (a value on a bucket's bound falls in that bucket, as `le` says)."""
        i = bisect_left(self._bounds, value)
        with self._lock:
            series = self._series.get(group)
            if series is None:
                series = self._series[group] = _Series(len(self._bounds))
            series.counts[i] += count
            series.sum += value * count

    def remove(self, group: str) -> None:
        with self._lock:
            self._series.pop(group, None)

    def describe(self) -> Iterable[Metric]:
        """The family without samples, so the registry refuses another metric of the same name."""
        return [HistogramMetricFamily(self._name, self._documentation, labels=["group"])]

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=["group"])
        created = getattr(prometheus_metrics, "_use_created", True)  # what the client's own Histogram reads
        with self._lock:
            snapshot = [(group, list(s.counts), s.sum, s.created) for group, s in self._series.items()]
        for group, counts, total, at in snapshot:
            acc, buckets = 0.0, []
            for le, n in zip(self._le, counts, strict=True):
                acc += n
                buckets.append((le, acc))
            family.add_metric([group], buckets, total)
            if created:
                family.add_sample(self._name + "_created", {"group": group}, at)
        return [family]


class Metrics:
    def __init__(self) -> None:
        self._exported: dict[str, SchedulerStats] = {}  # per group: the totals already counted
        r = self.registry = CollectorRegistry()
        self.agreement_wait = Histogram(
            "lockstep_agreement_wait_seconds", "Time waiting for every rank's answer",
            ["group", "kind"], buckets=WAIT_BUCKETS, registry=r,
        )
        self.agreements_stalled = Gauge(
            "lockstep_agreements_stalled", "Agreement waits now longer than the stall threshold",
            ["group"], registry=r,
        )
        self.agreement_stalls = Counter(
            "lockstep_agreement_stalls_total", "Agreement waits that passed the stall threshold",
            ["group"], registry=r,
        )
        self.rank_pages = Gauge(
            "lockstep_rank_pages", "KV pages per rank and pool by state", ["group", "rank", "pool", "state"],
            registry=r,
        )
        self.rank_pool_pages = Gauge(
            "lockstep_rank_pool_pages", "KV pages a rank's pool holds in all (its share of the split)",
            ["group", "rank", "pool"], registry=r,
        )
        self.free_page_skew = Gauge(
            "lockstep_free_page_skew_pages", "Max minus min free pages over the ranks of a group",
            ["group", "pool"], registry=r,
        )
        self.prefix_offered = Counter(
            "lockstep_prefix_offered_pages_total", "Cached prefix pages a rank said it holds when probed",
            ["group", "rank"], registry=r,
        )
        self.prefix_agreed = Counter(
            "lockstep_prefix_agreed_pages_total", "Prefix pages the group agreed to skip", ["group"], registry=r,
        )
        self.admission_deferred = Counter(
            "lockstep_admission_deferred_total", "Requests not admitted at a step, by reason",
            ["group", "reason"], registry=r,
        )
        self.preemptions = Counter(
            "lockstep_preemptions_total", "Running requests released for recompute", ["group"], registry=r,
        )
        self.requests = Gauge("lockstep_requests", "Requests by state", ["group", "state"], registry=r)
        self.ttft = Histogram(
            "lockstep_time_to_first_token_seconds", "Time to first token", ["group"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.itl = GroupHistogram(
            "lockstep_inter_token_latency_seconds", "Time between two tokens of a request", LATENCY_BUCKETS, r,
        )
        self.request_duration = Histogram(
            "lockstep_request_duration_seconds", "Time from arrival to the last token", ["group"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter(
            "lockstep_prompt_tokens_total", "Prompt tokens of finished requests", ["group"], registry=r,
        )
        self.generation_tokens = Counter(
            "lockstep_generation_tokens_total", "Generated tokens", ["group"], registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "lockstep_prefix_cache_hit_tokens_total", "Prompt tokens skipped thanks to the prefix cache",
            ["group"], registry=r,
        )
        self.prefix_queried_tokens = Counter(  # counted where the hits are: hits / queried is the hit rate
            "lockstep_prefix_cache_queried_tokens_total", "Tokens of the requests admitted (a preempted one's "
            "again), the prefix cache hit rate's denominator", ["group"], registry=r,
        )
        self.step_duration = Histogram(
            "lockstep_step_duration_seconds", "Wall time of one step of a group", ["group"],
            buckets=WAIT_BUCKETS, registry=r,
        )
        self.coordinator_seconds = Counter(
            "lockstep_coordinator_seconds_total", "The step loop's own time (planning, sending, applying reports): "
            "`hidden` while the ranks ran a plan sent ahead (overlap scheduling), `exposed` while none ran",
            ["group", "part"], registry=r,
        )
        self._add_group_lifecycle(r)

    def _add_group_lifecycle(self, r: CollectorRegistry) -> None:
        """The series of groups coming and going, rebalancing and handing requests on (split off only to keep
        the constructor readable)."""
        self.rank_up = Gauge("lockstep_rank_up", "1 while a rank's stream is up", ["group", "rank"], registry=r)
        self.rebalances = Counter(
            "lockstep_rebalances_total", "KV pool rebalances every rank of the group carried out, since the "
            "group last came up", ["group"], registry=r,
        )
        self.requests_migrated = Counter(
            "lockstep_requests_migrated_total", "Running requests moved from this group to another", ["group"],
            registry=r,
        )
        self.requests_dropped = Counter(
            "lockstep_requests_dropped_total", "Accepted requests ended with an error because their group went "
            "down and none could take them (should stay 0)", ["group"], registry=r,
        )
        self.requests_rejected = Counter(
            "lockstep_requests_rejected_total", "Requests the coordinator refused before queueing them, by the "
            "error code the client got (server_overloaded: past --max-waiting-requests; group_unavailable: no "
            "group could serve; request_too_large; request_id_in_use; frontend_unlinked: an API frontend's link "
            "was not open)", ["reason"], registry=r,
        )
        for reason in REJECTION_REASONS:
            self.requests_rejected.labels(reason)
        self.routing_decisions = Counter(
            "lockstep_routing_decisions_total", "Requests routed to this group, by why it was chosen",
            ["group", "reason"], registry=r,
        )
        self.routing_expected_hit_tokens = Counter(
            "lockstep_routing_expected_hit_tokens_total", "Prompt tokens routing expected this group to skip, "
            "from the prefixes it sent there (counted at each routed request's first token)", ["group"], registry=r,
        )
        self.routing_agreed_hit_tokens = Counter(
            "lockstep_routing_agreed_hit_tokens_total", "Of the expected hit tokens, those the group's ranks agreed "
            "to skip; below the expected ones, the routing map is stale", ["group"], registry=r,
        )

    def init_group(self, group: str, ranks: int) -> None:
        """Create every series of a group at zero, so dashboards and alerts see it before traffic."""
        for kind in ("step", "prefix", "rebalance"):
            self.agreement_wait.labels(group, kind)
        self.agreements_stalled.labels(group).set(0)
        self.agreement_stalls.labels(group)
        self.prefix_agreed.labels(group)
        for reason in DEFERRAL_REASONS:
            self.admission_deferred.labels(group, reason)
        self.preemptions.labels(group)
        for part in ("hidden", "exposed"):
            self.coordinator_seconds.labels(group, part)
        for state in ("waiting", "running"):
            self.requests.labels(group, state).set(0)
        for hist in (self.ttft, self.request_duration, self.step_duration):
            hist.labels(group)
        self.itl.add_group(group)
        for counter in (self.prompt_tokens, self.generation_tokens, self.prefix_hit_tokens, self.prefix_queried_tokens,
                        self.rebalances, self.requests_migrated, self.requests_dropped,
                        self.routing_expected_hit_tokens, self.routing_agreed_hit_tokens):
            counter.labels(group)
        for reason in ROUTING_REASONS:
            self.routing_decisions.labels(group, reason)
        for rank in range(ranks):
            self.rank_up.labels(group, str(rank)).set(0)
            self.prefix_offered.labels(group, str(rank))

    def observe_pools(self, group: str, pools_by_rank: dict[int, list[PoolState]]) -> None:
        """Every rank's pages by state, and its pool totals: after a rebalance these must be equal on all
        ranks of the group (LockstepPoolTotalsDiverged watches that)."""
        free_by_pool: dict[str, list[int]] = {}
        for rank, pools in pools_by_rank.items():
            for p in pools:
                self.rank_pool_pages.labels(group, str(rank), p.pool).set(p.total)
                for state, value in (("free", p.free), ("evictable", p.evictable), ("used", p.used),
                                     ("fenced", p.fenced)):
                    self.rank_pages.labels(group, str(rank), p.pool, state).set(value)
                free_by_pool.setdefault(p.pool, []).append(p.free)
        for pool, frees in free_by_pool.items():
            self.free_page_skew.labels(group, pool).set(max(frees) - min(frees))

    def observe_rebalance(self, group: str, before: dict[str, int], after: dict[str, int], reason: str) -> None:
        """A rebalance every rank of the group carried out: counted, and logged with the old and new split
        and why, so that an operator can tie a change in admissions or preemptions to it."""
        self.rebalances.labels(group).inc()
        pools = sorted(before.keys() | after.keys())
        split = lambda s: " ".join(f"{pool}={s[pool]}" if pool in s else f"{pool}=-" for pool in pools)
        rebalance_log.info("group %s: rebalanced the KV pools from %s to %s pages per rank (%s)",
                           group, split(before), split(after), reason)

    def forget_scheduler(self, group: str) -> None:
        """A new scheduler for the group starts its totals at zero. The group's rebalance count restarts too
        (a counter reset, which rate() and increase() take in their stride): its ranks came up with their
        own pool sizes, which may differ until the group rebalances again, so LockstepPoolTotalsDiverged
        must not read an earlier life's rebalance as a promise of equal totals."""
        self._exported.pop(group, None)
        self.rebalances.remove(group)
        self.rebalances.labels(group)

    def export_scheduler_stats(self, group: str, stats: SchedulerStats) -> None:
        """The scheduler keeps running totals; the Prometheus counters take what is new since the last call."""
        last = self._exported.get(group) or SchedulerStats(prefix_offered_pages=[0] * len(stats.prefix_offered_pages))
        self.preemptions.labels(group).inc(stats.preemptions - last.preemptions)
        self.prefix_agreed.labels(group).inc(stats.prefix_agreed_pages - last.prefix_agreed_pages)
        self.prefix_hit_tokens.labels(group).inc(stats.prefix_hit_tokens - last.prefix_hit_tokens)
        self.prefix_queried_tokens.labels(group).inc(stats.prefix_queried_tokens - last.prefix_queried_tokens)
        for rank, (now, before) in enumerate(zip(stats.prefix_offered_pages, last.prefix_offered_pages, strict=True)):
            self.prefix_offered.labels(group, str(rank)).inc(now - before)
        for reason, n in stats.deferred.items():
            self.admission_deferred.labels(group, reason).inc(n - last.deferred[reason])
        self._exported[group] = replace(stats, deferred=Tally(stats.deferred),
                                        prefix_offered_pages=list(stats.prefix_offered_pages))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def forget_group_series(metrics: Metrics, group: str) -> None:
    """Drop every series labelled with a removed group, so /metrics and the dashboards stop showing it (its
    counters' history stays in Prometheus). A histogram's `le` label is not one of its label values."""
    for metric in vars(metrics).values():
        if not isinstance(metric, (prometheus_metrics.MetricWrapperBase, GroupHistogram)):
            continue
        seen: set[tuple[str, ...]] = set()
        for family in metric.collect():
            for sample in family.samples:
                if sample.labels.get("group") == group:
                    seen.add(tuple(v for k, v in sample.labels.items() if k != "le"))
        for values in seen:
            metric.remove(*values)
