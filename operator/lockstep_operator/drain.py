"""Draining a group through the coordinator before it is rolled, recreated or removed: pure decisions.

The coordinator's `POST /admin/drain?group=G` stops routing to G and answers 200 once G holds nothing
(with `migrate=true` its requests move to other groups at a step boundary). It has no deadline of its
own and the flag survives a group's recreation, so the operator owns both: it asks, waits at most
`spec.rollout.drainTimeoutSeconds`, goes on anyway when the deadline passes or the coordinator cannot
be reached (it may be the thing being rolled), and asks `POST /admin/resume?group=G` once a group that
comes back serves again. Everything here is a function of plain data and a clock value (seconds), so
every branch is tested without a cluster or a coordinator; `coordinator_client.py` is the HTTP edge and
`handlers.py` carries the answers out.
"""

from __future__ import annotations

import datetime
import enum
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from lockstep_operator import manifests as m

# Connection failures in a row after which the operator goes on without the coordinator.
MAX_UNREACHABLE = 3
# Why a drain is asked (shown in events and the Draining condition).
ROLL, RECREATE, REMOVE = "roll", "recreate", "remove"


class Answer(enum.Enum):
    """What one `POST /admin/drain` (or resume) came back with."""

    DONE = "done"  # 200: the group holds nothing (resume: routed to again)
    PENDING = "pending"  # our wait ran out first: the coordinator still drains it
    UNREACHABLE = "unreachable"  # no connection, or a 5xx: worth a short retry
    REFUSED = "refused"  # a 4xx (no such group, a wrong API key): asking again will not help


@dataclass(frozen=True)
class Drain:
    """A drain the operator asked of the coordinator, and what it heard so far."""

    group: str  # the coordinator's name of the group (`g<i>`, as in LOCKSTEP_GROUPS)
    why: str  # ROLL, RECREATE or REMOVE
    migrate: bool  # other groups serve, so the coordinator may move the requests there
    started: float  # clock seconds when it was first asked
    deadline: float  # started + drainTimeoutSeconds
    finished: bool = False  # the coordinator answered 200
    failures: int = 0  # connection failures in a row
    refused: str = ""  # the coordinator's 4xx answer, if it refused
    error: str = ""  # the last failure, for the logs and the condition message

    @property
    def resolved(self) -> bool:
        """Nothing more to ask the coordinator: finished, refused or given up on."""
        return self.finished or bool(self.refused) or self.failures >= MAX_UNREACHABLE


@dataclass(frozen=True)
class DrainStep:
    """What the operator does next about one group: START a drain, WAIT for it, or PROCEED."""

    action: str  # "start", "wait" or "proceed"
    reason: str  # the Draining condition's reason (and the event's) that goes with it
    message: str = ""

    @property
    def proceed(self) -> bool:
        return self.action == "proceed"


START, WAIT, PROCEED = "start", "wait", "proceed"


def new_drain(group: str, why: str, migrate: bool, now: float, timeout_s: float) -> Drain:
    """The record of a drain asked now."""
    return Drain(group=group, why=why, migrate=migrate, started=now, deadline=now + timeout_s)


def decide_drain(record: Drain | None, timeout_s: float, now: float, holds_work: bool = True) -> DrainStep:
    """Whether a group may be rolled, recreated or removed now, or its drain must start or be waited for.

    Never blocks for ever: a drain ends when the coordinator says the group holds nothing, refuses, cannot
    be reached MAX_UNREACHABLE times in a row, or its deadline passes; each of those goes on.
    """
    if timeout_s <= 0:
        return DrainStep(PROCEED, "DrainDisabled", "spec.rollout.drainTimeoutSeconds is 0: no drain")
    if record is None:
        if not holds_work:
            return DrainStep(PROCEED, "NothingToDrain", "no rank of the group is ready: it serves nothing")
        return DrainStep(START, "DrainStarted")
    if record.finished:
        return DrainStep(PROCEED, "Drained", f"group {record.group} drained in {max(0.0, now - record.started):.1f}s")
    if record.refused:
        return DrainStep(PROCEED, "DrainRefused", f"the coordinator refused to drain {record.group}: {record.refused}")
    if record.failures >= MAX_UNREACHABLE:
        return DrainStep(PROCEED, "CoordinatorUnreachable",
                         f"the coordinator could not be reached to drain {record.group} ({record.error}); "
                         "going on without a drain")
    if now >= record.deadline:
        return DrainStep(PROCEED, "DrainTimedOut",
                         f"group {record.group} still held requests after {record.deadline - record.started:g}s; "
                         "going on anyway")
    return DrainStep(WAIT, "DrainInProgress", f"waiting up to {record.deadline - now:.0f}s more for {record.group}")


def poll_timeout(record: Drain, now: float, longest: float) -> float | None:
    """How long the next `POST /admin/drain` may wait for its answer; None when nothing is to be asked."""
    if record.resolved or now >= record.deadline:
        return None
    return max(0.05, min(longest, record.deadline - now))


def after_answer(record: Drain, answer: Answer, detail: str = "") -> Drain:
    """The record once one drain request came back."""
    if answer is Answer.DONE:
        return replace(record, finished=True, failures=0, error="")
    if answer is Answer.REFUSED:
        return replace(record, refused=detail or "refused")
    if answer is Answer.UNREACHABLE:
        return replace(record, failures=record.failures + 1, error=detail)
    return replace(record, failures=0, error="")  # PENDING: reachable, still draining


