"""Draining a group before the operator rolls, recreates or removes it: the pure decisions of `drain.py`
table-tested on records written by hand, and the gate the handlers pass a group through (`drainer.gate`),
with a clock given, no cluster and no coordinator. test_operator_drain_kmock.py runs the whole path."""

from __future__ import annotations

import asyncio
import copy
import logging
import time

import kopf
import pytest

from lockstep_operator import drainer, handlers
from lockstep_operator.decisions import CoordinatorView, decide_status
from lockstep_operator.drain import (
    MAX_UNREACHABLE,
    Answer,
    Drain,
    adopt_drains,
    after_answer,
    api_key,
    coordinator_group,
    coordinator_url,
    decide_drain,
    draining_condition,
    from_iso,
    iso,
    new_drain,
    others_serve,
    poll_timeout,
    stale_drains,
    stalled_condition,
    stalled_groups,
)
from lockstep_operator.memory import OperatorMemory
from lockstep_operator.observe import GroupState, Observed
from lockstep_operator.resource import normalize

T0 = 1_000_000.0
SPEC = normalize({"model": {"path": "/m"}, "groups": 2, "rollout": {"drainTimeoutSeconds": 60}})
OWNER = {"apiVersion": "lockstep.dev/v1alpha1", "kind": "LockstepDeployment",
         "metadata": {"name": "demo", "namespace": "ml", "uid": "u", "generation": 1}, "spec": SPEC}
KEY = ("ml", "demo", "demo-g0")


def asked(**changes: object) -> Drain:
    """A drain of g0 asked at T0 with a 60 s deadline, changed as given."""
    record = new_drain("g0", "roll", True, T0, 60)
    return Drain(**{**record.__dict__, **changes})


# --- the decision, every branch -----------------------------------------------------------------------------

@pytest.mark.parametrize(("record", "timeout", "now", "holds_work", "action", "reason"), [
    pytest.param(None, 0, T0, True, "proceed", "DrainDisabled", id="drainTimeoutSeconds-0"),
    pytest.param(asked(), 0, T0 + 1, True, "proceed", "DrainDisabled", id="set-to-0-while-draining"),
    pytest.param(None, 60, T0, False, "proceed", "NothingToDrain", id="no-drain-needed"),
    pytest.param(None, 60, T0, True, "start", "DrainStarted", id="drain-started"),
    pytest.param(asked(), 60, T0 + 5, True, "wait", "DrainInProgress", id="still-draining"),
    pytest.param(asked(failures=MAX_UNREACHABLE - 1, error="refused"), 60, T0 + 5, True, "wait", "DrainInProgress",
                 id="unreachable-retried"),
    pytest.param(asked(finished=True), 60, T0 + 5, True, "proceed", "Drained", id="finished"),
    pytest.param(asked(finished=True), 60, T0 + 500, True, "proceed", "Drained", id="finished-late-still-drained"),
    pytest.param(asked(), 60, T0 + 60, True, "proceed", "DrainTimedOut", id="deadline-passed"),
    pytest.param(asked(failures=MAX_UNREACHABLE, error="refused"), 60, T0 + 2, True, "proceed",
                 "CoordinatorUnreachable", id="unreachable-after-retries"),
    pytest.param(asked(refused="HTTP 401: bad key"), 60, T0 + 1, True, "proceed", "DrainRefused", id="refused"),
])
def test_decide_drain(record: Drain | None, timeout: float, now: float, holds_work: bool, action: str,
                      reason: str) -> None:
    step = decide_drain(record, timeout, now, holds_work)
    assert (step.action, step.reason) == (action, reason)
    assert step.proceed == (action == "proceed")


def test_decide_drain_never_waits_past_the_deadline() -> None:
    """Whatever the coordinator says or does not say, a drain ends by its deadline."""
    for answers in ([Answer.PENDING] * 50, [Answer.UNREACHABLE, Answer.PENDING] * 25):
        record, now = asked(), T0
        while decide_drain(record, 60, now).action == "wait":
            record = after_answer(record, answers.pop(0))
            now += 5
        assert now <= record.deadline + 5


