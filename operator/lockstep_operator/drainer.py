"""Carrying out the drain decisions of `drain.py`: the gate the handlers pass a group through before they
roll, recreate or remove it, and the async steps that talk to the coordinator (`coordinator_client.py`).

The handlers are synchronous (kopf runs them in worker threads) and never wait on the network: the gate
only records that a drain is wanted and says whether to go on; the async timer in `handlers.py` asks the
coordinator, one bounded request per drain per tick, and stores the answers in the operator's memory.
The delete handler, which runs when the timers are already stopped, drives its drains itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from lockstep_operator import coordinator_client as client
from lockstep_operator import manifests as m
from lockstep_operator.decisions import decide_rollout, serving
from lockstep_operator.drain import (
    PROCEED,
    RECREATE,
    REMOVE,
    ROLL,
    START,
    Answer,
    DrainStep,
    adopt_drains,
    after_answer,
    api_key,
    coordinator_group,
    coordinator_url,
    decide_drain,
    from_iso,
    iso,
    new_drain,
    others_serve,
    poll_timeout,
)
from lockstep_operator.memory import OperatorMemory
from lockstep_operator.observe import GroupKey, observe

# How often open drains are asked about again.
POLL_SECONDS = float(os.environ.get("LOCKSTEP_OPERATOR_DRAIN_POLL_SECONDS", "1"))
# How soon a reconcile that waits for a drain looks again (each wait is a kopf retry, logged and posted
# as an event, so not every poll): how long a drained group may idle before it is rolled or removed.
RECHECK_SECONDS = float(os.environ.get("LOCKSTEP_OPERATOR_DRAIN_RECHECK_SECONDS", "5"))
# The longest one drain request waits for the coordinator's answer before it is asked again.
WAIT_SECONDS = float(os.environ.get("LOCKSTEP_OPERATOR_DRAIN_WAIT_SECONDS", "5"))
# With no drain open, how often drained groups are looked at (and resumed once they serve, or asked again
# when the coordinator could not be reached): a group being rolled takes minutes to load its model.
RESUME_POLL_SECONDS = float(os.environ.get("LOCKSTEP_OPERATOR_RESUME_POLL_SECONDS", "5"))
# Read at each call: LOCKSTEP_OPERATOR_COORDINATOR_URL, the coordinator's HTTP root instead of its Service
# (tests; may name {name}, {namespace}, {port}), and LOCKSTEP_OPERATOR_API_KEY, the operator's Bearer key
# for /admin/* when the deployment's spec.env does not set LOCKSTEP_API_KEY.

Clock = Callable[[], float]
log = logging.getLogger("lockstep.operator.drain")

_EVENT_TYPES = {"Drained": "Normal", "NothingToDrain": "Normal", "DrainDisabled": "Normal"}
# How a reconcile that waits for a drain begins its kopf.TemporaryError message (see DrainWaitFilter).
DRAIN_WAIT = "waiting for the coordinator to drain "


class DrainWaitFilter(logging.Filter):
    """kopf logs every retry of a handler that raised TemporaryError at ERROR, and posts it as an Error event:
    a reconcile that waits for a drain would post one every RECHECK_SECONDS. The drain posts its own events
    (one when it starts, one when it ends), so these retries are logged at INFO and not posted."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"failed temporarily: {DRAIN_WAIT}" in record.getMessage():
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.k8s_skip = True  # kopf's event poster skips such records
        return True


def quiet_drain_waits(logger: logging.Logger | None = None) -> None:
    """Install DrainWaitFilter on kopf's per-object logger once (an operator restarted in-process keeps it)."""
    target = logger or logging.getLogger("kopf.objects")
    if not any(isinstance(f, DrainWaitFilter) for f in target.filters):
        target.addFilter(DrainWaitFilter())


def endpoint(owner: Mapping[str, Any], spec: Mapping[str, Any]) -> tuple[str, str]:
    """The coordinator's HTTP root and the API key to send it."""
    meta = owner["metadata"]
    override = os.environ.get("LOCKSTEP_OPERATOR_COORDINATOR_URL", "")
    return (coordinator_url(meta["name"], meta["namespace"], spec, override),
            api_key(spec, os.environ.get("LOCKSTEP_OPERATOR_API_KEY", "")))


