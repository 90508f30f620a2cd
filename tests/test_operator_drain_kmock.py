"""The operator drains a group through the coordinator before it rolls or removes it: kopf against KMock,
and the REAL coordinator HTTP app (`OpenAIServer` over `Coordinator`, its auth, its /admin/drain and
/admin/resume, its real `GroupRunner`s) on a local port.

No rank runs here (a real group is too heavy for this machine's tests), so each group's scheduler is a
stand-in that only says whether the group still holds a request: what `/admin/drain` waits on. Every call
the coordinator gets is recorded with the StatefulSets' pod templates as KMock holds them at that moment,
which is what pins the order drain → StatefulSet patched → resume.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import kmock
import kopf
import kubernetes
import pytest
from aiohttp import web

from lockstep.coordinator.config import CoordinatorConfig
from lockstep.coordinator.group import GroupRunner
from lockstep.coordinator.openai_api import OpenAIServer, run_app
from lockstep.coordinator.service import Coordinator
from lockstep.local_group import free_port
from lockstep_operator import manifests as m
from lockstep_operator.kube import Kube
from test_operator_kmock import NS, _server_url, cr, declare, events_posted, rank_pod, run, until

API_KEY = "drain-test-key"


class HeldWork:
    """Stands in for a group's Scheduler: whether the group still holds a request (no ranks run here)."""

    def __init__(self) -> None:
        self.held = False
        self.num_waiting = 0

    def has_work(self) -> bool:
        return self.held

    @property
    def num_running(self) -> int:
        return int(self.held)


def templates(k: kmock.KubernetesEmulator) -> dict[str, str | None]:
    """Each group's StatefulSet pod template hash as KMock holds it now (None: no StatefulSet)."""
    out: dict[str, str | None] = {}
    for g in ("demo-g0", "demo-g1"):
        try:
            raw = k.objects["apps/v1/statefulsets", NS, g].raw
        except KeyError:
            out[g] = None
            continue
        out[g] = raw["spec"]["template"]["metadata"]["annotations"][m.ANNOTATION_HASH]
    return out


async def start_coordinator(k: kmock.KubernetesEmulator, groups: list[str], monkeypatch: pytest.MonkeyPatch
                            ) -> tuple[Coordinator, list[dict[str, Any]], web.AppRunner]:
    """The real coordinator app with `groups` up (not started: no rank to reach), every call recorded."""
    coord = Coordinator(CoordinatorConfig(api_keys=(API_KEY,)), tokenizer=None, model_name="m", max_model_len=64)
    for g in groups:
        runner = GroupRunner(g, ["127.0.0.1:1"], coord.metrics, coord._dispatch, coord._replay, coord._group_up)
        runner.scheduler, runner.up = HeldWork(), True  # type: ignore[assignment]
        coord.groups[g] = runner
    calls: list[dict[str, Any]] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        call = {"path": request.path, "query": dict(request.query), "auth": request.headers.get("Authorization"),
                "t": time.monotonic(), "before": templates(k)}
        calls.append(call)
        response = await handler(request)
        call.update(status=response.status, after=templates(k), t_done=time.monotonic())
        return response

    app = OpenAIServer(coord, [API_KEY]).app()
    app.middlewares.insert(0, record)
    port = free_port()
    server = await run_app(app, "127.0.0.1", port)
    monkeypatch.setenv("LOCKSTEP_OPERATOR_COORDINATOR_URL", f"http://127.0.0.1:{port}")
    return coord, calls, server


async def stop(coord: Coordinator, server: web.AppRunner) -> None:
    """Let every drain still waiting answer (the server waits for open requests), then stop serving."""
    for runner in coord.groups.values():
        runner.scheduler.held = False  # type: ignore[union-attr]
    await server.cleanup()


def of(calls: list[dict[str, Any]], path: str, group: str) -> list[dict[str, Any]]:
    return [c for c in calls if c["path"] == path and c["query"].get("group") == group]


def spec(**more: Any) -> dict[str, Any]:
    return {"model": {"path": "/m"}, "env": [{"name": "LOCKSTEP_API_KEY", "value": API_KEY}], **more}


async def start_pods(kube: Kube, group: str) -> None:
    sts = await until(lambda: kube.get("StatefulSet", NS, group))
    await asyncio.to_thread(kube.create, rank_pod(group, 0, sts))


