"""kopf handlers: LockstepDeployments in, groups of rank pods and a coordinator out.

Every handler does three things: observe the cluster into plain states (`observe.py`), decide with
the pure functions of `decisions.py`, and carry out what they return. Level-based: the desired objects
are rebuilt by the pure builders of `manifests.py` and applied idempotently, so a retry, an operator
restart (`on.resume`) or a replayed event does the same thing again. What the operator remembers
between calls lives in kopf's memo (`memory.py`); decisions about one deployment are taken under its
lock, so the resource handlers and the pod watcher never act on a group at once.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
from collections.abc import Collection, Iterable
from typing import Any

import kopf

from lockstep_operator import manifests as m
from lockstep_operator.crd import GROUP, KIND, PLURAL, VERSION
from lockstep_operator.decisions import (
    Rollout,
    decide_recreate,
    decide_rollout,
    decide_status,
    invalid_status,
    recreate_reason,
)
from lockstep_operator.kube import Kube, KubeError, default_api_client
from lockstep_operator.memory import MEMO_KEY, MEMO_KUBE, OperatorMemory
from lockstep_operator.observe import GroupState, Observed, PodState, observe, pod_state
from lockstep_operator.resource import SpecError, check_name, normalize

RETRY_SECONDS = float(os.environ.get("LOCKSTEP_OPERATOR_RETRY_SECONDS", "15"))
STATUS_INTERVAL_SECONDS = float(os.environ.get("LOCKSTEP_OPERATOR_STATUS_INTERVAL_SECONDS", "30"))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations (the structural status schema has no room for it), and
    start the operator's memory in its memo, with the client the caller put there or the default one."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.level = logging.INFO
    settings.peering.standalone = True
    memo[MEMO_KEY] = OperatorMemory(kube=memo.get(MEMO_KUBE) or Kube(default_api_client()))


def _memory(memo: kopf.Memo) -> OperatorMemory:
    memory: OperatorMemory = memo[MEMO_KEY]
    return memory


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _owned(obj: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    kopf.adopt(obj, owner=owner)
    return obj


def _delete_pods(memory: OperatorMemory, namespace: str, pods: Iterable[PodState]) -> None:
    for pod in pods:
        memory.deleted_by_us.add(pod.uid)  # before the delete: its DELETED event must find it
        memory.kube.delete("Pod", namespace, pod.name)


def _observe(memory: OperatorMemory, deployment: dict[str, Any], spec: dict[str, Any]) -> Observed:
    meta = deployment["metadata"]
    return observe(memory.kube, deployment, spec, memory.pending_for(meta["namespace"], meta["name"]))


def _write_status(memory: OperatorMemory, namespace: str, name: str, spec: dict[str, Any],
                  generation: int | None, restarted: Collection[str] = ()) -> None:
    """Observe again (after what was just carried out) and write the status it decides."""
    current = memory.kube.get(KIND, namespace, name)
    if current is None:
        return
    status = decide_status(_observe(memory, current, spec), spec, generation, _now(), restarted)
    memory.kube.patch(KIND, namespace, name, {"status": status}, subresource="status")


def _spec_or_report(memory: OperatorMemory, body: kopf.Body) -> dict[str, Any]:
    """The normalized spec; an invalid one is reported (event, Degraded status) and never retried."""
    try:
        check_name(body.metadata.name)
        return normalize(dict(body.spec))
    except SpecError as e:
        kopf.event(body, type="Warning", reason="InvalidSpec", message=str(e))
        status = invalid_status(str(e), body.metadata.get("generation"), _now())
        memory.kube.patch(KIND, body.metadata.namespace, body.metadata.name, {"status": status},
                          subresource="status")
        raise kopf.PermanentError(str(e)) from e


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(body: kopf.Body, name: str, namespace: str, logger: logging.Logger, memo: kopf.Memo,
              **_: Any) -> None:
    """Make the cluster match the spec; roll changed groups one at a time."""
    memory = _memory(memo)
    spec = _spec_or_report(memory, body)
    owner = dict(body)
    with memory.lock(namespace, name):
        _create_group_token(memory, owner, logger)
        observed = _observe(memory, owner, spec)
        rollout = decide_rollout(observed.groups)
        _apply_groups(memory, owner, spec, rollout, logger)
        _remove_groups(memory, observed, spec["groups"], logger)
        memory.kube.apply(_owned(m.coordinator_service(name, namespace, spec), owner))
        memory.kube.apply(_owned(m.coordinator_deployment(name, namespace, spec), owner))
        if rollout.waiting:  # kopf comes back soon; the status is written by the pass that rolls
            raise kopf.TemporaryError(rollout.retry, delay=RETRY_SECONDS)
        if rollout.roll is not None:
            _roll(memory, owner, spec, observed.groups[rollout.roll], logger)
        _write_status(memory, namespace, name, spec, body.metadata.get("generation"))
    if rollout.retry:
        raise kopf.TemporaryError(rollout.retry, delay=RETRY_SECONDS)


def _create_group_token(memory: OperatorMemory, owner: dict[str, Any], logger: logging.Logger) -> None:
    """Create the deployment's group token Secret if it is not there; one that is stays as it is. The
    operator only ever creates Secrets (it needs no right to read them): AlreadyExists means done."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    secret = _owned(m.group_token_secret(name, namespace, secrets.token_urlsafe(32)), owner)
    try:
        memory.kube.create(secret)
    except KubeError as e:
        if e.status != 409:
            raise
        return
    logger.info(f"group token: Secret {secret['metadata']['name']} created")


