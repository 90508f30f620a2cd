"""kopf handlers: LockstepDeployments in, groups of rank pods and a coordinator out.

Every handler does three things: observe the cluster into plain states (`observe.py`), decide with
the pure functions of `decisions.py`, and carry out what they return. Level-based: the desired objects
are rebuilt by the pure builders of `manifests.py` and applied idempotently, so a retry, an operator
restart (`on.resume`) or a replayed event does the same thing again. What the operator remembers
between calls lives in kopf's memo (`memory.py`); decisions about one deployment are taken under its
lock, so the resource handlers and the pod watcher never act on a group at once.

Before a group is rolled, recreated or removed it is drained through the coordinator (`drain.py` decides,
`drainer.py` carries it out): the handlers only pass the group through `drainer.gate` and retry while it
says wait; the `drive_drains` daemon asks the coordinator (async, each request bounded) and resumes a
drained group once it serves again; deleting the resource drains every group first. Drains live in the
operator's memory, so after a restart the daemon first takes back, from the coordinator's /health, those it
had asked (`drainer.adopt`). The status timer also reads /health for the Degraded condition.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import secrets
import time
from collections.abc import Collection, Iterable
from typing import Any, NoReturn

import kopf

from lockstep_operator import coordinator_client, drainer
from lockstep_operator import manifests as m
from lockstep_operator.crd import GROUP, KIND, PLURAL, VERSION
from lockstep_operator.decisions import (
    CoordinatorView,
    Rollout,
    decide_recreate,
    decide_rollout,
    decide_status,
    invalid_status,
    recreate_reason,
    serving,
)
from lockstep_operator.drain import (
    RECREATE,
    REMOVE,
    ROLL,
    coordinator_group,
    others_serve,
    stale_drains,
    stalled_groups,
)
from lockstep_operator.kube import Kube, KubeError, default_api_client
from lockstep_operator.memory import MEMO_KEY, MEMO_KUBE, OperatorMemory
from lockstep_operator.observe import GroupState, Observed, PodState, observe, pod_state
from lockstep_operator.resource import SpecError, check_buildable, check_name, normalize

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
    drainer.quiet_drain_waits()
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
                  generation: int | None, restarted: Collection[str] = ()) -> Observed | None:
    """Observe again (after what was just carried out) and write the status it decides."""
    current = memory.kube.get(KIND, namespace, name)
    if current is None:
        return None
    observed = _observe(memory, current, spec)
    view = CoordinatorView(drains=memory.drains_for(namespace, name),
                           last_drain=memory.drain_outcomes.get((namespace, name)),
                           stalled=memory.stalled.get((namespace, name)),
                           health=memory.health.get((namespace, name)),
                           resuming=tuple(memory.resumes_for(namespace, name)),
                           adopting=not memory.adoption_tried(namespace, name))
    status = decide_status(observed, spec, generation, _now(), restarted, view)
    if status != current.get("status"):  # an unchanged status is not written: each write is a watch event
        memory.kube.patch(KIND, namespace, name, {"status": status}, subresource="status")
    return observed


def _serving(observed: Observed) -> dict[str, bool]:
    return {g.name: serving(g) for g in observed.groups}


def _holds_work(group: GroupState) -> bool:
    """Some rank of the group is ready, so the coordinator may be running requests on it."""
    return any(p.ready and not p.terminating for p in group.pods)


def _spec_or_report(memory: OperatorMemory, body: kopf.Body) -> dict[str, Any]:
    """The normalized spec; an invalid one is reported (event, Degraded status) and never retried."""
    try:
        check_name(body.metadata.name)
        spec = normalize(dict(body.spec))
        check_buildable(body.metadata.name, spec)
        return spec
    except SpecError as e:
        _refuse(memory, body, str(e), e)


def _refuse(memory: OperatorMemory, body: kopf.Body, message: str, cause: Exception) -> NoReturn:
    """Report a spec that cannot be served (event, Degraded status) and stop: it is not retried until it changes."""
    kopf.event(body, type="Warning", reason="InvalidSpec", message=message)
    status = invalid_status(message, body.metadata.get("generation"), _now())
    memory.kube.patch(KIND, body.metadata.namespace, body.metadata.name, {"status": status}, subresource="status")
    raise kopf.PermanentError(message) from cause


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(body: kopf.Body, name: str, namespace: str, logger: logging.Logger, memo: kopf.Memo,
              **_: Any) -> None:
    """Make the cluster match the spec; roll changed groups one at a time."""
    memory = _memory(memo)
    spec = _spec_or_report(memory, body)
    try:
        _reconcile(memory, body, spec, name, namespace, logger)
    except KubeError as e:
        if e.status not in (400, 422):  # anything else may pass (a conflict, a quota, a server restarting)
            raise
        _refuse(memory, body, f"the API server refused an object built from this spec: {e}", e)


def _reconcile(memory: OperatorMemory, body: kopf.Body, spec: dict[str, Any], name: str, namespace: str,
               logger: logging.Logger) -> None:
    owner = dict(body)
    with memory.lock(namespace, name):
        _create_group_token(memory, owner, logger)
        observed = _observe(memory, owner, spec)
        rollout = decide_rollout(observed.groups)
        _apply_groups(memory, owner, spec, rollout, logger)
        _end_stale_drains(memory, observed, rollout)
        # Removed and rolled groups are drained first; the coordinator keeps its old groups meanwhile.
        draining = _remove_groups(memory, owner, spec, observed, logger)
        if not draining and rollout.roll is not None and not _roll_gate(memory, owner, spec, observed, rollout.roll):
            draining = [observed.groups[rollout.roll].name]
        if draining:
            _write_status(memory, namespace, name, spec, body.metadata.get("generation"))
            raise kopf.TemporaryError(f"{drainer.DRAIN_WAIT}{', '.join(draining)}", delay=drainer.RECHECK_SECONDS)
        memory.kube.apply(_owned(m.coordinator_service(name, namespace, spec), owner))
        # The group list after the removed groups drained and went: the coordinator moves nothing off them
        # any more. Its pod template does not change with the groups, so it is not restarted.
        memory.kube.apply(_owned(m.groups_configmap(name, namespace, spec), owner))
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
    """Every group's Service and NetworkPolicy (deleted when the spec turned them off); the StatefulSets of new
    groups; labels of old ones."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    for i in range(spec["groups"]):
        svc, sts, *rest = m.group_manifests(name, namespace, spec, i)
        for obj in (svc, *rest):
            memory.kube.apply(_owned(obj, owner))
        if not rest:
            memory.kube.delete("NetworkPolicy", namespace, m.group_name(name, i))
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
    memory.end_drain((namespace, name, group.name), resume=True)
    kopf.event(owner, type="Normal", reason="GroupRolled", message=f"group {group.name} rolled to the new spec")