async def status(kube: Kube) -> dict[str, Any]:
    return (await asyncio.to_thread(kube.get, "LockstepDeployment", NS, "demo"))["status"]


def test_roll_drains_first_resumes_after_and_scale_down_drains_before_removing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        coord, calls, server = await start_coordinator(k, ["g0", "g1"], monkeypatch)
        try:
            await asyncio.to_thread(kube.create, cr(spec(groups=2, rollout={"drainTimeoutSeconds": 60})))
            for g in ("demo-g0", "demo-g1"):
                await start_pods(kube, g)
            await until(lambda: kube.get("LockstepDeployment", NS, "demo").get("status", {}).get("readyGroups") == 2)
            old = templates(k)
            coord.groups["g0"].scheduler.held = True  # type: ignore[union-attr] - g0 runs a request
            await asyncio.to_thread(kube.patch, "LockstepDeployment", NS, "demo",
                                    {"metadata": {"generation": 2}, "spec": {"kvCache": {"pages": 64}}})

            (first, *_) = await until(lambda: of(calls, "/admin/drain", "g0"))
            assert first["query"] == {"group": "g0", "migrate": "true"}, "g1 serves: g0's requests may move there"
            assert first["auth"] == f"Bearer {API_KEY}" and first["before"] == old
            await asyncio.sleep(1.5)  # the drain holds the roll back
            assert templates(k) == old and await asyncio.to_thread(kube.get, "Pod", NS, "demo-g0-0")
            now = await status(kube)
            draining = next(c for c in now["conditions"] if c["type"] == "Draining")
            assert draining["status"] == "True" and "demo-g0" in draining["message"]
            assert [g["draining"] for g in now["groups"]] == [True, False]
            assert coord.groups["g0"].draining and not coord.groups["g0"].serving

            coord.groups["g0"].scheduler.held = False  # type: ignore[union-attr] - its request finished
            await until(lambda: templates(k)["demo-g0"] != old["demo-g0"])
            await until(lambda: kube.get("Pod", NS, "demo-g0-0") is None)
            done = [c for c in of(calls, "/admin/drain", "g0") if c.get("status") == 200]
            assert done and all(c["after"] == old for c in done), "the StatefulSet changed only after the drain"
            assert not of(calls, "/admin/resume", "g0") and coord.groups["g0"].draining, "resumed before it serves"

            await start_pods(kube, "demo-g0")
            (resume,) = await until(lambda: of(calls, "/admin/resume", "g0"))
            assert resume["status"] == 200 and resume["before"]["demo-g0"] != old["demo-g0"]
            assert resume["auth"] == f"Bearer {API_KEY}" and not coord.groups["g0"].draining
            # g1 rolls next; it holds nothing, so its drain answers at once.
            await until(lambda: templates(k)["demo-g1"] != old["demo-g1"])
            assert [c["before"]["demo-g1"] for c in of(calls, "/admin/drain", "g1")] == [old["demo-g1"]]
            await start_pods(kube, "demo-g1")
            await until(lambda: of(calls, "/admin/resume", "g1"))

            asked_before = len(of(calls, "/admin/drain", "g1"))
            await asyncio.to_thread(kube.patch, "LockstepDeployment", NS, "demo",
                                    {"metadata": {"generation": 3}, "spec": {"groups": 1}})
            await until(lambda: kube.get("StatefulSet", NS, "demo-g1") is None)
            (removal, *_) = of(calls, "/admin/drain", "g1")[asked_before:]
            assert removal["query"] == {"group": "g1", "migrate": "true"} and removal["after"]["demo-g1"] is not None
            await asyncio.sleep(0.5)
            assert len(of(calls, "/admin/resume", "g1")) == 1, "a removed group is not resumed"
            await events_posted(k, "DrainStarted", "Drained", "GroupRolled", "GroupResumed")
        finally:
            await stop(coord, server)
    run(scenario)