def coordinator_group(index: int) -> str:
    """The coordinator's name of group `index`: the one `manifests.groups_configmap` lists it under."""
    return f"g{index}"


def others_serve(serving: Mapping[str, bool], leaving: str) -> bool:
    """Whether some other group serves and can take `leaving`'s requests (then the drain migrates them)."""
    return any(up for name, up in serving.items() if name != leaving)


def coordinator_url(name: str, namespace: str, spec: Mapping[str, Any], override: str = "") -> str:
    """The coordinator Service's HTTP root; `override` (LOCKSTEP_OPERATOR_COORDINATOR_URL, tests) may name
    `{name}`, `{namespace}` and `{port}`."""
    port = spec["coordinator"]["httpPort"]
    if override:
        return override.format(name=name, namespace=namespace, port=port).rstrip("/")
    return m.endpoint(name, namespace, dict(spec))


def api_key(spec: Mapping[str, Any], operator_key: str = "") -> str:
    """The Bearer key for the coordinator's /admin routes: the deployment's own LOCKSTEP_API_KEY when its
    spec.env sets one by value (the first of a comma-separated list), else the operator's own key (the
    chart's `operator.coordinatorApiKeySecret`: the operator never reads Secrets), else none."""
    for var in spec.get("env", []):
        if var.get("name") == "LOCKSTEP_API_KEY" and var.get("value"):
            return str(var["value"]).split(",")[0].strip()
    return operator_key


_STALLED = re.compile(r'^lockstep_agreements_stalled\{[^}]*group="([^"]*)"[^}]*\} (\S+)$')


def stalled_groups(metrics_text: str) -> dict[str, float]:
    """`lockstep_agreements_stalled` per group, from the coordinator's /metrics text."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = _STALLED.match(line)
        if match:
            out[match.group(1)] = float(match.group(2))
    return out


def iso(seconds: float) -> str:
    """A clock value as the status writes times."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_iso(text: str | None) -> float | None:
    """A time the status wrote, as a clock value; None when there is none or it does not parse."""
    try:
        parsed = datetime.datetime.strptime(text or "", "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None
    return parsed.replace(tzinfo=datetime.UTC).timestamp()


def adopt_drains(health: Mapping[str, Any], ours: Mapping[str, int], wanted: Mapping[str, tuple[str, bool]],
                 known: Collection[str], started: float, timeout_s: float) -> tuple[dict[str, Drain], dict[str, str]]:
    """The drains to take back after an operator restart (its memory starts empty; the coordinator's flag
    survives): (drains to wait on, group -> coordinator group to resume once it serves).

    Only a group the coordinator's /health says is draining, that this operator drained (`ours`: group name
    -> index, from its own last status or a group it removes) and does not remember (`known`), is taken: a
    drain someone else asked stays theirs. One still wanted (`wanted`: group -> (why, migrate)) waits on
    under the deadline it had (`started`: when the Draining condition turned True); any other was done
    with (its group rolled or recreated) and only waits to be resumed.
    """
    drains: dict[str, Drain] = {}
    resumes: dict[str, str] = {}
    for group, index in sorted(ours.items()):
        target = coordinator_group(index)
        entry = health.get(target)
        if group in known or not isinstance(entry, Mapping) or not entry.get("draining"):
            continue
        if group in wanted:
            why, migrate = wanted[group]
            drains[group] = new_drain(target, why, migrate, started, timeout_s)
        else:
            resumes[group] = target
    return drains, resumes


def draining_condition(drains: Mapping[str, Drain], last: tuple[str, str] | None) -> tuple[bool, str, str]:
    """The Draining condition (value, reason, message): True while a drain is asked and not given up on,
    naming the groups and since when; otherwise the outcome of the last drain (or NoDrain)."""
    active = {name: d for name, d in drains.items() if not d.resolved}
    if active:
        parts = [f"{name} (coordinator group {d.group}, before its {d.why}) since {iso(d.started)}, "
                 f"deadline {iso(d.deadline)}" for name, d in sorted(active.items())]
        return True, "DrainInProgress", "draining " + "; ".join(parts)
    if last is not None:
        return False, last[0], last[1]
    return False, "NoDrain", "no group is being drained"


def stalled_condition(stalled: Mapping[str, float] | None) -> tuple[str, str, str]:
    """The AgreementStalled condition (status, reason, message) from the coordinator's stalled gauge per
    group; Unknown when the coordinator's /metrics could not be read."""
    if stalled is None:
        return "Unknown", "MetricsUnavailable", "the coordinator's /metrics could not be read"
    now = sorted(g for g, v in stalled.items() if v > 0)
    if now:
        return "True", "AgreementStalled", "an agreement wait is stalled now in group(s) " + ", ".join(now)
    return "False", "NoStall", "no agreement wait is stalled"


def stale_drains(drains: Mapping[str, Drain], wanted: Collection[str]) -> list[str]:
    """Drains asked for groups that are no longer about to be rolled, recreated or removed (the spec went
    back, or the roll waits for another group): they end, and the group is resumed once it serves."""
    return sorted(g for g in drains if g not in wanted)
