"""Read the cluster once, into plain frozen states that the decisions in `decisions.py` take.

Nothing here decides. `observe` is the one function that reads (two list calls, whatever the number
of groups); the conversions from API objects to states (`pod_state`, `group_states`) are pure, so the
decisions are tested on states written by hand, without a cluster.

A group is found by the index on its StatefulSet's `lockstep.dev/group-index` label, never by parsing
its name. A StatefulSet made before that label existed is taken for the group whose name it has (the
reconcile then adds the label).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lockstep_operator import manifests as m
from lockstep_operator.kube import Kube, contains

GroupKey = tuple[str, str, str]  # (namespace, deployment, group name)


@dataclass(frozen=True)
class PodState:
    """One rank pod, as the decisions need it."""

    name: str
    uid: str
    phase: str  # Pending, Running, Succeeded, Failed, Unknown ("" before the kubelet says)
    ready: bool
    restarts: int  # of the rank container
    template_hash: str | None  # the template hash annotation it was made from
    terminating: bool  # deletionTimestamp set

    @property
    def pending(self) -> bool:
        return self.phase == "Pending"


@dataclass(frozen=True)
class GroupState:
    """One group the spec asks for: its StatefulSet against the spec, its pods, what is remembered of it."""

    index: int
    name: str
    exists: bool  # its StatefulSet exists
    replicas: int  # the StatefulSet's replicas now (0 when it does not exist)
    current_hash: str | None  # the template hash the StatefulSet makes pods with now
    desired_hash: str  # the template hash the spec asks for
    in_spec: bool  # replicas and pod template already as the spec asks
    labelled: bool  # the StatefulSet's labels already as the spec asks (older operators set fewer)
    pods: tuple[PodState, ...] = ()
    restarts: int = 0  # recreations counted in the status so far
    pending_recreate: str | None = None  # why it is to be recreated once no pod is Pending


@dataclass(frozen=True)
class Transition:
    """A condition as the status last said it: its value and since when."""

    status: str
    since: str | None


@dataclass(frozen=True)
class Observed:
    """One LockstepDeployment's groups as the cluster has them, and what its status said before."""

    namespace: str
    name: str
    groups: tuple[GroupState, ...]
    strays: tuple[str, ...] = ()  # StatefulSets of this deployment that are no group of the spec
    stray_index: Mapping[str, int] = field(default_factory=dict)  # a stray's group-index label, where it has one
    conditions: Mapping[str, Transition] = field(default_factory=dict)

    def group(self, name: str) -> GroupState | None:
        """The group of that name (a rank pod's group label), if the spec asks for it."""
        return next((g for g in self.groups if g.name == name), None)


def _template_hash(template: Mapping[str, Any]) -> str | None:
    return template.get("metadata", {}).get("annotations", {}).get(m.ANNOTATION_HASH)


def pod_state(pod: Mapping[str, Any]) -> PodState:
    """The facts of one Pod object the decisions use."""
    meta, status = pod["metadata"], pod.get("status", {})
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
    restarts = max((s.get("restartCount", 0) for s in status.get("containerStatuses", [])
                    if s.get("name") == "rank"), default=0)
    return PodState(name=meta["name"], uid=meta.get("uid", ""), phase=status.get("phase", ""),
                    ready=ready, restarts=restarts, template_hash=_template_hash(pod),
                    terminating=bool(meta.get("deletionTimestamp")))


def group_index(statefulset: Mapping[str, Any]) -> int | None:
    """The group index on a StatefulSet's label; None when it has none (made by an older operator)."""
    label = statefulset["metadata"].get("labels", {}).get(m.LABEL_GROUP_INDEX, "")
    return int(label) if label.isdigit() else None


def _by_group(name: str, count: int, statefulsets: Sequence[Mapping[str, Any]]
              ) -> tuple[dict[int, Mapping[str, Any]], list[str]]:
    """The StatefulSet of each group index the spec asks for, and the names of the others (strays)."""
    found: dict[int, Mapping[str, Any]] = {}
    for sts in sorted(statefulsets, key=lambda s: group_index(s) is None):  # labelled ones first
        index = group_index(sts)
        if index is None:  # made before the label: the group whose name it has, if any
            index = next((i for i in range(count) if m.group_name(name, i) == sts["metadata"]["name"]), None)
        if index is not None and index < count:
            found.setdefault(index, sts)
    kept = {sts["metadata"]["name"] for sts in found.values()}
    return found, [sts["metadata"]["name"] for sts in statefulsets if sts["metadata"]["name"] not in kept]


def group_states(name: str, namespace: str, spec: Mapping[str, Any], statefulsets: Sequence[Mapping[str, Any]],
                 pods: Sequence[Mapping[str, Any]], status: Mapping[str, Any],
                 pending_recreates: Mapping[str, str]) -> Observed:
    """The states of the groups the spec asks for, from the deployment's StatefulSets and rank pods."""
    found, strays = _by_group(name, spec["groups"], statefulsets)
    restarts = {g.get("name"): g.get("restarts", 0) for g in status.get("groups", [])}
    groups = []
    for i in range(spec["groups"]):
        g = m.group_name(name, i)
        want = m.group_statefulset(name, namespace, dict(spec), i)
        sts = found.get(i)
        group_pods = tuple(pod_state(p) for p in pods if p["metadata"].get("labels", {}).get(m.LABEL_GROUP) == g)
        groups.append(GroupState(
            index=i, name=g, exists=sts is not None,
            replicas=sts["spec"].get("replicas", 0) if sts else 0,
            current_hash=_template_hash(sts["spec"].get("template", {})) if sts else None,
            desired_hash=_template_hash(want["spec"]["template"]) or "",
            in_spec=sts is not None and contains(sts, {"spec": {"replicas": want["spec"]["replicas"],
                                                                "template": want["spec"]["template"]}}),
            labelled=sts is not None and contains(sts, {"metadata": {"labels": want["metadata"]["labels"]}}),
            pods=group_pods, restarts=restarts.get(g, 0), pending_recreate=pending_recreates.get(g)))
    conditions = {c["type"]: Transition(c.get("status", "Unknown"), c.get("lastTransitionTime"))
                  for c in status.get("conditions", []) if "type" in c}
    labelled = {sts["metadata"]["name"]: group_index(sts) for sts in statefulsets}
    return Observed(namespace=namespace, name=name, groups=tuple(groups), strays=tuple(strays),
                    stray_index={s: i for s in strays if (i := labelled.get(s)) is not None},
                    conditions=conditions)


def observe(kube: Kube, deployment: Mapping[str, Any], spec: Mapping[str, Any],
            pending_recreates: Mapping[str, str]) -> Observed:
    """Read one deployment's StatefulSets and rank pods; `deployment` is its object (for the old status)."""
    meta = deployment["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    statefulsets = kube.list("StatefulSet", namespace, m.selector(name, "rank"))
    pods = kube.list("Pod", namespace, m.selector(name, "rank"))
    return group_states(name, namespace, spec, statefulsets, pods, deployment.get("status") or {},
                        pending_recreates)