def test_a_drain_that_never_finishes_holds_the_roll_only_until_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        coord, calls, server = await start_coordinator(k, ["g0"], monkeypatch)
        try:
            await asyncio.to_thread(kube.create, cr(spec(rollout={"drainTimeoutSeconds": 2})))
            await start_pods(kube, "demo-g0")
            await until(lambda: kube.get("LockstepDeployment", NS, "demo").get("status", {}).get("readyGroups") == 1)
            old = templates(k)["demo-g0"]
            coord.groups["g0"].scheduler.held = True  # type: ignore[union-attr] - and never lets go
            await asyncio.to_thread(kube.patch, "LockstepDeployment", NS, "demo",
                                    {"metadata": {"generation": 2}, "spec": {"kvCache": {"pages": 64}}})
            (first, *_) = await until(lambda: of(calls, "/admin/drain", "g0"))
            assert first["query"] == {"group": "g0"}, "no other group serves: nothing to migrate to"
            await until(lambda: templates(k)["demo-g0"] != old, timeout=15)
            waited = time.monotonic() - first["t"]
            # The deadline counts from when the operator asked, a moment before the request arrived here.
            assert 1.5 <= waited < 2.0 + 5.0, f"rolled {waited:.1f}s after the drain began (deadline 2s)"
            assert all(c.get("status") != 200 for c in of(calls, "/admin/drain", "g0")), "it never drained"

            draining = await until(lambda: next((c for c in kube.get("LockstepDeployment", NS, "demo")["status"]
                                                 ["conditions"] if c["type"] == "Draining"
                                                 and c["reason"] == "DrainTimedOut"), None))
            assert draining["status"] == "False" and "demo-g0" in draining["message"]
            await events_posted(k, "DrainTimedOut")
            await start_pods(kube, "demo-g0")
            await until(lambda: of(calls, "/admin/resume", "g0"))
            assert not coord.groups["g0"].draining, "the group serves again once it is back"
        finally:
            await stop(coord, server)
    run(scenario)


def test_a_restarted_rank_drains_its_group_before_the_recreate_and_delete_drains_every_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        coord, calls, server = await start_coordinator(k, ["g0", "g1"], monkeypatch)
        try:
            await asyncio.to_thread(kube.create, cr(spec(groups=2)))
            for g in ("demo-g0", "demo-g1"):
                await start_pods(kube, g)
            await until(lambda: kube.get("LockstepDeployment", NS, "demo").get("status", {}).get("readyGroups") == 2)
            coord.groups["g0"].scheduler.held = True  # type: ignore[union-attr] - what the survivors still hold
            sts = await asyncio.to_thread(kube.get, "StatefulSet", NS, "demo-g0")
            await asyncio.to_thread(kube.patch, "Pod", NS, "demo-g0-0",
                                    {"status": rank_pod("demo-g0", 0, sts, restarts=1)["status"]})
            (first, *_) = await until(lambda: of(calls, "/admin/drain", "g0"))
            assert first["query"] == {"group": "g0", "migrate": "true"}
            await asyncio.sleep(1.0)
            assert await asyncio.to_thread(kube.get, "Pod", NS, "demo-g0-0"), "recreated before the drain ended"
            coord.groups["g0"].scheduler.held = False  # type: ignore[union-attr] - moved to g1
            await until(lambda: kube.get("Pod", NS, "demo-g0-0") is None)
            await until(lambda: kube.get("LockstepDeployment", NS, "demo")["status"]["groups"][0]["restarts"] == 1)
            assert not of(calls, "/admin/resume", "g0") and coord.groups["g0"].draining
            await start_pods(kube, "demo-g0")
            await until(lambda: of(calls, "/admin/resume", "g0"))
            assert not coord.groups["g0"].draining

            asked = len(calls)
            await asyncio.to_thread(kube.delete, "LockstepDeployment", NS, "demo")
            await until(lambda: kube.get("LockstepDeployment", NS, "demo") is None)
            drained = [c["query"] for c in calls[asked:] if c["path"] == "/admin/drain"]
            assert {"group": "g0"} in drained and {"group": "g1"} in drained, "nothing to migrate to on delete"
            assert coord.groups["g0"].draining and coord.groups["g1"].draining
        finally:
            await stop(coord, server)
    run(scenario)