def gate(memory: OperatorMemory, owner: dict[str, Any], spec: Mapping[str, Any], key: GroupKey,
         target: str | None, why: str, migrate: bool, holds_work: bool = True,
         clock: Clock = time.time) -> DrainStep:
    """Whether group `key` may be rolled, recreated or removed now; starts its drain when one is due.

    A START is recorded (the async timer asks the coordinator) and answered as a wait; until the drains of
    before an operator restart were looked for (`adopt`), it is only a wait, so that a drain still running
    is not started again (a second event, a new deadline). A PROCEED that ends a drain is logged, posted as
    an event and kept as the Draining condition's last outcome.
    """
    if target is None:  # a StatefulSet without its group-index label: its coordinator name is unknown
        return DrainStep(PROCEED, "NothingToDrain", f"group {key[2]} has no coordinator name to drain")
    timeout = spec["rollout"]["drainTimeoutSeconds"]
    record = memory.drains.get(key)
    now = clock()
    step = decide_drain(record, timeout, now, holds_work)
    if step.action == START and not memory.adoption_tried(key[0], key[1]):
        return DrainStep("wait", "DrainInProgress", "looking for the coordinator's drains before starting one")
    if step.action == START:
        memory.drains[key] = new_drain(target, why, migrate, now, timeout)
        memory.resumes.pop(key, None)  # a drain asked again supersedes a resume still to come
        message = (f"draining group {key[2]} (coordinator group {target}) before its {why}, "
                   f"for at most {timeout}s{' (moving its requests to other groups)' if migrate else ''}")
        log.info(message)
        kopf.event(owner, type="Normal", reason="DrainStarted", message=message)
        return DrainStep("wait", "DrainInProgress", message)
    if step.action == PROCEED and record is not None:
        message = f"group {key[2]}: {step.message}; {why} goes ahead"
        memory.drain_outcomes[key[:2]] = (step.reason, message)
        (log.info if step.reason == "Drained" else log.warning)(message)
        kopf.event(owner, type=_EVENT_TYPES.get(step.reason, "Warning"), reason=step.reason, message=message)
    return step


async def _ask(memory: OperatorMemory, key: GroupKey, root: str, key_: str, clock: Clock) -> Answer | None:
    """One bounded drain request for one record; its answer stored unless the record changed meanwhile."""
    record = memory.drains.get(key)
    if record is None:
        return None
    wait = poll_timeout(record, clock(), WAIT_SECONDS)
    if wait is None:
        return None
    answer, detail = await client.drain(root, record.group, record.migrate, key_, wait)
    memory.update_drain(key, record, after_answer(record, answer, detail))
    if answer is not Answer.PENDING:
        log.info(f"drain of {key[2]} ({record.group}) at {root}: {answer.value} {detail}".rstrip())
    return answer


async def drive(memory: OperatorMemory, namespace: str, name: str, root: str, key_: str,
                clock: Clock = time.time) -> list[Answer]:
    """Ask the coordinator once about every open drain of one deployment (concurrently, each bounded)."""
    keys = [(namespace, name, g) for g in memory.drains_for(namespace, name)]
    answers = await asyncio.gather(*(_ask(memory, k, root, key_, clock) for k in keys))
    return [a for a in answers if a is not None]


def has_work(memory: OperatorMemory, namespace: str, name: str, now: float) -> bool:
    """Whether a drain tick has anything to do: an open drain, or resumes whose next look is due."""
    if memory.drains_for(namespace, name):
        return True
    return bool(memory.resumes_for(namespace, name)) and now >= memory.next_resume_check.get((namespace, name), 0.0)


async def resume_due(memory: OperatorMemory, owner: Mapping[str, Any], due: Mapping[str, str], root: str,
                     key_: str) -> None:
    """`POST /admin/resume` for the groups that serve again; kept for the next tick if it did not reach."""
    meta = owner["metadata"]
    for group, target in due.items():
        answer, detail = await client.resume(root, target, key_)
        if answer is Answer.UNREACHABLE:
            log.info(f"resume of {group} ({target}) did not reach the coordinator: {detail}")
            continue
        memory.resumes.pop((meta["namespace"], meta["name"], group), None)
        if answer is Answer.DONE:
            kopf.event(dict(owner), type="Normal", reason="GroupResumed",
                       message=f"group {group} serves again: the coordinator routes to {target}")
        else:
            kopf.event(dict(owner), type="Warning", reason="ResumeRefused",
                       message=f"the coordinator refused to resume {target}: {detail}")
    if memory.resumes_for(meta["namespace"], meta["name"]):
        memory.next_resume_check[(meta["namespace"], meta["name"])] = time.time() + RESUME_POLL_SECONDS


