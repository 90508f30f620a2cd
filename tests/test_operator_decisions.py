"""The operator's decisions, table-tested on states written by hand: no cluster, no KMock, no sleeps."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import kopf
import pytest

from lockstep_operator import handlers
from lockstep_operator import manifests as m
from lockstep_operator.decisions import (
    CoordinatorView,
    Rollout,
    condition,
    decide_phase,
    decide_recreate,
    decide_rollout,
    decide_status,
    degraded_condition,
    invalid_status,
    ready_ranks,
    recreate_reason,
    serving,
)
from lockstep_operator.kube import Kube, KubeError
from lockstep_operator.memory import OperatorMemory
from lockstep_operator.observe import GroupState, Observed, PodState, Transition, group_states, pod_state
from lockstep_operator.resource import normalize

NOW, EARLIER = "2025-01-02T03:04:05Z", "2025-01-01T00:00:00Z"


def pod(name: str = "demo-g0-0", phase: str = "Running", ready: bool | None = None, restarts: int = 0,
        template_hash: str | None = "new", terminating: bool = False) -> PodState:
    return PodState(name=name, uid=f"uid-{name}", phase=phase, ready=phase == "Running" if ready is None else ready,
                    restarts=restarts, template_hash=template_hash, terminating=terminating)


def group(index: int = 0, pods: tuple[PodState, ...] | None = None, exists: bool = True, replicas: int = 2,
          in_spec: bool = True, labelled: bool = True, current_hash: str = "new", restarts: int = 0,
          pending_recreate: str | None = None) -> GroupState:
    """A group of 2 ranks; by default it exists, matches the spec and serves."""
    name = f"demo-g{index}"
    if pods is None:
        pods = (pod(f"{name}-0", template_hash=current_hash), pod(f"{name}-1", template_hash=current_hash))
    return GroupState(index=index, name=name, exists=exists, replicas=replicas if exists else 0,
                      current_hash=current_hash if exists else None, desired_hash="new", in_spec=in_spec,
                      labelled=labelled, pods=pods if exists else (), restarts=restarts,
                      pending_recreate=pending_recreate)


def down(index: int = 0, **kw: Any) -> GroupState:
    """A group whose pods are all starting (not ready)."""
    return group(index, pods=(pod(f"demo-g{index}-0", ready=False), pod(f"demo-g{index}-1", ready=False)), **kw)


def changed(index: int = 0, serving_now: bool = True) -> GroupState:
    """A group whose StatefulSet differs from the spec (still running the old template)."""
    g = group(index, in_spec=False, current_hash="old")
    return g if serving_now else down(index, in_spec=False)


# --- ready ranks ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("pods", "ready"), [
    ((pod("a"), pod("b")), 2),
    ((pod("a"), pod("b", ready=False)), 1),
    ((pod("a"), pod("b", template_hash="old")), 1),  # made from the previous template: not this group's
    ((pod("a"), pod("b", terminating=True)), 1),
    ((pod("a", template_hash=None),), 0),
    ((), 0),
])
def test_ready_ranks_count_only_current_ready_pods(pods: tuple[PodState, ...], ready: int) -> None:
    g = group(pods=pods)
    assert ready_ranks(g) == ready
    assert serving(g) == (ready == 2)


def test_a_missing_group_does_not_serve() -> None:
    assert not serving(group(exists=False))


# --- roll order ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("groups", "expected"), [
    pytest.param([group(0), group(1)], Rollout(), id="nothing-to-do"),
    pytest.param([group(0, exists=False), group(1, labelled=False)], Rollout(create=(0,), relabel=(1,)),
                 id="create-and-relabel"),
    pytest.param([changed(0), group(1)], Rollout(roll=0), id="one-changed-others-serve"),
    pytest.param([changed(0), changed(1)], Rollout(roll=0, retry="1 more group(s) to roll after demo-g0"),
                 id="first-of-two"),
    pytest.param([down(0), changed(1)],
                 Rollout(retry="waiting for demo-g0 to be ready before rolling demo-g1"),
                 id="rolled-group-not-ready-and-another-serves"),
    pytest.param([down(0), changed(1, serving_now=False)], Rollout(roll=1), id="nothing-serves-so-no-wait"),
    pytest.param([group(0, exists=False), changed(1)],
                 Rollout(create=(0,), retry="waiting for demo-g0 to be ready before rolling demo-g1"),
                 id="a-group-being-made-is-not-serving"),
    pytest.param([down(0), changed(1), changed(2)],
                 Rollout(retry="waiting for demo-g0 to be ready before rolling demo-g1"), id="wait-beats-more"),
    pytest.param([changed(0, serving_now=False), changed(1), group(2)],
                 Rollout(roll=0, retry="1 more group(s) to roll after demo-g0"), id="changed-groups-never-block"),
])
def test_rollout(groups: list[GroupState], expected: Rollout) -> None:
    assert decide_rollout(groups) == expected


def test_a_waiting_rollout_rolls_nothing_and_one_with_more_to_go_does() -> None:
    assert decide_rollout([down(0), changed(1)]).waiting
    assert not decide_rollout([changed(0), changed(1)]).waiting
    assert not decide_rollout([group(0)]).waiting


# --- recreate or wait ----------------------------------------------------------------------------

@pytest.mark.parametrize(("event", "p", "ours", "pending", "reason"), [
    ("DELETED", pod(), False, None, "rank pod demo-g0-0 was deleted"),
    ("DELETED", pod(), True, None, None),  # deleted by the operator itself (a roll, a recreate)
    ("MODIFIED", pod(restarts=2), True, None, None),
    ("MODIFIED", pod(restarts=1), False, None, "rank pod demo-g0-0 restarted"),
    (None, pod(restarts=1), False, None, "rank pod demo-g0-0 restarted"),  # seen when the operator starts
    ("MODIFIED", pod(restarts=1, terminating=True), False, None, None),
    ("MODIFIED", pod(restarts=1, terminating=True), False, "earlier", "earlier"),
    ("MODIFIED", pod(), False, None, None),
    ("ADDED", pod(), False, "rank pod demo-g0-2 restarted", "rank pod demo-g0-2 restarted"),  # try again
])
def test_recreate_reason(event: str | None, p: PodState, ours: bool, pending: str | None,
                         reason: str | None) -> None:
    assert recreate_reason(event, p, ours, pending) == reason


@pytest.mark.parametrize(("pods", "pending_before", "delete", "blocked_by", "announce"), [
    pytest.param((pod("a"), pod("b", restarts=1)), None, ("a", "b"), (), False, id="all-running"),
    pytest.param((pod("a"), pod("b", phase="Pending")), None, (), ("b",), True, id="pending-blocks"),
    pytest.param((pod("a", phase="Pending"), pod("b", phase="Pending")), None, (), ("a", "b"), True,
                 id="every-pending-pod-named"),
    pytest.param((pod("a"), pod("b", phase="Pending")), "why", (), ("b",), False, id="same-reason-no-new-event"),
    pytest.param((pod("a"), pod("b", phase="Pending")), "older", (), ("b",), True, id="new-reason-new-event"),
    pytest.param((pod("a"), pod("b", phase="Pending", terminating=True)), None, ("a",), (), False,
                 id="terminating-pod-neither-blocks-nor-is-deleted"),
    pytest.param((pod("a", phase="Failed"), pod("b", phase="")), None, ("a", "b"), (), False,
                 id="only-pending-blocks"),
    pytest.param((), None, (), (), False, id="no-pods-left"),
])
def test_recreate_waits_for_pending_pods(pods: tuple[PodState, ...], pending_before: str | None,
                                         delete: tuple[str, ...], blocked_by: tuple[str, ...], announce: bool) -> None:
    decision = decide_recreate(group(pods=pods, pending_recreate=pending_before), "why")
    assert tuple(p.name for p in decision.delete) == delete
    assert decision.blocked_by == blocked_by and decision.deferred == bool(blocked_by)
    assert decision.announce == announce and decision.reason == "why"


# --- status and conditions -----------------------------------------------------------------------

@pytest.mark.parametrize(("ready", "total", "pending", "phase", "message"), [
    (0, 0, False, "Pending", "no groups requested"),
    (2, 2, False, "Ready", "all 2 groups ready"),
    (2, 2, True, "Ready", "all 2 groups ready"),
    (1, 2, False, "Degraded", "1/2 groups ready"),
    (0, 2, True, "Degraded", "0/2 groups ready"),
    (0, 2, False, "Progressing", "0/2 groups ready"),
])
def test_phase(ready: int, total: int, pending: bool, phase: str, message: str) -> None:
    assert decide_phase(ready, total, pending) == (phase, message)


@pytest.mark.parametrize(("previous", "value", "since"), [
    ({}, True, NOW),
    ({"Ready": Transition("True", EARLIER)}, True, EARLIER),  # unchanged: keeps its transition time
    ({"Ready": Transition("False", EARLIER)}, True, NOW),
    ({"Ready": Transition("True", None)}, True, NOW),
    ({"Degraded": Transition("True", EARLIER)}, True, NOW),  # another condition's time is not this one's
])
def test_condition_transition_time(previous: dict[str, Transition], value: bool, since: str) -> None:
    c = condition("Ready", value, "R", "msg", previous, 4, NOW)
    assert c == {"type": "Ready", "status": "True", "reason": "R", "message": "msg",
                 "lastTransitionTime": since, "observedGeneration": 4}
    assert "observedGeneration" not in condition("Ready", value, "R", "msg", previous, None, NOW)


def observed(*groups: GroupState, conditions: dict[str, Transition] | None = None) -> Observed:
    return Observed(namespace="ml", name="demo", groups=groups, conditions=conditions or {})


SPEC2 = normalize({"model": {"path": "/m"}, "tensorParallelSize": 2, "groups": 2})


UP = {"g0": {"up": True, "reason": "", "step": 9, "draining": False},
      "g1": {"up": True, "reason": "", "step": 4, "draining": False}}


@pytest.mark.parametrize(("groups", "restarted", "phase", "ready", "conditions"), [
    pytest.param((group(0), group(1)), (), "Ready", 2,
                 {"Ready": "AllGroupsReady", "Progressing": "Stable", "Degraded": "AsExpected"}, id="ready"),
    pytest.param((down(0), down(1)), (), "Progressing", 0,
                 {"Ready": "GroupsNotReady", "Progressing": "GroupsStarting", "Degraded": "RanksNotReady"},
                 id="starting"),
    pytest.param((group(0), down(1)), (), "Degraded", 1,
                 {"Ready": "GroupsNotReady", "Progressing": "Stable", "Degraded": "RanksNotReady"}, id="one-down"),
    pytest.param((down(0, pending_recreate="why"), down(1)), (), "Degraded", 0,
                 {"Ready": "GroupsNotReady", "Progressing": "Stable", "Degraded": "RanksNotReady"},
                 id="recreate-waits"),
    pytest.param((group(0, exists=False), group(1)), (), "Degraded", 1,
                 {"Ready": "GroupsNotReady", "Progressing": "Stable", "Degraded": "RanksNotReady"}, id="missing"),
    pytest.param((down(0, restarts=3), down(1)), ("demo-g0", "demo-g1"), "Progressing", 0,
                 {"Ready": "GroupsNotReady", "Progressing": "GroupsStarting", "Degraded": "RanksNotReady"},
                 id="two-recreated-at-once"),
])
def test_status(groups: tuple[GroupState, ...], restarted: tuple[str, ...], phase: str, ready: int,
                conditions: dict[str, str]) -> None:
    """Ready and Progressing follow the phase; Degraded follows each group's ranks (the coordinator says
    every group is up here: `test_degraded_condition` has what it says otherwise)."""
    status = decide_status(observed(*groups), SPEC2, 7, NOW, restarted, CoordinatorView(health=UP))
    assert status["phase"] == phase and status["readyGroups"] == ready and status["replicas"] == 2
    assert status["observedGeneration"] == 7
    phase_conditions, coordinator_conditions = status["conditions"][:3], status["conditions"][3:]
    assert {c["type"]: c["reason"] for c in phase_conditions} == conditions
    assert [c["status"] == "True" for c in phase_conditions[:2]] == [k == phase for k in ("Ready", "Progressing")]
    assert phase_conditions[2]["status"] == ("False" if ready == 2 else "True")
    assert [(c["type"], c["status"], c["reason"]) for c in coordinator_conditions] == [
        ("Draining", "False", "NoDrain"), ("AgreementStalled", "Unknown", "MetricsUnavailable")]
    assert status["endpoint"] == "http://demo.ml.svc.cluster.local:8000"
    assert status["selector"] == m.rank_selector_string("demo")
    for g, entry in zip(groups, status["groups"], strict=True):
        assert entry == {"name": g.name, "ready": ready_ranks(g) == 2, "readyRanks": ready_ranks(g),
                         "restarts": g.restarts + (g.name in restarted),
                         "pendingRecreate": g.pending_recreate is not None, "draining": False}


def health(**changes: dict[str, Any] | None) -> dict[str, Any]:
    """The coordinator's /health body with both groups up, changed per group as given (None: not listed)."""
    out: dict[str, Any] = {g: dict(entry) for g, entry in UP.items()}
    for g, change in changes.items():
        if change is None:
            out.pop(g)
        else:
            out[g].update(change)
    return out