def run_restartable(scenario: Callable[[Kube, kmock.KubernetesEmulator, Callable[[], Awaitable[None]]], Any]) -> None:
    """As test_operator_kmock.run, and the scenario may restart the operator: stop it, start a new one (a new
    memory, as a new pod would have) against the same API."""
    async def main() -> None:
        async with kmock.KubernetesEmulator() as k, kmock.Server(k) as server:
            declare(k)
            _server_url.append(str(server.url).rstrip("/"))
            kube = Kube(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=_server_url[-1])))
            running: list[tuple[threading.Event, threading.Thread]] = []

            def start() -> None:
                settings = kopf.OperatorSettings()
                settings.scanning.disabled = True
                settings.watching.reconnect_backoff = 0.1
                settings.queueing.idle_timeout = settings.queueing.exit_timeout = 0.5
                stop = threading.Event()
                thread = threading.Thread(target=asyncio.run, args=(kopf.operator(
                    clusterwide=True, standalone=True, settings=settings, stop_flag=stop,
                    memo=kopf.Memo(kube=kube)),), daemon=True)
                thread.start()
                running.append((stop, thread))

            async def stop_last() -> None:
                stop, thread = running[-1]
                stop.set()
                await asyncio.to_thread(thread.join, 10)
                assert not thread.is_alive(), "the operator did not stop"

            async def restart() -> None:
                await stop_last()
                start()

            start()
            try:
                await scenario(kube, k, restart)
            finally:
                await stop_last()
    asyncio.run(main())


def reasons_posted(k: kmock.KubernetesEmulator) -> list[str]:
    """Every event reason posted, in order, repeats kept."""
    return [r.data.get("reason") for r in list(k)
            if r.resource is not None and r.resource.plural == "events" and isinstance(r.data, dict)]


def drains_started(k: kmock.KubernetesEmulator, group: str) -> int:
    """DrainStarted events posted about `group` (once it is back, the roll goes on to the next group, and drains
    that one: a CI run under load read the events after that)."""
    return sum(1 for r in list(k) if r.resource is not None and r.resource.plural == "events"
               and isinstance(r.data, dict) and r.data.get("reason") == "DrainStarted"
               and f"draining group {group} " in r.data.get("message", ""))


def test_a_restarted_operator_keeps_the_drain_and_the_resume_it_had(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator restarts while it waits for a drain before a roll: the new one takes the drain back from
    the coordinator's /health (no second DrainStarted, the same Draining condition) and rolls once it ends.
    It restarts again between the roll and the resume: the new one resumes the group once it serves."""
    async def scenario(kube: Kube, k: kmock.KubernetesEmulator, restart: Callable[[], Awaitable[None]]) -> None:
        coord, calls, server = await start_coordinator(k, ["g0", "g1"], monkeypatch)
        try:
            await asyncio.to_thread(kube.create, cr(spec(groups=2, rollout={"drainTimeoutSeconds": 60})))
            for g in ("demo-g0", "demo-g1"):
                await start_pods(kube, g)
            await until(lambda: kube.get("LockstepDeployment", NS, "demo").get("status", {}).get("readyGroups") == 2)
            old = templates(k)
            coord.groups["g0"].scheduler.held = True  # type: ignore[union-attr]
            await asyncio.to_thread(kube.patch, "LockstepDeployment", NS, "demo",
                                    {"metadata": {"generation": 2}, "spec": {"kvCache": {"pages": 64}}})
            await until(lambda: of(calls, "/admin/drain", "g0"))
            draining = lambda: next(c for c in kube.get("LockstepDeployment", NS, "demo")["status"]["conditions"]
                                    if c["type"] == "Draining")
            before = await until(lambda: draining()["status"] == "True" and draining())

            await restart()
            await asyncio.sleep(2.0)
            assert templates(k) == old, "the drain still holds the roll back"
            assert drains_started(k, "demo-g0") == 1
            assert (await asyncio.to_thread(draining))["lastTransitionTime"] == before["lastTransitionTime"]
            assert len(of(calls, "/admin/drain", "g0")) > 1 and coord.groups["g0"].draining

            coord.groups["g0"].scheduler.held = False  # type: ignore[union-attr]
            await until(lambda: kube.get("Pod", NS, "demo-g0-0") is None)
            assert templates(k)["demo-g0"] != old["demo-g0"] and coord.groups["g0"].draining
            await until(lambda: kube.get("LockstepDeployment", NS, "demo")["status"]["groups"][0]["draining"])

            await restart()
            await start_pods(kube, "demo-g0")
            (resume,) = await until(lambda: of(calls, "/admin/resume", "g0"))
            assert resume["status"] == 200 and not coord.groups["g0"].draining
            assert drains_started(k, "demo-g0") == 1 and "Drained" in reasons_posted(k)
        finally:
            await stop(coord, server)
    run_restartable(scenario)
