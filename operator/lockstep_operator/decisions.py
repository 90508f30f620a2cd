"""The operator's decisions, as pure functions of observed states (see `observe.py`): no I/O, no clock.

The kopf handlers observe, call these, and carry out what they return, so every rule here (which
group rolls next, whether a group is recreated now or waits for a Pending pod, what the status says)
is tested on states written by hand.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lockstep_operator import manifests as m
from lockstep_operator.drain import Drain, coordinator_group, draining_condition, stalled_condition
from lockstep_operator.observe import GroupState, Observed, PodState, Transition


def ready_ranks(group: GroupState) -> int:
    """Ranks that are ready and run the StatefulSet's current template (an old pod does not count)."""
    return sum(1 for p in group.pods
               if p.ready and not p.terminating and p.template_hash is not None
               and p.template_hash == group.current_hash)


def serving(group: GroupState) -> bool:
    """Whether the group serves as its StatefulSet stands now: every replica ready."""
    return group.exists and ready_ranks(group) == group.replicas


@dataclass(frozen=True)
class Rollout:
    """What one reconcile does to the groups' StatefulSets."""

    create: tuple[int, ...] = ()  # groups without a StatefulSet: made now
    relabel: tuple[int, ...] = ()  # StatefulSets whose labels an older operator wrote
    roll: int | None = None  # the one changed group rolled now
    retry: str | None = None  # why the reconcile must run again soon (a roll waits, or more are left)

    @property
    def waiting(self) -> bool:
        """A changed group waits for a rolled one to serve again (so nothing is rolled now)."""
        return self.retry is not None and self.roll is None


def decide_rollout(groups: Sequence[GroupState]) -> Rollout:
    """Roll changed groups one at a time, and only while every group already rolled serves again.

    A group that is rolled is down; one at a time keeps the others serving. A group being made counts
    as one not serving yet. If nothing serves anyway, waiting protects nobody, so the roll goes ahead.
    """
    create = tuple(g.index for g in groups if not g.exists)
    relabel = tuple(g.index for g in groups if g.exists and not g.labelled)
    changed = [g for g in groups if g.exists and not g.in_spec]
    if not changed:
        return Rollout(create=create, relabel=relabel)
    not_serving = [g.name for g in groups if (not g.exists or g.in_spec) and not serving(g)]
    if not_serving and any(serving(g) for g in groups):
        return Rollout(create=create, relabel=relabel,
                       retry=f"waiting for {', '.join(not_serving)} to be ready before rolling {changed[0].name}")
    more = f"{len(changed) - 1} more group(s) to roll after {changed[0].name}" if len(changed) > 1 else None
    return Rollout(create=create, relabel=relabel, roll=changed[0].index, retry=more)


def recreate_reason(event_type: str | None, pod: PodState, deleted_by_us: bool,
                    pending_reason: str | None) -> str | None:
    """Why a rank pod event means its group must be recreated, or None.

    A restarted or vanished rank breaks its torch.distributed group, which cannot take a new member.
    A pod this operator deleted itself (a roll, a recreate) is no failure. Any event of a group whose
    recreate waits for a Pending pod is a moment to try again.
    """
    if deleted_by_us:
        return None
    if event_type == "DELETED":
        return f"rank pod {pod.name} was deleted"
    if pod.restarts > 0 and not pod.terminating:
        return f"rank pod {pod.name} restarted"
    return pending_reason


@dataclass(frozen=True)
class Recreate:
    """Recreate a group now (delete its pods), or wait: a pod still Pending is probably pulling an image."""

    reason: str
    delete: tuple[PodState, ...] = ()  # the pods to delete now; the StatefulSet makes them anew
    blocked_by: tuple[str, ...] = ()  # Pending pods the recreate waits for
    announce: bool = False  # a new reason to wait: worth an event (a repeated one is not)

    @property
    def deferred(self) -> bool:
        return bool(self.blocked_by)


def decide_recreate(group: GroupState, reason: str) -> Recreate:
    """Recreate the whole group unless one of its pods is still Pending (no restart storm on slow pulls)."""
    pods = tuple(p for p in group.pods if not p.terminating)
    pending = tuple(p.name for p in pods if p.pending)
    if pending:
        return Recreate(reason=reason, blocked_by=pending, announce=group.pending_recreate != reason)
    return Recreate(reason=reason, delete=pods)


def decide_phase(ready: int, total: int, pending_recreate: bool) -> tuple[str, str]:
    """The phase and its message: some groups down (or one waiting to be recreated) is Degraded."""
    if total == 0:
        return "Pending", "no groups requested"
    if ready == total:
        return "Ready", f"all {total} groups ready"
    if ready > 0 or pending_recreate:
        return "Degraded", f"{ready}/{total} groups ready"
    return "Progressing", f"{ready}/{total} groups ready"


_REASONS = {  # condition -> (reason when True, reason when False)
    "Ready": ("AllGroupsReady", "GroupsNotReady"),
    "Progressing": ("GroupsStarting", "Stable"),
}


