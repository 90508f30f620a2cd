"""Which group serves a new request: prefix-aware routing weighed against load (pure: no I/O, no asyncio).

Groups never share a KV cache, so a request whose prompt starts with pages a group computed recently is
cheaper there: its ranks agree on a longer prefix and skip that prefill. Probing every group for every
request costs a round trip per group, so the coordinator keeps, like SGLang's cache-aware router and
vLLM's production-stack router, its own approximate picture instead: a bounded LRU map from page key to
the groups it last routed that page to. The page keys are the coordinator's hash chain (kv/page_keys.py),
so one key names a whole prefix: the deepest key of a prompt found in the map is the longest prefix a
group was sent. The picture is approximate (a rank's own LRU may have evicted the page since); being
wrong costs one recomputed prefix, never a wrong answer, because the group's ranks still agree on what
they really hold.

Defaults, and why:
- balance: a group counts as overloaded when its load (waiting + running) exceeds the least-loaded
  group's by more than `balance_abs` requests AND by more than `balance_rel` times. That is SGLang's
  rule (its defaults 64 and 1.5); 16 here because a group runs at most 64 requests by default
  (`--max-num-seqs`), so a quarter of a group's seats of imbalance is where queueing starts to cost more
  than recomputing a prefix. A hot prefix therefore fills its group up to the threshold, then spills to
  the next group, which then holds it too, and both share it by load from then on.
- `min_match_ratio` 0.3 (SGLang's cache threshold): a match shorter than 30% of the prompt saves too
  little prefill to concentrate load for, and a short common header must not steer traffic.
- `max_entries` 65536 keys (about 1M prompt tokens at 16 per page, 18 MB measured): more than a few groups'
  KV pools hold, so the map forgets a prefix about when the groups' caches would have evicted it.
- `max_pages` 512: at most the first 8k tokens of a prompt are hashed for routing, bounding the
  coordinator's work per request while covering long system prompts and multi-turn histories.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PREFIX = "prefix"
LEAST_LOADED = "least-loaded"
POLICIES = (PREFIX, LEAST_LOADED)
REASON_PREFIX = "prefix"  # the group was sent this prompt's longest known prefix, and is not overloaded
REASON_LEAST_LOADED = "least_loaded"  # no useful prefix match (or the policy is least-loaded): least load
MAX_HOLDERS = 8  # groups remembered per page key, most recent first


def parse_policy(text: str) -> str:
    """`prefix` or `least-loaded` (also `least_loaded`, any case): the --routing / LOCKSTEP_ROUTING value."""
    word = text.strip().lower().replace("_", "-")
    if word not in POLICIES:
        raise ValueError(f"must be one of {', '.join(POLICIES)}")
    return word


@dataclass(frozen=True)
class GroupLoad:
    """What routing needs of one group: its load, whether it takes new requests, and its largest request."""

    name: str
    load: int  # waiting + running requests
    serving: bool = True  # up and not draining
    capacity_tokens: int = 0  # positions the group's smallest pool holds (0: no limit known)


@dataclass(frozen=True)
class RoutingPolicy:
    """The routing settings; see the module docstring for why the defaults are what they are."""

    policy: str = PREFIX
    balance_abs: int = 16
    balance_rel: float = 1.5
    min_match_ratio: float = 0.3
    max_entries: int = 1 << 16
    max_pages: int = 512

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {self.policy!r}")
        if self.balance_abs < 0 or self.balance_rel < 1 or not 0 <= self.min_match_ratio <= 1:
            raise ValueError("balance_abs must be >= 0, balance_rel >= 1 and min_match_ratio in [0, 1]")
        if self.max_entries < 1 or self.max_pages < 1:
            raise ValueError("max_entries and max_pages must be >= 1")

    def overloaded(self, load: int, least: int) -> bool:
        """Too busy next to the least-loaded group to be worth its cached prefix (both margins, as SGLang)."""
        return load - least > self.balance_abs and load > least * self.balance_rel


@dataclass(frozen=True)
class Route:
    """A routing decision: the group, why (a `lockstep_routing_decisions_total` reason), the pages it matched."""

    group: str
    reason: str
    matched_pages: int = 0

    def expected_hit_tokens(self, prompt_tokens: int, page_size: int) -> int:
        """Prompt tokens the map says the group can skip: its matched pages, short of the last prompt token
        (a group always computes that one, so a page-aligned prompt never skips its last page). The group's
        agreement later says how many it really skipped; fewer means the map is stale
        (`lockstep_routing_expected_hit_tokens_total` against `lockstep_routing_agreed_hit_tokens_total`)."""
        return min(self.matched_pages, max(0, prompt_tokens - 1) // page_size) * page_size


class PrefixRouter:
    """The coordinator's map of which group it sent which prefix, and the decision that reads it.

    Forgetting a group (it went down, or its cache was flushed) is O(1): each group has an epoch, and an
    entry recorded under an older epoch no longer counts (the LRU bound pushes it out in time).
    """

    def __init__(self, page_size: int, policy: RoutingPolicy | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.policy = policy or RoutingPolicy()
        self._holders: OrderedDict[bytes, tuple[tuple[str, int], ...]] = OrderedDict()
        self._epochs: dict[str, int] = {}
        self._footprint: dict[str, int] = {}  # per group: live entries that name it

    def __len__(self) -> int:
        return len(self._holders)

    @property
    def wants_keys(self) -> bool:
        """Whether `choose` reads page keys at all (the least-loaded policy does not: skip hashing)."""
        return self.policy.policy == PREFIX

    def footprint(self, group: str) -> int:
        """Page keys the map says the group holds: among equally loaded groups a new prefix goes to the
        smallest, so that prefixes spread over the groups' caches (SGLang's "smallest tree")."""
        return self._footprint.get(group, 0)

    def matches(self, keys: Sequence[bytes], names: set[str] | None = None) -> dict[str, tuple[int, int]]:
        """Per group: (pages of the longest prefix of `keys` last sent to it, recency rank: 0 is the most
        recent holder of that page). The deepest key wins, since a key names its whole prefix."""
        found: dict[str, tuple[int, int]] = {}
        for i in range(min(len(keys), self.policy.max_pages) - 1, -1, -1):
            for rank, (name, epoch) in enumerate(self._holders.get(keys[i], ())):
                if name not in found and self._epochs.get(name, 0) == epoch and (names is None or name in names):
                    found[name] = (i + 1, rank)
            if names is not None and len(found) == len(names):
                break
        return found

    def choose(self, keys: Sequence[bytes], groups: Sequence[GroupLoad], prompt_tokens: int,
               need_tokens: int = 0) -> Route | None:
        """The group for a request with these page keys; None when no group is serving.

        Groups that can never hold `need_tokens` positions are passed over while another can. Among the
        groups not overloaded next to the least-loaded one, the longest known prefix wins (ties: the
        less loaded, then the more recent); a match under `min_match_ratio` of the prompt, or a choice
        of one, is least-loaded routing: ties in load go to the smallest footprint (a new prefix spreads
        over the groups' caches, even when they are idle), then keep the order of `groups`.
        """
        serving = [g for g in groups if g.serving]
        fitting = [g for g in serving if not g.capacity_tokens or need_tokens <= g.capacity_tokens] or serving
        if not fitting:
            return None
        if self.policy.policy != PREFIX or len(fitting) == 1:
            return Route(min(fitting, key=lambda g: g.load).name, REASON_LEAST_LOADED)
        least = min(fitting, key=lambda g: (g.load, self.footprint(g.name)))
        found = self.matches(keys, {g.name for g in fitting})
        eligible = [g for g in fitting if g.name in found and not self.policy.overloaded(g.load, least.load)]
        if eligible:
            best = max(eligible, key=lambda g: (found[g.name][0], -g.load, -found[g.name][1]))
            pages = found[best.name][0]
            if pages * self.page_size >= self.policy.min_match_ratio * prompt_tokens:
                return Route(best.name, REASON_PREFIX, pages)
        return Route(least.name, REASON_LEAST_LOADED, found.get(least.name, (0, 0))[0])

    def record(self, keys: Sequence[bytes], group: str) -> None:
        """The coordinator sent a request with these page keys to `group`: its ranks will hold them.

        Deepest keys are touched first, so a prefix's shallower pages (shared by more requests) are the
        more recent in the LRU and are evicted last."""
        epoch = self._epochs.get(group, 0)
        for key in reversed(keys[: self.policy.max_pages]):
            live = [h for h in self._holders.pop(key, ()) if self._live(h)]
            others = [h for h in live if h[0] != group]
            if len(others) == len(live):
                self._footprint[group] = self._footprint.get(group, 0) + 1
            self._drop(others[MAX_HOLDERS - 1 :])
            self._holders[key] = ((group, epoch), *others[: MAX_HOLDERS - 1])
        while len(self._holders) > self.policy.max_entries:
            self._drop(h for h in self._holders.popitem(last=False)[1] if self._live(h))

    def _live(self, holder: tuple[str, int]) -> bool:
        return self._epochs.get(holder[0], 0) == holder[1]

    def _drop(self, holders: Iterable[tuple[str, int]]) -> None:
        for name, _ in holders:
            self._footprint[name] -= 1

    def forget(self, group: str) -> None:
        """The group's caches are gone or untrusted (it went down, or was flushed): nothing it held counts."""
        self._epochs[group] = self._epochs.get(group, 0) + 1
        self._footprint[group] = 0

    def forget_all(self) -> None:
        self._holders.clear()
        self._footprint.clear()