@pytest.mark.parametrize(("answer", "finished", "failures", "refused"), [
    (Answer.DONE, True, 0, ""),
    (Answer.PENDING, False, 0, ""),  # reachable: the failure count starts again
    (Answer.UNREACHABLE, False, 2, ""),
    (Answer.REFUSED, False, 1, "HTTP 404: no group"),
])
def test_after_answer(answer: Answer, finished: bool, failures: int, refused: str) -> None:
    after = after_answer(asked(failures=1), answer, "HTTP 404: no group" if answer is Answer.REFUSED else "x")
    assert (after.finished, after.failures, after.refused) == (finished, failures, refused)
    assert after.started == T0 and after.deadline == T0 + 60


def test_poll_timeout_is_bounded_by_the_deadline_and_stops_once_resolved() -> None:
    assert poll_timeout(asked(), T0, 5) == 5
    assert poll_timeout(asked(), T0 + 58, 5) == pytest.approx(2)
    assert poll_timeout(asked(), T0 + 60, 5) is None
    for resolved in (asked(finished=True), asked(refused="no"), asked(failures=MAX_UNREACHABLE)):
        assert resolved.resolved and poll_timeout(resolved, T0, 5) is None


def test_migrate_only_when_another_group_serves() -> None:
    assert others_serve({"demo-g0": True, "demo-g1": True}, "demo-g0")
    assert not others_serve({"demo-g0": True, "demo-g1": False}, "demo-g0")
    assert not others_serve({"demo-g0": True}, "demo-g0")
    assert others_serve({"demo-g0": True}, "demo-g3")  # a removed group's requests go to the one left


def test_stale_drains_end() -> None:
    drains = {"demo-g0": asked(), "demo-g1": asked(group="g1")}
    assert stale_drains(drains, {"demo-g1"}) == ["demo-g0"]
    assert stale_drains(drains, {"demo-g0", "demo-g1"}) == []


# --- where and how the coordinator is called ----------------------------------------------------------------

def test_coordinator_url_and_group_names() -> None:
    spec = normalize({"coordinator": {"httpPort": 9000}})
    assert coordinator_url("demo", "ml", spec) == "http://demo.ml.svc.cluster.local:9000"
    assert coordinator_url("demo", "ml", spec, "http://127.0.0.1:{port}/{namespace}/{name}/") == \
        "http://127.0.0.1:9000/ml/demo"
    assert [coordinator_group(i) for i in range(2)] == ["g0", "g1"]  # as LOCKSTEP_GROUPS names them