@pytest.mark.parametrize(("groups", "coordinator", "status", "reason", "names"), [
    pytest.param((group(0), group(1)), health(), "False", "AsExpected", (), id="all-serve"),
    pytest.param((group(0), group(1)), health(g1={"draining": True}), "False", "AsExpected", (),
                 id="draining-is-not-degraded"),
    pytest.param((group(0), group(1)), None, "Unknown", "CoordinatorUnavailable", (), id="coordinator-unreadable"),
    pytest.param((group(0), down(1)), None, "True", "RanksNotReady", ("demo-g1: 0/2 ranks ready",),
                 id="pods-say-so-without-the-coordinator"),
    pytest.param((group(0, pods=(pod("demo-g0-0"),)), group(1)), health(), "True", "RanksNotReady",
                 ("demo-g0: 1/2 ranks ready",), id="a-rank-not-ready"),
    pytest.param((group(0, exists=False), group(1)), health(), "True", "RanksNotReady", ("demo-g0: 0/2",),
                 id="no-statefulset"),
    pytest.param((group(0), group(1)), health(g1={"up": False, "reason": "rank 1 of group g1 is down; now: "
                                                   "waiting for rank 1"}),
                 "True", "GroupNotServing", ("demo-g1 (coordinator group g1) is not serving: rank 1 of group g1 "
                                             "is down; now: waiting for rank 1",), id="dead-rank"),
    pytest.param((group(0), down(1)), health(g1={"up": False, "reason": ""}), "True", "GroupNotServing",
                 ("demo-g1 (coordinator group g1) is not serving: down", "demo-g1: 0/2 ranks ready"),
                 id="recovering-both-say-so"),
    pytest.param((group(0), group(1)), health(g1=None), "True", "GroupNotServing",
                 ("demo-g1: the coordinator has no group g1",), id="not-a-coordinator-group-yet"),
])
def test_degraded_condition(groups: tuple[GroupState, ...], coordinator: dict[str, Any] | None, status: str,
                            reason: str, names: tuple[str, ...]) -> None:
    value, why, message = degraded_condition(groups, 2, coordinator)
    assert (value, why) == (status, reason)
    assert all(n in message for n in names), message
    status_out = decide_status(observed(*groups), SPEC2, 1, NOW, (), CoordinatorView(health=coordinator))
    degraded = next(c for c in status_out["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (value, why, message)


def test_status_keeps_transition_times_and_counts_ranks_against_the_spec() -> None:
    before = {"Ready": Transition("False", EARLIER), "Degraded": Transition("True", EARLIER)}
    # The StatefulSet still has 1 replica (not rolled yet) and its one rank is ready: not ready at TP 2,
    # so Degraded (1/2 ranks ready) as before.
    one = group(0, replicas=1, pods=(pod("demo-g0-0"),))
    status = decide_status(observed(one, conditions=before), normalize({"model": {"path": "/m"},
                                                                        "tensorParallelSize": 2}), None, NOW)
    assert status["groups"][0]["readyRanks"] == 1 and not status["groups"][0]["ready"]
    times = {c["type"]: c["lastTransitionTime"] for c in status["conditions"]}
    assert times == {"Ready": EARLIER, "Progressing": NOW, "Degraded": EARLIER, "Draining": NOW,
                     "AgreementStalled": NOW}
    assert "observedGeneration" not in status


def test_invalid_status() -> None:
    assert invalid_status("spec.x: bad", 3, NOW) == {
        "phase": "Degraded", "observedGeneration": 3,
        "conditions": [{"type": "Degraded", "status": "True", "reason": "InvalidSpec", "message": "spec.x: bad",
                        "lastTransitionTime": NOW}]}


# --- observing: API objects to states ------------------------------------------------------------

def k8s_pod(group_name: str, rank: int, template: dict, phase: str = "Running", restarts: int = 0,
            deleting: bool = False) -> dict:
    meta: dict[str, Any] = {"name": f"{group_name}-{rank}", "uid": f"u-{group_name}-{rank}",
                            "labels": dict(template["metadata"]["labels"]),
                            "annotations": dict(template["metadata"]["annotations"])}
    if deleting:
        meta["deletionTimestamp"] = NOW
    return {"kind": "Pod", "metadata": meta,
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": str(phase == "Running")}],
                       "containerStatuses": [{"name": "other", "restartCount": 9},
                                             {"name": "rank", "restartCount": restarts}]}}


def test_pod_state() -> None:
    t = m.rank_pod_template("demo", "ml", SPEC2, 0)
    p = pod_state(k8s_pod("demo-g0", 1, t, restarts=2, deleting=True))
    assert p == PodState(name="demo-g0-1", uid="u-demo-g0-1", phase="Running", ready=True, restarts=2,
                         template_hash=t["metadata"]["annotations"][m.ANNOTATION_HASH], terminating=True)
    assert not pod_state({"metadata": {"name": "x"}}).pending  # no status yet: not known to be Pending
    assert pod_state(k8s_pod("demo-g0", 0, t, phase="Pending")).pending


def sts(index: int, spec: dict, name: str | None = None, label: bool = True) -> dict:
    obj = m.group_statefulset("demo", "ml", spec, index)
    if name is not None:
        obj["metadata"]["name"] = name
    if not label:
        del obj["metadata"]["labels"][m.LABEL_GROUP_INDEX]
    return obj


@pytest.mark.parametrize(("statefulsets", "found", "strays"), [
    pytest.param([(0, None, True), (1, None, True)], {0: "demo-g0", 1: "demo-g1"}, [], id="labelled"),
    pytest.param([(1, "odd-name", True)], {1: "odd-name"}, [], id="index-from-the-label-not-the-name"),
    pytest.param([(0, None, True), (2, None, True), (5, None, True)], {0: "demo-g0"}, ["demo-g2", "demo-g5"],
                 id="beyond-the-spec-are-strays"),
    pytest.param([(1, None, False)], {1: "demo-g1"}, [], id="unlabelled-taken-by-its-name"),
    pytest.param([(7, "demo-g7", False), (0, "demo-g1x", False)], {}, ["demo-g7", "demo-g1x"],
                 id="unlabelled-unknown-names-are-strays"),
    pytest.param([(0, "new-g0", True), (0, "demo-g0", False)], {0: "new-g0"}, ["demo-g0"],
                 id="label-wins-over-name"),
])
def test_groups_found_by_index_label(statefulsets: list[tuple[int, str | None, bool]], found: dict[int, str],
                                     strays: list[str]) -> None:
    objs = [sts(i, SPEC2, name, label) for i, name, label in statefulsets]
    got = group_states("demo", "ml", SPEC2, objs, [], {}, {})
    assert {g.index: g.name for g in got.groups} == {0: "demo-g0", 1: "demo-g1"}
    assert {g.index for g in got.groups if g.exists} == set(found)
    assert got.strays == tuple(strays)


def test_a_statefulset_from_before_the_label_is_relabelled_not_made_again() -> None:
    got = group_states("demo", "ml", SPEC2, [sts(0, SPEC2, label=False), sts(1, SPEC2)], [], {}, {})
    assert [(g.exists, g.labelled) for g in got.groups] == [(True, False), (True, True)]
    assert decide_rollout(got.groups) == Rollout(relabel=(0,))


def test_group_states_compare_with_the_spec_and_bucket_pods() -> None:
    old_spec = normalize({"model": {"path": "/m"}, "tensorParallelSize": 1, "groups": 2})
    g0, g1 = sts(0, SPEC2), sts(1, old_spec)
    pods = [k8s_pod("demo-g0", r, g0["spec"]["template"]) for r in range(2)]
    pods.append(k8s_pod("demo-g1", 0, g1["spec"]["template"], phase="Pending"))
    status = {"groups": [{"name": "demo-g1", "restarts": 4}],
              "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": EARLIER}]}
    got = group_states("demo", "ml", SPEC2, [g0, g1], pods, status, {"demo-g1": "why"})
    a, b = got.groups
    assert a.exists and a.in_spec and a.labelled and a.replicas == 2 and a.current_hash == a.desired_hash
    assert [p.name for p in a.pods] == ["demo-g0-0", "demo-g0-1"] and serving(a)
    assert not b.in_spec and b.replicas == 1 and b.current_hash != b.desired_hash
    assert [p.name for p in b.pods] == ["demo-g1-0"] and b.pods[0].pending
    assert (a.restarts, b.restarts) == (0, 4) and (a.pending_recreate, b.pending_recreate) == (None, "why")
    assert got.conditions == {"Ready": Transition("False", EARLIER)}
    assert got.group("demo-g1") is b and got.group("demo-g9") is None
    assert decide_rollout(got.groups) == Rollout(roll=1)