def _roll_gate(memory: OperatorMemory, owner: dict[str, Any], spec: dict[str, Any], observed: Observed,
               index: int) -> bool:
    """Whether the group may be rolled now: drained (or given up on), or nothing to drain."""
    group = observed.groups[index]
    return drainer.gate(memory, owner, spec, (observed.namespace, observed.name, group.name), coordinator_group(index),
                        ROLL, others_serve(_serving(observed), group.name), _holds_work(group)).proceed


def _end_stale_drains(memory: OperatorMemory, observed: Observed, rollout: Rollout) -> None:
    """Drains of groups no longer about to go (the spec went back, the roll waits) end: resumed once serving."""
    wanted = {*observed.strays, *memory.pending_for(observed.namespace, observed.name)}
    if rollout.roll is not None:
        wanted.add(observed.groups[rollout.roll].name)
    for g in stale_drains(memory.drains_for(observed.namespace, observed.name), wanted):
        memory.end_drain((observed.namespace, observed.name, g), resume=True)


def _remove_groups(memory: OperatorMemory, owner: dict[str, Any], spec: dict[str, Any], observed: Observed,
                   logger: logging.Logger) -> list[str]:
    """Scaling down removes whole groups (StatefulSet, Service, NetworkPolicy), each once drained; says
    which still drain."""
    waiting = []
    for g in observed.strays:
        key = (observed.namespace, observed.name, g)
        index = observed.stray_index.get(g)
        step = drainer.gate(memory, owner, spec, key, coordinator_group(index) if index is not None else None,
                            REMOVE, others_serve(_serving(observed), g))
        if not step.proceed:
            waiting.append(g)
            continue
        logger.info(f"group {g}: removed (groups={spec['groups']})")
        for kind in ("StatefulSet", "Service", "NetworkPolicy"):
            memory.kube.delete(kind, observed.namespace, g)
        memory.forget(observed.namespace, observed.name, g)
        memory.end_drain(key, resume=False)
    return waiting


def _recreate(memory: OperatorMemory, owner: dict[str, Any], spec: dict[str, Any], group: GroupState, reason: str,
              others: bool) -> bool:
    """Recreate the group as `decide_recreate` says once drained (`others`: another group serves), or
    remember to once no pod is Pending or the drain ends; True if done."""
    namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    key = (namespace, name, group.name)
    decision = decide_recreate(group, reason)
    if decision.deferred:
        if decision.announce:
            message = f"group {group.name} to be recreated ({reason}) once {', '.join(decision.blocked_by)} " \
                      "is not Pending"
            kopf.event(owner, type="Normal", reason="RecreateDeferred", message=message)
        memory.pending_recreates[key] = reason
        return False
    if not drainer.gate(memory, owner, spec, key, coordinator_group(group.index), RECREATE, others).proceed:
        memory.pending_recreates[key] = reason  # the drive timer comes back once the drain ends
        return False
    _delete_pods(memory, namespace, decision.delete)
    memory.forget(namespace, name, group.name)
    memory.end_drain(key, resume=True)
    kopf.event(owner, type="Warning", reason="GroupRecreated", message=f"group {group.name} recreated: {reason}")
    return True