def test_api_key_from_the_spec_or_the_operator() -> None:
    env = [{"name": "X", "value": "1"}, {"name": "LOCKSTEP_API_KEY", "value": "k1, k2"}]
    assert api_key({"env": env}, "op") == "k1"
    from_secret = [{"name": "LOCKSTEP_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    assert api_key({"env": from_secret}, "op") == "op"  # the operator reads no Secret: its own key
    assert api_key({}, "") == ""


def test_stalled_groups_from_metrics_and_the_condition() -> None:
    text = ('# HELP lockstep_agreements_stalled x\nlockstep_agreements_stalled{group="g0"} 0.0\n'
            'lockstep_agreements_stalled{group="g1"} 2.0\nlockstep_agreement_stalls_total{group="g1"} 3.0\n')
    assert stalled_groups(text) == {"g0": 0.0, "g1": 2.0}
    assert stalled_condition({"g0": 0.0, "g1": 2.0})[:2] == ("True", "AgreementStalled")
    assert "g1" in stalled_condition({"g0": 0.0, "g1": 2.0})[2]
    assert stalled_condition({"g0": 0.0})[:2] == ("False", "NoStall")
    assert stalled_condition(None)[0] == "Unknown"


def test_draining_condition_names_the_group_and_since_when() -> None:
    value, reason, message = draining_condition({"demo-g0": asked()}, None)
    assert (value, reason) == (True, "DrainInProgress")
    assert "demo-g0" in message and "g0" in message and "1970-01-12T13:46:40Z" in message
    assert draining_condition({"demo-g0": asked(finished=True)}, ("Drained", "done")) == (False, "Drained", "done")
    assert draining_condition({}, None) == (False, "NoDrain", "no group is being drained")


def test_status_shows_the_drain() -> None:
    group = GroupState(index=0, name="demo-g0", exists=True, replicas=1, current_hash="h", desired_hash="h",
                       in_spec=True, labelled=True)
    observed = Observed(namespace="ml", name="demo", groups=(group,))
    view = CoordinatorView(drains={"demo-g0": asked()}, stalled={"g0": 1.0})
    status = decide_status(observed, SPEC, 1, "2025-01-01T00:00:00Z", (), view)
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conditions["Draining"] == ("True", "DrainInProgress")
    assert conditions["AgreementStalled"] == ("True", "AgreementStalled")
    assert status["groups"][0]["draining"] is True


def test_a_restarted_operator_keeps_draining_true_until_it_has_asked_the_coordinator() -> None:
    """A new operator knows no drain until it has read the coordinator's /health: until then a Draining=True
    stays True with its time (flipping it to False and back would move the drain's deadline)."""
    from lockstep_operator.observe import Transition

    group = GroupState(index=0, name="demo-g0", exists=True, replicas=1, current_hash="h", desired_hash="h",
                       in_spec=True, labelled=True)
    was = Observed(namespace="ml", name="demo", groups=(group,),
                   conditions={"Draining": Transition("True", "2025-01-01T00:00:00Z")})
    now = "2025-01-01T00:05:00Z"
    kept = {c["type"]: c for c in decide_status(was, SPEC, 1, now, (), CoordinatorView(adopting=True))["conditions"]}
    assert (kept["Draining"]["status"], kept["Draining"]["lastTransitionTime"]) == ("True", "2025-01-01T00:00:00Z")
    done = {c["type"]: c for c in decide_status(was, SPEC, 1, now, (), CoordinatorView())["conditions"]}
    assert (done["Draining"]["status"], done["Draining"]["lastTransitionTime"]) == ("False", now)
    fresh = Observed(namespace="ml", name="demo", groups=(group,))
    new = {c["type"]: c for c in decide_status(fresh, SPEC, 1, now, (), CoordinatorView(adopting=True))["conditions"]}
    assert new["Draining"]["status"] == "False"  # nothing to keep: a new resource is not draining


# --- the gate the handlers use ------------------------------------------------------------------------------

@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    posted: list[str] = []
    monkeypatch.setattr(kopf, "event", lambda *_, **kw: posted.append(kw["reason"]))
    return posted


def adopted_memory() -> OperatorMemory:
    """A memory whose drains of before a restart were looked for already (see the restart tests below)."""
    memory = OperatorMemory(kube=None)  # type: ignore[arg-type] - the gate makes no API call
    memory.adopted.add(KEY[:2])
    return memory


def test_gate_starts_waits_then_proceeds_and_remembers_the_resume(events: list[str]) -> None:
    memory = adopted_memory()
    clock = [T0]
    step = drainer.gate(memory, OWNER, SPEC, KEY, "g0", "roll", True, clock=lambda: clock[0])
    assert step.action == "wait" and memory.drains[KEY].migrate and events == ["DrainStarted"]
    clock[0] += 10
    assert drainer.gate(memory, OWNER, SPEC, KEY, "g0", "roll", True, clock=lambda: clock[0]).action == "wait"
    assert events == ["DrainStarted"]  # waiting is not news
    memory.update_drain(KEY, memory.drains[KEY], after_answer(memory.drains[KEY], Answer.DONE))
    assert drainer.gate(memory, OWNER, SPEC, KEY, "g0", "roll", True, clock=lambda: clock[0]).proceed
    assert events == ["DrainStarted", "Drained"] and memory.drain_outcomes[KEY[:2]][0] == "Drained"
    memory.end_drain(KEY, resume=True)
    assert memory.resumes == {KEY: "g0"} and not memory.drains


def test_gate_times_out_with_a_warning_and_a_new_drain_supersedes_a_resume(events: list[str]) -> None:
    memory = adopted_memory()
    memory.resumes[KEY] = "g0"
    drainer.gate(memory, OWNER, SPEC, KEY, "g0", "recreate", False, clock=lambda: T0)
    assert not memory.resumes, "a drain asked again must not be undone by the resume of the last one"
    step = drainer.gate(memory, OWNER, SPEC, KEY, "g0", "recreate", False, clock=lambda: T0 + 60)
    assert step.proceed and step.reason == "DrainTimedOut" and events == ["DrainStarted", "DrainTimedOut"]


def test_gate_without_drains(events: list[str]) -> None:
    memory = OperatorMemory(kube=None)  # type: ignore[arg-type]
    off = normalize({"model": {"path": "/m"}, "rollout": {"drainTimeoutSeconds": 0}})
    assert drainer.gate(memory, OWNER, off, KEY, "g0", "roll", False).reason == "DrainDisabled"
    assert drainer.gate(memory, OWNER, SPEC, KEY, None, "remove", False).reason == "NothingToDrain"
    assert drainer.gate(memory, OWNER, SPEC, KEY, "g0", "roll", False, holds_work=False).reason == "NothingToDrain"
    assert not memory.drains and not events
    memory.end_drain(KEY, resume=True)
    assert not memory.resumes, "nothing was drained: nothing to resume"


def test_an_answer_for_a_record_that_changed_meanwhile_is_dropped() -> None:
    memory = OperatorMemory(kube=None)  # type: ignore[arg-type]
    before = memory.drains[KEY] = asked()
    memory.end_drain(KEY, resume=True)  # the roll went ahead while the request was out
    assert not memory.update_drain(KEY, before, after_answer(before, Answer.DONE)) and KEY not in memory.drains


def test_delete_drains_every_group_and_goes_on_when_the_coordinator_is_gone(
        monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    """The delete handler drives its drains itself (kopf stops the daemons first); nothing listens here,
    so each drain gives up after MAX_UNREACHABLE connection failures and the deletion goes on."""
    monkeypatch.setenv("LOCKSTEP_OPERATOR_COORDINATOR_URL", "http://127.0.0.1:9")
    monkeypatch.setattr(drainer, "POLL_SECONDS", 0.01)
    memory = OperatorMemory(kube=None)  # type: ignore[arg-type]
    asyncio.run(handlers.forget(body=kopf.Body(copy.deepcopy(OWNER)), name="demo", namespace="ml",
                                logger=logging.getLogger("test"), memo=kopf.Memo(lockstep=memory)))
    assert events.count("DrainStarted") == 2 and events.count("CoordinatorUnreachable") == 2
    assert not memory.drains and not memory.resumes


def test_refresh_reads_stalled_agreements_from_the_real_coordinator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The status timer reads lockstep_agreements_stalled from the coordinator's own /metrics (the real app,
    its groups not started) into the AgreementStalled condition, naming the group, and its /health into the
    Degraded condition."""
    from lockstep.coordinator.config import CoordinatorConfig
    from lockstep.coordinator.group import GroupRunner
    from lockstep.coordinator.openai_api import OpenAIServer, run_app
    from lockstep.coordinator.service import Coordinator
    from lockstep.local_group import free_port
    from test_operator_decisions import MemoryKube

    async def main() -> dict:
        coord = Coordinator(CoordinatorConfig(), tokenizer=None, model_name="m", max_model_len=64)
        for g in ("g0", "g1"):
            coord.groups[g] = GroupRunner(g, ["127.0.0.1:1"], coord.metrics, coord._dispatch, coord._replay,
                                          coord._group_up)
        coord.metrics.agreements_stalled.labels("g1").set(1)
        port = free_port()
        server = await run_app(OpenAIServer(coord).app(), "127.0.0.1", port)
        monkeypatch.setenv("LOCKSTEP_OPERATOR_COORDINATOR_URL", f"http://127.0.0.1:{port}")
        kube = MemoryKube([copy.deepcopy(OWNER)])
        try:
            await handlers.refresh(body=kopf.Body(copy.deepcopy(OWNER)), name="demo", namespace="ml",
                                   memo=kopf.Memo(lockstep=OperatorMemory(kube=kube)))
        finally:
            await server.cleanup()
        return kube.get("LockstepDeployment", "ml", "demo")["status"]

    status = asyncio.run(main())
    stalled = next(c for c in status["conditions"] if c["type"] == "AgreementStalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "AgreementStalled") and "g1" in stalled["message"]
    assert "g0" not in stalled["message"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")  # its groups never connected
    assert (degraded["status"], degraded["reason"]) == ("True", "GroupNotServing")
    assert "coordinator group g0" in degraded["message"] and "coordinator group g1" in degraded["message"]


def test_drain_ticks_look_at_resumes_only_every_resume_poll() -> None:
    """A rolled group takes minutes to come back: its resume is looked at every RESUME_POLL_SECONDS, not
    at every drain tick; an open drain is asked about at every tick."""
    memory = OperatorMemory(kube=None)  # type: ignore[arg-type]
    assert not drainer.has_work(memory, "ml", "demo", T0)
    memory.resumes[KEY] = "g0"
    assert drainer.has_work(memory, "ml", "demo", T0)
    memory.next_resume_check[("ml", "demo")] = T0 + 5
    assert not drainer.has_work(memory, "ml", "demo", T0 + 1)
    assert drainer.has_work(memory, "ml", "demo", T0 + 5)
    memory.drains[KEY] = asked()
    assert drainer.has_work(memory, "ml", "demo", T0 + 1)


# --- after an operator restart: the drains taken back from the coordinator's /health ------------------------

def coordinator_health(**draining: bool) -> dict:
    """The coordinator's /health body: g0 and g1 up, draining as given."""
    return {g: {"up": True, "reason": "", "step": 3, "draining": draining.get(g, False)} for g in ("g0", "g1")}


@pytest.mark.parametrize(("health", "ours", "wanted", "known", "drains", "resumes"), [
    pytest.param(coordinator_health(g0=True), {"demo-g0": 0}, {"demo-g0": ("roll", True)}, (),
                 {"demo-g0": asked()}, {}, id="still-wanted-waits-under-its-old-deadline"),
    pytest.param(coordinator_health(g0=True), {"demo-g0": 0}, {}, (), {}, {"demo-g0": "g0"},
                 id="done-with-is-resumed"),
    pytest.param(coordinator_health(g1=True), {"demo-g3": 1}, {"demo-g3": ("remove", False)}, (),
                 {"demo-g3": asked(group="g1", why="remove", migrate=False)}, {}, id="a-removal-by-index"),
    pytest.param(coordinator_health(g0=True), {}, {"demo-g0": ("roll", True)}, (), {}, {},
                 id="someone-elses-drain-stays-theirs"),
    pytest.param(coordinator_health(g0=True), {"demo-g0": 0}, {"demo-g0": ("roll", True)}, ("demo-g0",), {}, {},
                 id="remembered-already"),
    pytest.param(coordinator_health(), {"demo-g0": 0}, {"demo-g0": ("roll", True)}, (), {}, {},
                 id="not-draining-at-the-coordinator"),
    pytest.param({"g1": {"up": False, "draining": True}}, {"demo-g0": 0}, {}, (), {}, {},
                 id="not-a-coordinator-group"),
])
def test_adopt_drains(health: dict, ours: dict, wanted: dict, known: tuple, drains: dict, resumes: dict) -> None:
    assert adopt_drains(health, ours, wanted, known, T0, 60) == (drains, resumes)


def test_status_times_read_back_as_clock_values() -> None:
    assert from_iso(iso(T0)) == T0
    assert from_iso(None) is None and from_iso("yesterday") is None


def test_drain_waits_are_logged_at_info_and_never_posted_as_events() -> None:
    """kopf logs each retry of a waiting reconcile at ERROR and would post it as an Error event every
    RECHECK_SECONDS; the drain's own start and end events say what happens."""
    from kopf._core.engines.posting import K8sPoster

    logger = logging.getLogger("test.kopf.objects")
    drainer.quiet_drain_waits(logger)
    drainer.quiet_drain_waits(logger)
    assert len(logger.filters) == 1

    settings = kopf.OperatorSettings()
    settings.posting.loggers = True  # kopf posts log records as events (older kopf did by default)

    def record(message: str) -> logging.LogRecord:
        rec = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, message, (), None,
                                extra={"settings": settings, "k8s_ref": {"name": "demo"}})
        logger.filter(rec)
        return rec

    waiting = record(f"Handler 'reconcile' failed temporarily: {drainer.DRAIN_WAIT}demo-g0")
    assert (waiting.levelno, waiting.levelname) == (logging.INFO, "INFO") and not K8sPoster().filter(waiting)
    other = record("Handler 'reconcile' failed temporarily: the API server said 500")
    assert other.levelno == logging.ERROR and K8sPoster().filter(other)


def test_no_drain_starts_before_the_coordinators_drains_were_looked_for(events: list[str]) -> None:
    """Just after a restart the drain a reconcile asks for may be running already: it waits until the daemon
    looked at /health (read, or unreadable: then there is nothing to take back that could be driven)."""
    memory = OperatorMemory(kube=None)  # type: ignore[arg-type]
    step = drainer.gate(memory, OWNER, SPEC, KEY, "g0", "roll", True, clock=lambda: T0)
    assert step.action == "wait" and not memory.drains and not events
    memory.next_adopt_check[KEY[:2]] = T0 + 5  # /health could not be read
    assert drainer.gate(memory, OWNER, SPEC, KEY, "g0", "roll", True, clock=lambda: T0).action == "wait"
    assert memory.drains[KEY].started == T0 and events == ["DrainStarted"]


def test_adoption_is_tried_again_later_when_the_coordinator_cannot_be_read() -> None:
    memory = OperatorMemory(kube=None)  # type: ignore[arg-type]
    owner = copy.deepcopy(OWNER)
    asyncio.run(drainer.adopt_once(memory, owner, SPEC, "http://127.0.0.1:9", clock=lambda: T0))
    assert memory.adoption_tried("ml", "demo") and ("ml", "demo") not in memory.adopted
    assert memory.next_adopt_check[("ml", "demo")] == T0 + drainer.RESUME_POLL_SECONDS


def test_a_restarted_operator_takes_its_drain_back_and_waits_without_a_second_start(
        monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    """The operator drained demo-g1 before rolling it, and demo-g0 before a recreate it has carried out, then
    restarted (its memory is empty). From the coordinator's /health and its own last status it waits on for
    demo-g1 under the old deadline (no second DrainStarted, its retries not posted) and resumes demo-g0 once
    it serves."""
    from test_operator_decisions import MemoryKube, k8s_pod, sts

    started = time.time() - 10
    changed = normalize({**SPEC, "image": "someone/else:2"})
    owner = copy.deepcopy(OWNER)
    owner["status"] = {"groups": [{"name": "demo-g0", "draining": True}, {"name": "demo-g1", "draining": True}],
                       "conditions": [{"type": "Draining", "status": "True", "lastTransitionTime": iso(started)}]}
    objects = [owner, sts(0, SPEC), sts(1, changed)]
    objects += [k8s_pod(f"demo-g{i}", r, objects[1 + i]["spec"]["template"])
                for i in range(2) for r in range(SPEC["tensorParallelSize"])]
    memory = OperatorMemory(kube=MemoryKube(objects))

    drainer.adopt(memory, owner, SPEC, coordinator_health(g0=True, g1=True))
    assert memory.adopted == {("ml", "demo")}
    assert memory.resumes == {KEY: "g0"}
    record = memory.drains[("ml", "demo", "demo-g1")]
    assert (record.group, record.why, record.migrate) == ("g1", "roll", True)
    assert record.started == pytest.approx(int(started)) and record.deadline == record.started + 60

    with pytest.raises(kopf.TemporaryError, match=f"^{drainer.DRAIN_WAIT}demo-g1"):
        handlers.reconcile(body=kopf.Body(owner), name="demo", namespace="ml", logger=logging.getLogger("test"),
                           memo=kopf.Memo(lockstep=memory))
    assert events == [], "a drain taken back is not started again"
    status = memory.kube.get("LockstepDeployment", "ml", "demo")["status"]
    assert [g["draining"] for g in status["groups"]] == [True, True]  # g0 until it is resumed