def _apply_groups(memory: OperatorMemory, owner: dict[str, Any], spec: dict[str, Any], rollout: Rollout,
                  logger: logging.Logger) -> None:
    """Every group's Service and NetworkPolicy; the StatefulSets of new groups; labels of old ones."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    for i in range(spec["groups"]):
        svc, sts, *rest = m.group_manifests(name, namespace, spec, i)
        for obj in (svc, *rest):
            memory.kube.apply(_owned(obj, owner))
        if i in rollout.create:
            logger.info(f"group {sts['metadata']['name']}: {memory.kube.apply(_owned(sts, owner))}")
        elif i in rollout.relabel:
            memory.kube.patch("StatefulSet", namespace, sts["metadata"]["name"],
                              {"metadata": {"labels": sts["metadata"]["labels"]}})


def _roll(memory: OperatorMemory, owner: dict[str, Any], spec: dict[str, Any], group: GroupState,
          logger: logging.Logger) -> None:
    """The new template, then every pod of the group deleted (OnDelete: the StatefulSet makes them anew)."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    logger.info(f"group {group.name}: rolling to the new spec")
    memory.kube.apply(_owned(m.group_statefulset(name, namespace, spec, group.index), owner))
    # Listed after the new template is in: a pod made from the old one just before is deleted too.
    pods = memory.kube.list("Pod", namespace, m.selector(name, "rank", group.name))
    _delete_pods(memory, namespace, (pod_state(p) for p in pods))
    memory.forget(namespace, name, group.name)  # every pod goes: a recreate that waited is done with
    kopf.event(owner, type="Normal", reason="GroupRolled", message=f"group {group.name} rolled to the new spec")


def _remove_groups(memory: OperatorMemory, observed: Observed, groups: int, logger: logging.Logger) -> None:
    """Scaling down removes whole groups: StatefulSet, Service, NetworkPolicy."""
    for g in observed.strays:
        logger.info(f"group {g}: removed (groups={groups})")
        for kind in ("StatefulSet", "Service", "NetworkPolicy"):
            memory.kube.delete(kind, observed.namespace, g)
        memory.forget(observed.namespace, observed.name, g)


def _recreate(memory: OperatorMemory, owner: dict[str, Any], group: GroupState, reason: str) -> bool:
    """Recreate the group as `decide_recreate` says, or remember to once no pod is Pending; True if done."""
    namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    decision = decide_recreate(group, reason)
    if decision.deferred:
        if decision.announce:
            message = f"group {group.name} to be recreated ({reason}) once {', '.join(decision.blocked_by)} " \
                      "is not Pending"
            kopf.event(owner, type="Normal", reason="RecreateDeferred", message=message)
        memory.pending_recreates[(namespace, name, group.name)] = reason
        return False
    _delete_pods(memory, namespace, decision.delete)
    memory.forget(namespace, name, group.name)
    kopf.event(owner, type="Warning", reason="GroupRecreated", message=f"group {group.name} recreated: {reason}")
    return True


def recreate_waiting(memory: OperatorMemory, owner: dict[str, Any], spec: dict[str, Any]) -> set[str]:
    """Carry out the recreates that waited for a Pending pod where none is Pending now; says which ran."""
    meta = owner["metadata"]
    if not memory.pending_for(meta["namespace"], meta["name"]):
        return set()
    observed = _observe(memory, owner, spec)
    return {g.name for g in observed.groups
            if g.pending_recreate is not None and _recreate(memory, owner, g, g.pending_recreate)}


@kopf.timer(GROUP, VERSION, PLURAL, interval=STATUS_INTERVAL_SECONDS, initial_delay=STATUS_INTERVAL_SECONDS)
def refresh(body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Keep status current and carry out recreates that waited for a Pending pod."""
    memory = _memory(memo)
    try:
        spec = normalize(dict(body.spec))
    except SpecError:
        return
    with memory.lock(namespace, name):
        restarted = recreate_waiting(memory, dict(body), spec)
        _write_status(memory, namespace, name, spec, body.metadata.get("generation"), restarted)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def forget(name: str, namespace: str, logger: logging.Logger, memo: kopf.Memo, **_: Any) -> None:
    """The children go by owner references; drop what the operator remembered about them."""
    memory = _memory(memo)
    with memory.lock(namespace, name):
        memory.forget(namespace, name)
    logger.info(f"{name}: deleted; its groups and coordinator go with it")


@kopf.on.event("pods", labels={m.LABEL_COMPONENT: "rank", m.LABEL_MANAGED_BY: "lockstep-operator"})
def rank_pod_changed(event: dict[str, Any], namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A rank that restarted or vanished breaks its torch.distributed group: recreate the whole group."""
    memory = _memory(memo)
    labels = event["object"]["metadata"].get("labels", {})
    name, group = labels.get(m.LABEL_INSTANCE), labels.get(m.LABEL_GROUP)
    if not name or not group:
        return
    pod = pod_state(event["object"])
    ours = pod.uid in memory.deleted_by_us
    if ours and event["type"] == "DELETED":
        memory.deleted_by_us.discard(pod.uid)
    reason = recreate_reason(event["type"], pod, ours, memory.pending_recreates.get((namespace, name, group)))
    if reason is None:
        return
    with memory.lock(namespace, name):
        owner = memory.kube.get(KIND, namespace, name)
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            return
        try:
            spec = normalize(owner.get("spec"))
        except SpecError:
            return
        state = _observe(memory, owner, spec).group(group)
        if state is None or not state.exists:
            return
        recreated = _recreate(memory, owner, state, reason)
        _write_status(memory, namespace, name, spec, owner["metadata"].get("generation"),
                      {group} if recreated else ())
