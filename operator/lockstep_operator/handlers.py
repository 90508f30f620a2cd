"""kopf handlers: LockstepDeployments in, groups of rank pods and a coordinator out.

Level-based: every handler recomputes the desired objects with the pure builders of `manifests.py`
and applies them idempotently, so a retry, an operator restart (`on.resume`) or a replayed event
does the same thing again. Decisions about one group (recreate it, roll it) are taken under that
deployment's lock, so the resource handlers and the pod watcher never act on a group at once.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any

import kopf

from lockstep_operator import manifests as m
from lockstep_operator.crd import GROUP, KIND, PLURAL, VERSION
from lockstep_operator.kube import Kube, contains, default_api_client
from lockstep_operator.resource import SpecError, check_name, normalize

RETRY_SECONDS = float(os.environ.get("LOCKSTEP_OPERATOR_RETRY_SECONDS", "15"))
STATUS_INTERVAL_SECONDS = float(os.environ.get("LOCKSTEP_OPERATOR_STATUS_INTERVAL_SECONDS", "30"))

_kube: Kube | None = None
_locks: dict[tuple[str, str], threading.RLock] = {}
_locks_guard = threading.Lock()
# Pods this operator deleted itself (by uid): their deletion is not a rank failure.
_deleted_by_us: set[str] = set()
# Groups that must be recreated once none of their pods is Pending: (ns, name, group) -> reason.
_wanted: dict[tuple[str, str, str], str] = {}


def set_kube(kube: Kube | None) -> None:
    """Use this client instead of the in-cluster / kubeconfig one (tests point it at KMock)."""
    global _kube
    _kube = kube


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube(default_api_client())
    return _kube


def _lock(namespace: str, name: str) -> threading.RLock:
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.RLock())


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations: the structural status schema has no room for it."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.level = logging.INFO
    settings.peering.standalone = True


def _apply(obj: dict[str, Any], owner: dict[str, Any]) -> str:
    """Create the object or patch it to the desired state; says which (or 'unchanged')."""
    kopf.adopt(obj, owner=owner)
    meta = obj["metadata"]
    current = kube().get(obj["kind"], meta["namespace"], meta["name"])
    if current is None:
        kube().create(obj)
        return "created"
    desired = {k: v for k, v in obj.items() if k in ("metadata", "spec")}
    if contains(current, desired):
        return "unchanged"
    kube().patch(obj["kind"], meta["namespace"], meta["name"], desired)
    return "patched"


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _pods(namespace: str, name: str, group: str) -> list[dict[str, Any]]:
    return kube().list("Pod", namespace, m.selector(name, "rank", group))


def _group_ready(namespace: str, name: str, sts: dict[str, Any]) -> int:
    """Ranks of the group that are ready and run the StatefulSet's current template."""
    group = sts["metadata"]["name"]
    want = sts["spec"]["template"]["metadata"]["annotations"][m.ANNOTATION_HASH]
    return sum(1 for p in _pods(namespace, name, group)
               if _pod_ready(p) and p["metadata"].get("annotations", {}).get(m.ANNOTATION_HASH) == want
               and not p["metadata"].get("deletionTimestamp"))


def _recreate(namespace: str, name: str, group: str, owner: dict[str, Any], reason: str) -> bool:
    """Delete every pod of the group (the StatefulSet makes them anew), unless one is still Pending."""
    pods = [p for p in _pods(namespace, name, group) if not p["metadata"].get("deletionTimestamp")]
    pending = [p["metadata"]["name"] for p in pods if p.get("status", {}).get("phase") == "Pending"]
    if pending:
        if _wanted.get((namespace, name, group)) != reason:
            message = f"group {group} to be recreated ({reason}) once {', '.join(pending)} is not Pending"
            kopf.event(owner, type="Normal", reason="RecreateDeferred", message=message)
        _wanted[(namespace, name, group)] = reason
        return False
    for pod in pods:
        _deleted_by_us.add(pod["metadata"]["uid"])
        kube().delete("Pod", namespace, pod["metadata"]["name"])
    _wanted.pop((namespace, name, group), None)
    kopf.event(owner, type="Warning", reason="GroupRecreated", message=f"group {group} recreated: {reason}")
    return True


