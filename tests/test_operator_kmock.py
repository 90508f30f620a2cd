"""The kopf operator against KMock (kopf's own Kubernetes API emulator): real handlers, real HTTP."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import kmock
import kopf
import kubernetes
import pytest

os.environ.setdefault("LOCKSTEP_OPERATOR_RETRY_SECONDS", "0.5")
os.environ.setdefault("LOCKSTEP_OPERATOR_DRAIN_POLL_SECONDS", "0.2")
os.environ.setdefault("LOCKSTEP_OPERATOR_DRAIN_WAIT_SECONDS", "0.5")
os.environ.setdefault("LOCKSTEP_OPERATOR_RESUME_POLL_SECONDS", "0.5")
os.environ.setdefault("LOCKSTEP_OPERATOR_DRAIN_RECHECK_SECONDS", "0.2")
# No coordinator runs here: drains find nothing listening and go on (test_operator_drain.py runs one).
os.environ.setdefault("LOCKSTEP_OPERATOR_COORDINATOR_URL", "http://127.0.0.1:9")

from lockstep_operator import handlers  # noqa: E402, F401 - importing registers the handlers
from lockstep_operator import manifests as m  # noqa: E402
from lockstep_operator.kube import Kube  # noqa: E402

NS = "ml"
_server_url: list[str] = []


@kopf.on.login()
def _login_to_kmock(**_: Any) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server=_server_url[-1], insecure=True)


def declare(k: kmock.KubernetesEmulator) -> None:
    info = kmock.ResourceInfo
    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    k.resources["lockstep.dev/v1alpha1/lockstepdeployments"] = info(
        kind="LockstepDeployment", singular="lockstepdeployment", namespaced=True, verbs=verbs,
        subresources={"status"})
    for key, kind in [("v1/pods", "Pod"), ("v1/services", "Service"), ("v1/events", "Event"), ("v1/secrets", "Secret"),
                      ("v1/configmaps", "ConfigMap"),
                      ("apps/v1/statefulsets", "StatefulSet"), ("apps/v1/deployments", "Deployment"),
                      ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy")]:
        k.resources[key] = info(kind=kind, namespaced=True, verbs=verbs)
    # kopf waits for these to be discoverable even when it scans neither (scanning.disabled).
    k.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
        kind="CustomResourceDefinition", namespaced=False, verbs={"get", "list", "watch"})
    k.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs={"get", "list", "watch"})


def cr(spec: dict) -> dict:
    return {"apiVersion": "lockstep.dev/v1alpha1", "kind": "LockstepDeployment",
            # KMock makes no resourceVersions; kopf's patches test for one, so give it a fixed one.
            "metadata": {"name": "demo", "namespace": NS, "uid": "uid-demo", "generation": 1,
                         "resourceVersion": "1"}, "spec": spec}


def rank_pod(group: str, rank: int, sts: dict, phase: str = "Running", restarts: int = 0) -> dict:
    template = sts["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{group}-{rank}", "namespace": NS, "uid": f"uid-{group}-{rank}-{time.monotonic()}",
                         "labels": dict(template["metadata"]["labels"]),
                         "annotations": dict(template["metadata"]["annotations"])},
            "spec": {"containers": [{"name": "rank", "image": "x"}]},
            "status": {"phase": phase,
                       "conditions": [{"type": "Ready", "status": "True" if phase == "Running" else "False"}],
                       "containerStatuses": [{"name": "rank", "restartCount": restarts,
                                              "ready": phase == "Running"}]}}


def posted_event_reasons(k: kmock.KubernetesEmulator) -> set[str]:
    # KMock stores one event per namespace (kopf's events have only generateName): read the requests.
    return {r.data.get("reason") for r in list(k)
            if r.resource is not None and r.resource.plural == "events" and isinstance(r.data, dict)}


async def events_posted(k: kmock.KubernetesEmulator, *reasons: str) -> None:
    """Wait until kopf has posted events of these reasons: it posts them from a queue of its own, after the patch
    that a test waits for (a CI run under load read the requests between the two)."""
    await until(lambda: set(reasons) <= posted_event_reasons(k), timeout=10)


async def until(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(check)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check.__name__}")
        await asyncio.sleep(0.1)


def run(scenario: Callable[[Kube, kmock.KubernetesEmulator], Any]) -> None:
    async def main() -> None:
        async with kmock.KubernetesEmulator() as k, kmock.Server(k) as server:
            declare(k)
            _server_url.append(str(server.url).rstrip("/"))
            config = kubernetes.client.Configuration(host=_server_url[-1])
            kube = Kube(kubernetes.client.ApiClient(config))
            settings = kopf.OperatorSettings()
            settings.scanning.disabled = True  # KMock 0.8 answers the namespace list with 500
            settings.watching.reconnect_backoff = 0.1
            settings.queueing.idle_timeout = 0.5
            settings.queueing.exit_timeout = 0.5
            # The operator gets its own thread and loop: on exit kopf waits for every task of its
            # loop, and KMock's server tasks must not be among them.
            stop = threading.Event()
            operator = threading.Thread(target=asyncio.run, args=(kopf.operator(
                clusterwide=True, standalone=True, settings=settings, stop_flag=stop,
                memo=kopf.Memo(kube=kube)),), daemon=True)
            operator.start()
            try:
                await scenario(kube, k)
            finally:
                stop.set()
                await asyncio.to_thread(operator.join, 10)
            assert not operator.is_alive(), "the operator did not stop"
    asyncio.run(main())


def test_create_builds_groups_coordinator_owned_and_status() -> None:
    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        await asyncio.to_thread(kube.create, cr({"tensorParallelSize": 3, "groups": 2}))
        sts = await until(lambda: kube.get("StatefulSet", NS, "demo-g1"))
        assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
        assert sts["metadata"]["ownerReferences"][0]["kind"] == "LockstepDeployment"
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        assert c["readinessProbe"]["grpc"]["port"] == 50051
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        dep = await until(lambda: kube.get("Deployment", NS, "demo-coordinator"))
        env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["LOCKSTEP_GROUPS_FILE"] == f"{m.GROUPS_MOUNT}/{m.GROUPS_KEY}" and "LOCKSTEP_GROUPS" not in env
        groups = (await asyncio.to_thread(kube.get, "ConfigMap", NS, "demo-groups"))["data"][m.GROUPS_KEY]
        assert groups.startswith("g0=demo-g0-0.demo-g0.ml.svc.cluster.local:50051,") and groups.count("\n") == 2
        for kind, name in [("Service", "demo"), ("Service", "demo-g0"), ("Service", "demo-g1"),
                           ("NetworkPolicy", "demo-g0"), ("ConfigMap", "demo-groups")]:
            obj = await asyncio.to_thread(kube.get, kind, NS, name)
            assert obj and obj["metadata"]["ownerReferences"][0]["uid"] == "uid-demo", (kind, name)
        assert (await asyncio.to_thread(kube.get, "Service", NS, "demo-g0"))["spec"]["publishNotReadyAddresses"]
        status = (await until(lambda: (kube.get("LockstepDeployment", NS, "demo") or {}).get("status", {})
                              .get("phase") and kube.get("LockstepDeployment", NS, "demo")["status"]))
        assert status["phase"] == "Progressing" and status["readyGroups"] == 0
        assert [g["name"] for g in status["groups"]] == ["demo-g0", "demo-g1"]
        assert status["endpoint"] == "http://demo.ml.svc.cluster.local:8000"
        assert {c["type"] for c in status["conditions"]} == {"Ready", "Progressing", "Degraded", "Draining",
                                                              "AgreementStalled"}
        assert status["observedGeneration"] == 1
    run(scenario)


def test_update_tp_rolls_groups_one_at_a_time_and_scaling_removes_groups() -> None:
    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        await asyncio.to_thread(kube.create, cr({"tensorParallelSize": 1, "groups": 2}))
        g0 = await until(lambda: kube.get("StatefulSet", NS, "demo-g0"))
        g1 = await until(lambda: kube.get("StatefulSet", NS, "demo-g1"))
        await until(lambda: kube.get("Deployment", NS, "demo-coordinator"))
        for g, sts in (("demo-g0", g0), ("demo-g1", g1)):
            await asyncio.to_thread(kube.create, rank_pod(g, 0, sts))
        await asyncio.to_thread(kube.patch, "LockstepDeployment", NS, "demo",
                                {"metadata": {"generation": 2}, "spec": {"tensorParallelSize": 3}})
        await until(lambda: kube.get("StatefulSet", NS, "demo-g0")["spec"]["replicas"] == 3)
        # The template is patched before the pods are deleted (two API calls): wait for the second.
        await until(lambda: kube.get("Pod", NS, "demo-g0-0") is None, timeout=5)  # rolled group keeps old pods
        await asyncio.sleep(1.5)  # several retries: g1 must wait while g0 is down and g1 serves
        assert (await asyncio.to_thread(kube.get, "StatefulSet", NS, "demo-g1"))["spec"]["replicas"] == 1
        new_g0 = await asyncio.to_thread(kube.get, "StatefulSet", NS, "demo-g0")
        for r in range(3):
            await asyncio.to_thread(kube.create, rank_pod("demo-g0", r, new_g0))
        await until(lambda: kube.get("StatefulSet", NS, "demo-g1")["spec"]["replicas"] == 3)
        group_list = lambda: kube.get("ConfigMap", NS, "demo-groups")["data"][m.GROUPS_KEY]  # noqa: E731
        await until(lambda: group_list().count(",") == 4)
        template = (await asyncio.to_thread(kube.get, "Deployment", NS, "demo-coordinator"))["spec"]["template"]

        await asyncio.to_thread(kube.patch, "LockstepDeployment", NS, "demo",
                                {"metadata": {"generation": 3}, "spec": {"groups": 1}})
        await until(lambda: kube.get("StatefulSet", NS, "demo-g1") is None)
        assert await asyncio.to_thread(kube.get, "Service", NS, "demo-g1") is None
        assert await asyncio.to_thread(kube.get, "StatefulSet", NS, "demo-g0") is not None
        await until(lambda: group_list().count("\n") == 1 and group_list().startswith("g0="))
        # the coordinator is not restarted by a change of groups: its pod template stayed as it was
        assert (await asyncio.to_thread(kube.get, "Deployment", NS, "demo-coordinator"))["spec"]["template"] == template
    run(scenario)


def test_restarted_rank_recreates_group_but_not_while_a_pod_is_pending() -> None:
    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        await asyncio.to_thread(kube.create, cr({"tensorParallelSize": 3, "groups": 2}))
        g0 = await until(lambda: kube.get("StatefulSet", NS, "demo-g0"))
        g1 = await until(lambda: kube.get("StatefulSet", NS, "demo-g1"))
        await until(lambda: (kube.get("LockstepDeployment", NS, "demo") or {}).get("status"))
        for r in range(3):
            await asyncio.to_thread(kube.create, rank_pod("demo-g1", r, g1))
        await asyncio.to_thread(kube.create, rank_pod("demo-g0", 0, g0))
        await asyncio.to_thread(kube.create, rank_pod("demo-g0", 1, g0, phase="Pending"))
        await asyncio.to_thread(kube.create, rank_pod("demo-g0", 2, g0, restarts=1))

        status = await until(lambda: any(g.get("pendingRecreate") for g in kube.get(
            "LockstepDeployment", NS, "demo")["status"]["groups"]) and kube.get(
            "LockstepDeployment", NS, "demo")["status"])
        assert status["groups"][0]["pendingRecreate"] and status["groups"][0]["restarts"] == 0
        assert status["phase"] == "Degraded" and status["readyGroups"] == 1
        await asyncio.sleep(0.5)
        assert await asyncio.to_thread(kube.get, "Pod", NS, "demo-g0-2") is not None, "recreated while Pending"

        pending = rank_pod("demo-g0", 1, g0)
        await asyncio.to_thread(kube.patch, "Pod", NS, "demo-g0-1", {"status": pending["status"]})
        await until(lambda: kube.get("Pod", NS, "demo-g0-2") is None)
        assert await asyncio.to_thread(kube.get, "Pod", NS, "demo-g0-0") is None, "the whole group goes"
        assert await asyncio.to_thread(kube.get, "Pod", NS, "demo-g1-0") is not None, "other groups stay"
        status = await until(lambda: kube.get("LockstepDeployment", NS, "demo")["status"]["groups"][0]
                             ["restarts"] == 1 and kube.get("LockstepDeployment", NS, "demo")["status"])
        assert not status["groups"][0]["pendingRecreate"] and status["groups"][1]["restarts"] == 0
        await events_posted(k, "RecreateDeferred", "GroupRecreated")
    run(scenario)


def test_deleted_rank_pod_recreates_group_and_delete_is_handled() -> None:
    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        await asyncio.to_thread(kube.create, cr({"model": {"path": "/m"}, "tensorParallelSize": 2}))
        g0 = await until(lambda: kube.get("StatefulSet", NS, "demo-g0"))
        for r in range(2):
            await asyncio.to_thread(kube.create, rank_pod("demo-g0", r, g0))
        await until(lambda: (kube.get("LockstepDeployment", NS, "demo") or {}).get("status", {}).get("readyGroups"))
        await asyncio.to_thread(kube.delete, "Pod", NS, "demo-g0-1")
        await until(lambda: kube.get("Pod", NS, "demo-g0-0") is None)
        await until(lambda: kube.get("LockstepDeployment", NS, "demo")["status"]["groups"][0]["restarts"] == 1)

        assert m.selector("demo", "rank")  # the pods the operator watches carry these labels
        await asyncio.to_thread(kube.delete, "LockstepDeployment", NS, "demo")
        await until(lambda: kube.get("LockstepDeployment", NS, "demo") is None)
        # A rank pod event after deletion must not make the operator act on a deployment that is gone.
        await asyncio.to_thread(kube.create, rank_pod("demo-g0", 0, g0, restarts=3))
        await asyncio.sleep(0.5)
        assert await asyncio.to_thread(kube.get, "Pod", NS, "demo-g0-0") is not None
    run(scenario)


@pytest.mark.parametrize("spec", [{"tensorParallelSize": 2}, {"model": {"builtin": False}}])
def test_invalid_spec_is_reported_not_built(spec: dict) -> None:
    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        await asyncio.to_thread(kube.create, cr(spec))
        status = await until(lambda: (kube.get("LockstepDeployment", NS, "demo") or {}).get("status"))
        assert status["phase"] == "Degraded"
        assert status["conditions"][0]["reason"] == "InvalidSpec"
        await events_posted(k, "InvalidSpec")
        assert await asyncio.to_thread(kube.get, "StatefulSet", NS, "demo-g0") is None
    run(scenario)


def test_rolling_a_group_settles_its_pending_recreate() -> None:
    """A roll replaces every pod of the group: a recreate that waited for a Pending pod is done with."""
    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        await asyncio.to_thread(kube.create, cr({"model": {"path": "/m"}, "tensorParallelSize": 2}))
        g0 = await until(lambda: kube.get("StatefulSet", NS, "demo-g0"))
        await asyncio.to_thread(kube.create, rank_pod("demo-g0", 0, g0, restarts=1))
        await asyncio.to_thread(kube.create, rank_pod("demo-g0", 1, g0, phase="Pending"))
        await until(lambda: any(g.get("pendingRecreate") for g in (kube.get("LockstepDeployment", NS, "demo") or {})
                                .get("status", {}).get("groups", [])))

        await asyncio.to_thread(kube.patch, "LockstepDeployment", NS, "demo",
                                {"metadata": {"generation": 2}, "spec": {"tensorParallelSize": 3}})
        await until(lambda: kube.get("Pod", NS, "demo-g0-1") is None)  # the roll replaces every pod

        def settled() -> bool:
            status = kube.get("LockstepDeployment", NS, "demo")["status"]
            return status.get("observedGeneration") == 2 and not status["groups"][0]["pendingRecreate"]
        await until(settled, timeout=10)  # the roll did what the recreate waited for
        new_g0 = await asyncio.to_thread(kube.get, "StatefulSet", NS, "demo-g0")
        for r in range(3):
            await asyncio.to_thread(kube.create, rank_pod("demo-g0", r, new_g0))
        await asyncio.sleep(0.5)
        assert await asyncio.to_thread(kube.get, "Pod", NS, "demo-g0-0") is not None, "fresh group recreated"
        status = (await asyncio.to_thread(kube.get, "LockstepDeployment", NS, "demo"))["status"]
        assert status["groups"][0]["restarts"] == 0
    run(scenario)


def test_group_token_secret_is_created_once_never_read_and_mounted() -> None:
    """One Secret per deployment, owned by it; a reconcile never rotates it, and the operator never reads it."""
    def secrets_requests() -> list[str]:
        return [r.method.value for r in list(k_ref[0]) if r.resource is not None and r.resource.plural == "secrets"]

    def token() -> str | None:
        try:
            return k_ref[0].objects["v1/secrets", NS, "demo-group-token"].raw["data"]["token"]
        except KeyError:
            return None

    k_ref: list[kmock.KubernetesEmulator] = []

    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        k_ref.append(k)
        await asyncio.to_thread(kube.create, cr({"model": {"path": "/m"}, "tensorParallelSize": 2}))
        await until(lambda: kube.get("Deployment", NS, "demo-coordinator"))
        first = await until(token)
        secret = k.objects["v1/secrets", NS, "demo-group-token"].raw
        assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-demo" and secret["immutable"] is True
        sts = await asyncio.to_thread(kube.get, "StatefulSet", NS, "demo-g0")
        dep = await asyncio.to_thread(kube.get, "Deployment", NS, "demo-coordinator")
        for pod in (sts["spec"]["template"]["spec"], dep["spec"]["template"]["spec"]):
            assert {"name": "group-token", "secret": {"secretName": "demo-group-token", "items": [
                {"key": "token", "path": "token"}]}} in pod["volumes"]
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            assert env["LOCKSTEP_GROUP_TOKEN_FILE"] == "/var/run/lockstep/group-token/token"

        before = len(secrets_requests())
        await asyncio.to_thread(kube.patch, "LockstepDeployment", NS, "demo",
                                {"metadata": {"generation": 2}, "spec": {"tensorParallelSize": 3}})
        await until(lambda: kube.get("StatefulSet", NS, "demo-g0")["spec"]["replicas"] == 3)
        await until(lambda: len(secrets_requests()) > before)  # the update's reconcile asked to create it again
        assert token() == first, "a reconcile must never rotate the group token"
        assert set(secrets_requests()) == {"POST"}, "the operator creates the Secret and never reads it"
    run(scenario)


def test_a_field_taken_out_of_the_spec_leaves_the_cluster() -> None:
    """A nodeSelector removed from the spec leaves the rolled group's and the coordinator's pod templates (a merge
    patch removes only what it sets to null), and networkPolicy: false deletes the groups' NetworkPolicies."""
    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        await asyncio.to_thread(kube.create, cr({"tensorParallelSize": 1, "groups": 1,
                                                 "nodeSelector": {"pool": "old-gpus"}}))
        sts = await until(lambda: kube.get("StatefulSet", NS, "demo-g0"))
        assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "old-gpus"}
        assert await until(lambda: kube.get("NetworkPolicy", NS, "demo-g0"))
        await until(lambda: kube.get("Deployment", NS, "demo-coordinator"))
        await asyncio.to_thread(kube.create, rank_pod("demo-g0", 0, sts))
        await asyncio.to_thread(kube.patch, "LockstepDeployment", NS, "demo",
                                {"metadata": {"generation": 2}, "spec": {"nodeSelector": None, "networkPolicy": False}})

        def settled() -> bool:
            sts = kube.get("StatefulSet", NS, "demo-g0")["spec"]["template"]["spec"]
            coord = kube.get("Deployment", NS, "demo-coordinator")["spec"]["template"]["spec"]
            return ("nodeSelector" not in sts and "nodeSelector" not in coord
                    and kube.get("NetworkPolicy", NS, "demo-g0") is None)

        await until(settled)
    run(scenario)


def test_the_uninstall_hook_deletes_the_deployment_while_the_operator_runs_and_waits_until_it_is_gone() -> None:
    """`helm uninstall` deletes the operator before the LockstepDeployment (Helm deletes the kinds it does not know
    last), which then waits on the operator's finalizer for ever; the chart's pre-delete hook
    (`lockstep_operator.uninstall`) deletes it first and returns once the operator has let it go."""
    from lockstep_operator.uninstall import delete_and_wait

    async def scenario(kube: Kube, k: kmock.KubernetesEmulator) -> None:
        await asyncio.to_thread(kube.create, cr({"tensorParallelSize": 1, "groups": 1}))
        await until(lambda: kube.get("StatefulSet", NS, "demo-g0"))
        await until(lambda: kube.get("LockstepDeployment", NS, "demo")["metadata"].get("finalizers"))
        assert await asyncio.to_thread(delete_and_wait, kube, NS, "demo", 20.0, 0.1)
        assert await asyncio.to_thread(kube.get, "LockstepDeployment", NS, "demo") is None
        assert await asyncio.to_thread(delete_and_wait, kube, NS, "demo", 1.0, 0.1)  # gone already: done
    run(scenario)