def degraded_condition(groups: Sequence[GroupState], ranks: int,
                       health: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """The Degraded condition (status, reason, message): True, naming each group and why, while a group of
    the spec cannot serve now, as the coordinator's /health says (down, recovering, a dead rank, or not one
    of its groups) or as its StatefulSet says (fewer ready ranks than `ranks`); else Unknown when /health
    could not be read (`health` None), False when it says every group is up. A drained group still serves
    what it holds: that is the Draining condition, not this one."""
    not_ready = [f"{g.name}: {n}/{ranks} ranks ready" for g in groups
                 if (n := ready_ranks(g) if g.exists else 0) < ranks]
    not_serving = []
    for g in groups if health is not None else ():
        target = coordinator_group(g.index)
        entry = health.get(target)
        if not isinstance(entry, Mapping):
            not_serving.append(f"{g.name}: the coordinator has no group {target}")
        elif not entry.get("up"):
            not_serving.append(f"{g.name} (coordinator group {target}) is not serving: {entry.get('reason') or 'down'}")
    if not_serving:
        return "True", "GroupNotServing", "; ".join(not_serving + not_ready)
    if not_ready:
        return "True", "RanksNotReady", "; ".join(not_ready)
    if health is None:
        return "Unknown", "CoordinatorUnavailable", "the coordinator's /health could not be read"
    return "False", "AsExpected", f"all {len(groups)} group(s) serve"


def condition(kind: str, value: bool | str, reason: str, message: str, previous: Mapping[str, Transition],
              generation: int | None, now: str) -> dict[str, Any]:
    """One condition (value True, False or the string "Unknown"); its lastTransitionTime stays as it was
    while its value does not change."""
    status = value if isinstance(value, str) else ("True" if value else "False")
    before = previous.get(kind)
    since = before.since if before is not None and before.status == status else None
    out: dict[str, Any] = {"type": kind, "status": status, "reason": reason, "message": message,
                           "lastTransitionTime": since or now}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def group_status(group: GroupState, tensor_parallel_size: int, restarted: bool,
                 draining: bool = False) -> dict[str, Any]:
    """One entry of status.groups: ready only when all its ranks are; `restarted` counts one recreation."""
    ranks = ready_ranks(group) if group.exists else 0
    return {"name": group.name, "ready": ranks == tensor_parallel_size, "readyRanks": ranks,
            "restarts": group.restarts + (1 if restarted else 0),
            "pendingRecreate": group.pending_recreate is not None, "draining": draining}


@dataclass(frozen=True)
class CoordinatorView:
    """What the operator knows of the coordinator's side: its drains and its stalled agreement waits."""

    drains: Mapping[str, Drain] = field(default_factory=dict)  # group name -> the drain asked
    last_drain: tuple[str, str] | None = None  # (reason, message) of the last drain that ended
    stalled: Mapping[str, float] | None = None  # lockstep_agreements_stalled per group; None: unknown
    health: Mapping[str, Any] | None = None  # the coordinator's /health body, per group; None: unreadable
    resuming: Collection[str] = ()  # groups drained and rolled or recreated: the coordinator drains them until resumed
    adopting: bool = False  # a new operator has not yet asked the coordinator which drains it had


def decide_status(observed: Observed, spec: Mapping[str, Any], generation: int | None, now: str,
                  restarted: Collection[str] = (), coordinator: CoordinatorView | None = None) -> dict[str, Any]:
    """The resource's status: phase, groups, conditions; `restarted` names the groups just recreated."""
    view = coordinator or CoordinatorView()
    draining = {g for g, d in view.drains.items() if not d.resolved} | set(view.resuming)
    groups = [group_status(g, spec["tensorParallelSize"], g.name in restarted, g.name in draining)
              for g in observed.groups]
    ready = sum(g["ready"] for g in groups)
    phase, message = decide_phase(ready, spec["groups"], any(g["pendingRecreate"] for g in groups))
    conditions = [condition(kind, phase == kind, reasons[0] if phase == kind else reasons[1], message,
                            observed.conditions, generation, now)
                  for kind, reasons in _REASONS.items()]
    conditions.append(condition("Degraded", *degraded_condition(observed.groups, spec["tensorParallelSize"],
                                                                view.health), observed.conditions, generation, now))
    before = observed.conditions.get("Draining")
    if view.adopting and before is not None and before.status == "True":  # not False until the coordinator says
        drain = (True, "OperatorRestarted", "the operator restarted: taking its drains back from the coordinator")
    else:
        drain = draining_condition(view.drains, view.last_drain)
    conditions.append(condition("Draining", *drain, observed.conditions, generation, now))
    conditions.append(condition("AgreementStalled", *stalled_condition(view.stalled), observed.conditions,
                                generation, now))
    status: dict[str, Any] = {
        "phase": phase,
        "replicas": spec["groups"],
        "readyGroups": ready,
        "selector": m.rank_selector_string(observed.name),
        "endpoint": m.endpoint(observed.name, observed.namespace, dict(spec)),
        "groups": groups,
        "conditions": conditions,
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def invalid_status(message: str, generation: int | None, now: str) -> dict[str, Any]:
    """The status of a spec that cannot be served: Degraded, saying why, and nothing built."""
    return {"phase": "Degraded", "observedGeneration": generation,
            "conditions": [{"type": "Degraded", "status": "True", "reason": "InvalidSpec", "message": message,
                            "lastTransitionTime": now}]}