def test_a_hand_edited_template_is_out_of_spec_though_its_hash_is_not() -> None:
    edited = sts(0, SPEC2)
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else"
    (g, _) = group_states("demo", "ml", SPEC2, [edited], [], {}, {}).groups
    assert g.current_hash == g.desired_hash and not g.in_spec


# --- the timer carries out waiting recreates (handler level, against an in-memory API) ----------

class MemoryKube(Kube):
    """Objects in a dict: get / list / create / patch (merge) / delete, as the operator uses them."""

    def __init__(self, objects: list[dict]) -> None:
        self.objects = {(o["kind"], o["metadata"]["name"]): copy.deepcopy(o) for o in objects}

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        return copy.deepcopy(self.objects.get((kind, name)))

    def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict]:
        return [copy.deepcopy(o) for (k, _), o in self.objects.items()
                if k == kind and labels.items() <= o["metadata"].get("labels", {}).items()]

    def create(self, obj: dict) -> dict:
        self.objects[(obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)
        return obj

    def patch(self, kind: str, namespace: str, name: str, patch: dict, subresource: str | None = None) -> dict:
        def merge(into: dict, change: dict) -> None:  # RFC 7386: null removes
            for key, value in change.items():
                if value is None:
                    into.pop(key, None)
                elif isinstance(value, dict) and isinstance(into.get(key), dict):
                    merge(into[key], value)
                else:
                    into[key] = copy.deepcopy(value)
        merge(self.objects[(kind, name)], patch)
        return self.objects[(kind, name)]

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        return self.objects.pop((kind, name), None) is not None


def test_a_field_applied_before_and_wanted_no_more_is_removed_and_one_set_by_others_is_kept() -> None:
    """A merge patch removes only what it sets to null: apply remembers what it applied, so a nodeSelector taken
    out of the spec leaves the StatefulSet, while a field the server or someone else set stays. An object applied
    before apply remembered anything loses nothing on its first patch, and is remembered from then on."""
    spec = normalize({"model": {"path": "/m"}, "nodeSelector": {"pool": "old"},
                      "tolerations": [{"key": "gpu", "operator": "Exists"}]})
    kube = MemoryKube([])
    assert kube.apply(m.group_statefulset("demo", "ml", spec, 0)) == "created"
    kube.objects[("StatefulSet", "demo-g0")]["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"  # a default
    assert kube.apply(m.group_statefulset("demo", "ml", spec, 0)) == "unchanged"
    plain = normalize({"model": {"path": "/m"}})
    assert kube.apply(m.group_statefulset("demo", "ml", plain, 0)) == "patched"
    pod = kube.get("StatefulSet", "ml", "demo-g0")["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod and pod["dnsPolicy"] == "ClusterFirst"
    assert kube.apply(m.group_statefulset("demo", "ml", plain, 0)) == "unchanged"

    legacy = m.group_statefulset("demo", "ml", spec, 1)  # made by an operator that kept no record
    kube.create(legacy)
    assert kube.apply(m.group_statefulset("demo", "ml", plain, 1)) == "patched"
    assert kube.get("StatefulSet", "ml", "demo-g1")["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "old"}
    assert kube.apply(m.group_statefulset("demo", "ml", spec, 1)) == "patched"
    assert kube.apply(m.group_statefulset("demo", "ml", plain, 1)) == "patched"
    assert "nodeSelector" not in kube.get("StatefulSet", "ml", "demo-g1")["spec"]["template"]["spec"]


def test_timer_recreates_every_waiting_group_and_counts_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two groups whose recreates waited, both free now: both are recreated and both counted (no drain
    here: test_operator_drain.py covers the drain before a recreate)."""
    cr = {"apiVersion": "lockstep.dev/v1alpha1", "kind": "LockstepDeployment",
          "metadata": {"name": "demo", "namespace": "ml", "uid": "u", "generation": 5},
          "spec": {"model": {"path": "/m"}, "tensorParallelSize": 2, "groups": 2,
                   "rollout": {"drainTimeoutSeconds": 0}},
          "status": {"groups": [{"name": "demo-g0", "restarts": 1}, {"name": "demo-g1", "restarts": 0}]}}
    objects = [cr, sts(0, SPEC2), sts(1, SPEC2)]
    objects += [k8s_pod(f"demo-g{i}", r, objects[1 + i]["spec"]["template"]) for i in range(2) for r in range(2)]
    kube = MemoryKube(objects)
    memory = OperatorMemory(kube=kube)
    memory.pending_recreates.update({("ml", "demo", "demo-g0"): "a", ("ml", "demo", "demo-g1"): "b"})
    events: list[str] = []
    monkeypatch.setattr(kopf, "event", lambda *_, **kw: events.append(kw["reason"]))

    monkeypatch.setenv("LOCKSTEP_OPERATOR_COORDINATOR_URL", "http://127.0.0.1:9")  # nothing listens: no metrics
    asyncio.run(handlers.refresh(body=kopf.Body(cr), name="demo", namespace="ml", memo=kopf.Memo(lockstep=memory)))

    assert not kube.list("Pod", "ml", m.selector("demo", "rank")), "every pod of both groups deleted"
    assert memory.deleted_by_us == {f"u-demo-g{i}-{r}" for i in range(2) for r in range(2)}
    assert not memory.pending_recreates and events == ["GroupRecreated", "GroupRecreated"]
    status = kube.get("LockstepDeployment", "ml", "demo")["status"]
    assert [(g["name"], g["restarts"], g["pendingRecreate"]) for g in status["groups"]] == [
        ("demo-g0", 2, False), ("demo-g1", 1, False)]
    assert status["observedGeneration"] == 5 and status["phase"] == "Progressing"


def test_reconcile_labels_groups_made_before_the_index_label(monkeypatch: pytest.MonkeyPatch) -> None:
    """An upgraded operator labels the old StatefulSets in place (no pod deleted) and removes old strays."""
    spec = {"model": {"path": "/m"}, "tensorParallelSize": 2, "groups": 2}
    cr = {"apiVersion": "lockstep.dev/v1alpha1", "kind": "LockstepDeployment",
          "metadata": {"name": "demo", "namespace": "ml", "uid": "u", "generation": 1}, "spec": spec}
    old = [sts(0, SPEC2, label=False), sts(1, SPEC2, label=False), sts(2, SPEC2, label=False)]
    pods = [k8s_pod(f"demo-g{i}", r, old[i]["spec"]["template"]) for i in range(2) for r in range(2)]
    kube = MemoryKube([cr, *old, *pods])
    monkeypatch.setattr(kopf, "event", lambda *_, **kw: pytest.fail(f"unexpected event {kw['reason']}"))

    handlers.reconcile(body=kopf.Body(cr), name="demo", namespace="ml", logger=logging.getLogger("test"),
                       memo=kopf.Memo(lockstep=OperatorMemory(kube=kube)))

    for i in range(2):
        labels = kube.get("StatefulSet", "ml", f"demo-g{i}")["metadata"]["labels"]
        assert labels[m.LABEL_GROUP_INDEX] == str(i)
    assert kube.get("StatefulSet", "ml", "demo-g2") is None, "groups=2: the third goes"
    assert len(kube.list("Pod", "ml", m.selector("demo", "rank"))) == 4, "labelling restarts nothing"
    status = kube.get("LockstepDeployment", "ml", "demo")["status"]
    assert status["phase"] == "Ready" and status["readyGroups"] == 2



class RefusingKube(MemoryKube):
    """An API server that refuses StatefulSets as invalid (422), as it does one whose pod template it rejects, or
    is unavailable (503)."""

    def __init__(self, objects: list[dict], status: int) -> None:
        super().__init__(objects)
        self.status = status

    def create(self, obj: dict) -> dict:
        if obj["kind"] == "StatefulSet":
            raise KubeError(self.status, "StatefulSet.apps \"demo-g0\" is invalid: spec.template.spec.volumes[3]")
        return super().create(obj)


def test_an_object_the_api_server_refuses_is_a_degraded_deployment_that_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 422 will not pass by itself: the deployment turns Degraded with the server's reason and an InvalidSpec
    event, instead of showing Progressing for ever with the reason only in the operator's log. A 503 may pass: it
    is raised for kopf to retry, and the status says nothing it does not know."""
    cr = {"apiVersion": "lockstep.dev/v1alpha1", "kind": "LockstepDeployment",
          "metadata": {"name": "demo", "namespace": "ml", "uid": "u", "generation": 3},
          "spec": {"model": {"path": "/m"}}}
    events: list[str] = []
    monkeypatch.setattr(kopf, "event", lambda *_, **kw: events.append(kw["reason"]))
    kube = RefusingKube([cr], 422)
    with pytest.raises(kopf.PermanentError, match="refused an object built from this spec: HTTP 422"):
        handlers.reconcile(body=kopf.Body(cr), name="demo", namespace="ml", logger=logging.getLogger("test"),
                           memo=kopf.Memo(lockstep=OperatorMemory(kube=kube)))
    status = kube.get("LockstepDeployment", "ml", "demo")["status"]
    assert status["phase"] == "Degraded" and "volumes[3]" in status["conditions"][0]["message"]
    assert status["observedGeneration"] == 3 and events == ["InvalidSpec"]

    kube = RefusingKube([cr], 503)
    with pytest.raises(KubeError):
        handlers.reconcile(body=kopf.Body(cr), name="demo", namespace="ml", logger=logging.getLogger("test"),
                           memo=kopf.Memo(lockstep=OperatorMemory(kube=kube)))
    assert "status" not in kube.get("LockstepDeployment", "ml", "demo")


def test_the_uninstall_hook_gives_up_when_no_operator_lets_the_deployment_go() -> None:
    """Without an operator the finalizer stays: the hook fails after its timeout (helm uninstall says so) instead of
    waiting for ever."""
    from lockstep_operator.uninstall import delete_and_wait

    class Finalized(MemoryKube):
        def delete(self, kind: str, namespace: str, name: str) -> bool:
            self.objects[(kind, name)]["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
            return True

    kube = Finalized([{"kind": "LockstepDeployment", "metadata": {"name": "demo", "finalizers": ["x"]}}])
    now = [0.0]
    assert not delete_and_wait(kube, "ml", "demo", 5.0, clock=lambda: now[0],
                               sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert now[0] == 5.0 and kube.get("LockstepDeployment", "ml", "demo")["metadata"]["deletionTimestamp"]