def _status(namespace: str, name: str, spec: dict[str, Any], generation: int | None,
            restarted: str | None = None) -> dict[str, Any]:
    """Observe the groups and write status; `restarted` names a group whose restart count grows."""
    current = kube().get(KIND, namespace, name) or {}
    previous = {g["name"]: g for g in current.get("status", {}).get("groups", [])}
    groups = []
    for i in range(spec["groups"]):
        g = m.group_name(name, i)
        sts = kube().get("StatefulSet", namespace, g)
        ready_ranks = _group_ready(namespace, name, sts) if sts else 0
        restarts = previous.get(g, {}).get("restarts", 0) + (1 if g == restarted else 0)
        groups.append({"name": g, "ready": ready_ranks == spec["tensorParallelSize"],
                       "readyRanks": ready_ranks, "restarts": restarts,
                       "pendingRecreate": (namespace, name, g) in _wanted})
    ready = sum(g["ready"] for g in groups)
    total = spec["groups"]
    if total == 0:
        phase, message = "Pending", "no groups requested"
    elif ready == total:
        phase, message = "Ready", f"all {total} groups ready"
    elif ready > 0 or any(g["pendingRecreate"] for g in groups):
        phase, message = "Degraded", f"{ready}/{total} groups ready"
    else:
        phase, message = "Progressing", f"{ready}/{total} groups ready"
    old = {c["type"]: c for c in current.get("status", {}).get("conditions", [])}
    now = _now()

    def condition(kind: str, value: bool, reason: str) -> dict[str, Any]:
        status = "True" if value else "False"
        before = old.get(kind, {})
        since = before.get("lastTransitionTime") if before.get("status") == status else None
        c = {"type": kind, "status": status, "reason": reason, "message": message,
             "lastTransitionTime": since or now}
        if generation is not None:
            c["observedGeneration"] = generation
        return c

    status: dict[str, Any] = {
        "phase": phase,
        "replicas": total,
        "readyGroups": ready,
        "selector": m.rank_selector_string(name),
        "endpoint": m.endpoint(name, namespace, spec),
        "groups": groups,
        "conditions": [
            condition("Ready", phase == "Ready", "AllGroupsReady" if phase == "Ready" else "GroupsNotReady"),
            condition("Progressing", phase == "Progressing",
                      "GroupsStarting" if phase == "Progressing" else "Stable"),
            condition("Degraded", phase == "Degraded", "GroupsDown" if phase == "Degraded" else "AsExpected"),
        ],
    }
    if generation is not None:
        status["observedGeneration"] = generation
    kube().patch(KIND, namespace, name, {"status": status}, subresource="status")
    return status


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _invalid(body: kopf.Body, error: SpecError) -> kopf.PermanentError:
    kopf.event(body, type="Warning", reason="InvalidSpec", message=str(error))
    kube().patch(KIND, body.metadata.namespace, body.metadata.name, {"status": {
        "phase": "Degraded", "observedGeneration": body.metadata.get("generation"),
        "conditions": [{"type": "Degraded", "status": "True", "reason": "InvalidSpec", "message": str(error),
                        "lastTransitionTime": _now()}],
    }}, subresource="status")
    return kopf.PermanentError(str(error))


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(body: kopf.Body, name: str, namespace: str, logger: logging.Logger, **_: Any) -> None:
    """Make the cluster match the spec; roll changed groups one at a time."""
    try:
        check_name(name)
        spec = normalize(dict(body.spec))
    except SpecError as e:
        raise _invalid(body, e) from e
    owner = dict(body)
    with _lock(namespace, name):
        rolls = []
        for i in range(spec["groups"]):
            g = m.group_name(name, i)
            svc, sts, *rest = m.group_manifests(name, namespace, spec, i)
            for obj in (svc, *rest):
                _apply(obj, owner)
            current = kube().get("StatefulSet", namespace, g)
            if current is None:
                logger.info(f"group {g}: {_apply(sts, owner)}")
            elif not contains(current, {"spec": {"replicas": sts["spec"]["replicas"],
                                                 "template": sts["spec"]["template"]}}):
                rolls.append((g, sts))
        _remove_extra_groups(namespace, name, spec["groups"], logger)
        _apply(m.coordinator_service(name, namespace, spec), owner)
        _apply(m.coordinator_deployment(name, namespace, spec), owner)
        if rolls:
            _roll_one(namespace, name, spec, rolls, owner, logger)
        _status(namespace, name, spec, body.metadata.get("generation"))
    if len(rolls) > 1:
        raise kopf.TemporaryError(f"{len(rolls) - 1} more group(s) to roll after {rolls[0][0]}",
                                  delay=RETRY_SECONDS)