async def drain_before_delete(memory: OperatorMemory, owner: dict[str, Any], spec: Mapping[str, Any],
                              clock: Clock = time.time) -> None:
    """Drain every group of a deployment being deleted (nowhere to migrate to), as far as the deadline
    allows; the owner references then take the groups and the coordinator."""
    namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    root, key_ = endpoint(owner, spec)
    await adopt_once(memory, owner, spec, root, clock)
    left = set(range(spec["groups"]))
    while True:
        for i in sorted(left):
            key = (namespace, name, m.group_name(name, i))
            if gate(memory, owner, spec, key, coordinator_group(i), REMOVE, migrate=False, clock=clock).proceed:
                left.discard(i)
                memory.end_drain(key, resume=False)
        if not left:
            return
        answers = await drive(memory, namespace, name, root, key_, clock)
        if not answers or Answer.UNREACHABLE in answers:
            await asyncio.sleep(POLL_SECONDS)


async def adopt_once(memory: OperatorMemory, owner: dict[str, Any], spec: Mapping[str, Any], root: str,
                     clock: Clock = time.time) -> None:
    """Ask the coordinator's /health for the drains of before a restart, unless done or tried lately: once
    read, `adopt` takes them back; unreadable (no coordinator yet, or it is down), it is tried again after
    RESUME_POLL_SECONDS, and drains may start meanwhile (there is nothing to take back that could be driven)."""
    meta = owner["metadata"]
    deployment = (meta["namespace"], meta["name"])
    now = clock()
    if deployment in memory.adopted or now < memory.next_adopt_check.get(deployment, 0.0):
        return
    health = await client.health(root)
    if health is None:
        memory.next_adopt_check[deployment] = now + RESUME_POLL_SECONDS
        return
    await asyncio.to_thread(adopt, memory, owner, spec, health, clock)


def adopt(memory: OperatorMemory, owner: dict[str, Any], spec: Mapping[str, Any], health: Mapping[str, Any],
          clock: Clock = time.time) -> None:
    """Take back, from the coordinator's /health, the drains this operator asked before it restarted
    (`drain.adopt_drains` says which): one still wanted waits on under its old deadline, one done with is
    resumed once its group serves. Runs once per deployment, under its lock, before drains are driven."""
    meta = owner["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    with memory.lock(namespace, name):
        observed = observe(memory.kube, owner, spec, memory.pending_for(namespace, name))
        up = {g.name: serving(g) for g in observed.groups}
        wanted = {g: (REMOVE, others_serve(up, g)) for g in observed.strays}
        wanted |= {g: (RECREATE, others_serve(up, g)) for g in memory.pending_for(namespace, name)}
        roll = decide_rollout(observed.groups).roll
        if roll is not None:
            wanted[observed.groups[roll].name] = (ROLL, others_serve(up, observed.groups[roll].name))
        status_groups = (owner.get("status") or {}).get("groups", [])
        flagged = {g.get("name") for g in status_groups if g.get("draining")}
        ours = {g.name: g.index for g in observed.groups if g.name in flagged} | dict(observed.stray_index)
        draining = observed.conditions.get("Draining")
        since = from_iso(draining.since) if draining is not None and draining.status == "True" else None
        known = {*memory.drains_for(namespace, name), *memory.resumes_for(namespace, name)}
        drains, resumes = adopt_drains(health, ours, wanted, known, since or clock(),
                                       spec["rollout"]["drainTimeoutSeconds"])
        for group, record in drains.items():
            memory.drains[(namespace, name, group)] = record
            log.info(f"group {group}: the coordinator still drains {record.group} before its {record.why}; "
                     f"waiting for it until {iso(record.deadline)}")
        for group, target in resumes.items():
            memory.resumes[(namespace, name, group)] = target
            log.info(f"group {group}: the coordinator still drains {target}; resumed once the group serves")
        memory.adopted.add((namespace, name))