def recreate_waiting(memory: OperatorMemory, owner: dict[str, Any], spec: dict[str, Any]) -> set[str]:
    """Carry out the recreates that waited for a Pending pod where none is Pending now; says which ran."""
    meta = owner["metadata"]
    if not memory.pending_for(meta["namespace"], meta["name"]):
        return set()
    observed = _observe(memory, owner, spec)
    serving_now = _serving(observed)
    return {g.name for g in observed.groups
            if g.pending_recreate is not None
            and _recreate(memory, owner, spec, g, g.pending_recreate, others_serve(serving_now, g.name))}


def _refresh(memory: OperatorMemory, owner: dict[str, Any], spec: dict[str, Any]) -> dict[str, str]:
    """Carry out recreates that waited, write the status, and say which drained groups serve again
    (group -> coordinator group), to be resumed."""
    meta = owner["metadata"]
    with memory.lock(meta["namespace"], meta["name"]):
        restarted = recreate_waiting(memory, owner, spec)
        observed = _write_status(memory, meta["namespace"], meta["name"], spec, meta.get("generation"), restarted)
        if observed is None:
            return {}
        up = _serving(observed)
        return {g: c for g, c in memory.resumes_for(meta["namespace"], meta["name"]).items() if up.get(g)}


@kopf.timer(GROUP, VERSION, PLURAL, interval=STATUS_INTERVAL_SECONDS, initial_delay=STATUS_INTERVAL_SECONDS)
async def refresh(body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Keep status current (with the coordinator's stalled agreement waits), carry out recreates that
    waited for a Pending pod, and resume drained groups that serve again."""
    memory = _memory(memo)
    try:
        spec = normalize(dict(body.spec))
    except SpecError:
        return
    root, key = drainer.endpoint(body, spec)
    text, health = await asyncio.gather(coordinator_client.metrics(root), coordinator_client.health(root))
    memory.stalled[(namespace, name)] = None if text is None else stalled_groups(text)
    memory.health[(namespace, name)] = health
    due = await asyncio.to_thread(_refresh, memory, dict(body), spec)
    await drainer.resume_due(memory, body, due, root, key)


async def _drive_once(memory: OperatorMemory, body: kopf.Body, name: str, namespace: str) -> None:
    """Take back the drains of before a restart (once), ask the coordinator about the open drains, carry out
    what waited for them, resume what serves again."""
    now = time.time()
    adopt = (namespace, name) not in memory.adopted and now >= memory.next_adopt_check.get((namespace, name), 0.0)
    if not adopt and not drainer.has_work(memory, namespace, name, now):
        return
    try:
        spec = normalize(dict(body.spec))
    except SpecError:
        return
    root, key = drainer.endpoint(body, spec)
    if adopt:
        await drainer.adopt_once(memory, dict(body), spec, root)
        if not drainer.has_work(memory, namespace, name, time.time()):
            return
    await drainer.drive(memory, namespace, name, root, key)
    due = await asyncio.to_thread(_refresh, memory, dict(body), spec)
    await drainer.resume_due(memory, body, due, root, key)


# A daemon rather than a timer: a timer would log (and post as an Event) every tick's success.
@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=1.0)
async def drive_drains(stopped: kopf.DaemonStopped, body: kopf.Body, name: str, namespace: str, memo: kopf.Memo,
                       logger: logging.Logger, **_: Any) -> None:
    """While a drain or a resume is open, every POLL_SECONDS: ask the coordinator (each request bounded, on
    kopf's loop, never blocking a thread), carry out what waited for the answer, resume what serves again."""
    memory = _memory(memo)
    while not stopped:
        try:
            await _drive_once(memory, body, name, namespace)
        except Exception as e:  # noqa: BLE001 - a failed tick is retried at the next one
            logger.warning(f"drain tick failed, retrying in {drainer.POLL_SECONDS}s: {e}")
        await asyncio.sleep(drainer.POLL_SECONDS)  # kopf cancels it on exit (its own `stopped.wait` leaks a task)


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def forget(body: kopf.Body, name: str, namespace: str, logger: logging.Logger, memo: kopf.Memo,
                 **_: Any) -> None:
    """Drain every group (bounded by the deadline), then let the owner references take the children; drop
    what the operator remembered about them."""
    memory = _memory(memo)
    try:
        spec = normalize(dict(body.spec))
    except SpecError:
        spec = None
    if spec is not None:
        await drainer.drain_before_delete(memory, dict(body), spec)

    def drop() -> None:  # in a thread: a reconcile may hold the lock through its API calls
        with memory.lock(namespace, name):
            memory.forget(namespace, name)
    await asyncio.to_thread(drop)
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
        observed = _observe(memory, owner, spec)
        state = observed.group(group)
        if state is None or not state.exists:
            return
        recreated = _recreate(memory, owner, spec, state, reason, others_serve(_serving(observed), group))
        _write_status(memory, namespace, name, spec, owner["metadata"].get("generation"),
                      {group} if recreated else ())