def _roll_one(namespace: str, name: str, spec: dict[str, Any], rolls: list[tuple[str, dict[str, Any]]],
              owner: dict[str, Any], logger: logging.Logger) -> None:
    """Roll the first changed group, but only while every group already rolled is serving again.

    A group that is rolled is down; rolling one at a time keeps the others serving. If nothing serves
    anyway (no group ready), waiting protects nobody, so the roll goes ahead.
    """
    changed = {g for g, _ in rolls}
    rolled_not_ready = []
    any_ready = False
    for i in range(spec["groups"]):
        g = m.group_name(name, i)
        sts = kube().get("StatefulSet", namespace, g)
        if sts is None:
            continue
        ready = _group_ready(namespace, name, sts) == sts["spec"]["replicas"]
        any_ready = any_ready or ready
        if g not in changed and not ready:
            rolled_not_ready.append(g)
    if rolled_not_ready and any_ready:
        raise kopf.TemporaryError(f"waiting for {', '.join(rolled_not_ready)} to be ready before rolling "
                                  f"{rolls[0][0]}", delay=RETRY_SECONDS)
    g, sts = rolls[0]
    logger.info(f"group {g}: rolling to the new spec")
    _apply(sts, owner)
    for pod in _pods(namespace, name, g):
        _deleted_by_us.add(pod["metadata"]["uid"])
        kube().delete("Pod", namespace, pod["metadata"]["name"])
    kopf.event(owner, type="Normal", reason="GroupRolled", message=f"group {g} rolled to the new spec")


def _remove_extra_groups(namespace: str, name: str, groups: int, logger: logging.Logger) -> None:
    """Scaling down removes whole groups: StatefulSet, Service, NetworkPolicy."""
    for sts in kube().list("StatefulSet", namespace, m.selector(name, "rank")):
        g = sts["metadata"]["name"]
        index = g.rsplit("-g", 1)[-1]
        if g.startswith(f"{name}-g") and index.isdigit() and int(index) >= groups:
            logger.info(f"group {g}: removed (groups={groups})")
            for kind in ("StatefulSet", "Service", "NetworkPolicy"):
                kube().delete(kind, namespace, g)
            for key in [k for k in _wanted if k[:2] == (namespace, name) and k[2] == g]:
                _wanted.pop(key)


@kopf.timer(GROUP, VERSION, PLURAL, interval=STATUS_INTERVAL_SECONDS, initial_delay=STATUS_INTERVAL_SECONDS)
def refresh(body: kopf.Body, name: str, namespace: str, **_: Any) -> None:
    """Keep status current and carry out recreates that waited for a Pending pod."""
    try:
        spec = normalize(dict(body.spec))
    except SpecError:
        return
    with _lock(namespace, name):
        restarted = None
        for (ns, n, g), reason in list(_wanted.items()):
            if (ns, n) == (namespace, name) and _recreate(namespace, name, g, dict(body), reason):
                restarted = g
        _status(namespace, name, spec, body.metadata.get("generation"), restarted)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def forget(name: str, namespace: str, logger: logging.Logger, **_: Any) -> None:
    """The children go by owner references; drop what the operator remembered about them."""
    with _lock(namespace, name):
        for key in [k for k in _wanted if k[:2] == (namespace, name)]:
            _wanted.pop(key)
    logger.info(f"{name}: deleted; its groups and coordinator go with it")


def _rank_restarted(pod: dict[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses", [])
    return any(s.get("name") == "rank" and s.get("restartCount", 0) > 0 for s in statuses)


@kopf.on.event("pods", labels={m.LABEL_COMPONENT: "rank", m.LABEL_MANAGED_BY: "lockstep-operator"})
def rank_pod_changed(event: dict[str, Any], namespace: str, **_: Any) -> None:
    """A rank that restarted or vanished breaks its torch.distributed group: recreate the whole group."""
    pod = event["object"]
    meta = pod["metadata"]
    name, group = meta["labels"].get(m.LABEL_INSTANCE), meta["labels"].get(m.LABEL_GROUP)
    if not name or not group:
        return
    if meta.get("uid") in _deleted_by_us:
        if event["type"] == "DELETED":
            _deleted_by_us.discard(meta["uid"])
        return
    if event["type"] == "DELETED":
        reason = f"rank pod {meta['name']} was deleted"
    elif _rank_restarted(pod) and not meta.get("deletionTimestamp"):
        reason = f"rank pod {meta['name']} restarted"
    elif (namespace, name, group) in _wanted:
        reason = _wanted[(namespace, name, group)]
    else:
        return
    with _lock(namespace, name):
        owner = kube().get(KIND, namespace, name)
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            return
        if kube().get("StatefulSet", namespace, group) is None:
            return
        try:
            spec = normalize(owner.get("spec"))
        except SpecError:
            return
        recreated = _recreate(namespace, name, group, owner, reason)
        _status(namespace, name, spec, owner["metadata"].get("generation"), group if recreated else None)
