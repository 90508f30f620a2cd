"""The operator's pod specs, run as local processes: their command lines and env really start a group.

A kubelet stand-in gives each container what a cluster would: the downward API (pod index, name,
namespace), DNS (pod and Service names resolve to 127.0.0.1) and volumes (host directories). Since every
pod here shares one host, every declared container port of every pod is remapped to its own free local
port, and every `host:port` and `*_PORT` value in an env var or an argument is rewritten through that
map, generically: nothing here knows which variable holds which address, so a spec that wires a rank to
the wrong pod, a port no pod declares or a name no Service has fails here. Secret volumes are written
from the Secrets given with the objects (the group token Secret the operator creates), so a pod that
names a Secret or a key that does not exist fails here too.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import http
from lockstep.local_group import free_port
from lockstep.proto_gen.lockstep.v1 import rank_pb2, rank_pb2_grpc
from lockstep_operator.manifests import build_all, group_token_secret
from lockstep_operator.resource import normalize

NAME, NAMESPACE, TP = "tiny", "ml", 2
TOKEN = "local-group-token-for-the-pod-specs"  # what the operator's Secret would hold
HOST_PORT = re.compile(r"(?<![\w.-])([A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):(\d{1,5})(?![\w.])")
BIND_ALL = ("0.0.0.0", "::", "127.0.0.1", "localhost")


@dataclass
class Pod:
    name: str
    labels: dict[str, str]
    spec: dict[str, Any]
    dns: set[str]  # names that resolve to this pod
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> local port
    named_ports: dict[str, int] = field(default_factory=dict)  # port name -> containerPort
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def local_port(self, port: int | str) -> int:
        number = self.named_ports.get(port) if isinstance(port, str) else port
        if number not in self.ports:
            raise ValueError(f"pod {self.name} declares no container port {port!r} (it has {sorted(self.ports)})")
        return self.ports[number]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path else ""


class LocalKubelet:
    """Pods of StatefulSets and Deployments as local processes, on one host, with cluster DNS and ports."""

    def __init__(self, objects: list[dict], namespace: str, cluster_domain: str, host_paths: dict[str, Path],
                 workdir: Path) -> None:
        self.namespace, self.domain, self.workdir = namespace, cluster_domain, workdir
        self.host_paths = host_paths  # hostPath / PVC claim name -> local directory
        self.services = [o for o in objects if o["kind"] == "Service"]
        self.secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
        self.configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
        self.pods: list[Pod] = []
        for obj in objects:
            if obj["kind"] == "StatefulSet":
                self._statefulset_pods(obj)
            elif obj["kind"] == "Deployment":
                self._deployment_pods(obj)
        for pod in self.pods:
            for c in pod.spec["containers"]:
                for p in c.get("ports", []):
                    pod.ports[p["containerPort"]] = free_port()
                    if "name" in p:
                        pod.named_ports[p["name"]] = p["containerPort"]

    def _suffixes(self, first: str) -> set[str]:
        """`a.b`, `a.b.ns`, `a.b.ns.svc`, `a.b.ns.svc.domain`: what a pod's search path resolves."""
        full = f"{first}.{self.namespace}.svc.{self.domain}".split(".")
        n = len(first.split("."))
        return {".".join(full[:k]) for k in range(n, len(full) + 1)}

    def _statefulset_pods(self, sts: dict) -> None:
        name, spec = sts["metadata"]["name"], sts["spec"]
        for i in range(spec["replicas"]):
            pod = f"{name}-{i}"
            labels = spec["template"]["metadata"]["labels"] | {
                "apps.kubernetes.io/pod-index": str(i), "statefulset.kubernetes.io/pod-name": pod}
            # A pod of a StatefulSet gets hostname `pod` and subdomain `serviceName` (the headless Service).
            self.pods.append(Pod(pod, labels, spec["template"]["spec"], {pod} | self._suffixes(
                f"{pod}.{spec['serviceName']}")))

    def _deployment_pods(self, dep: dict) -> None:
        name, spec = dep["metadata"]["name"], dep["spec"]
        for i in range(spec.get("replicas", 1)):
            pod = f"{name}-local{i}"
            self.pods.append(Pod(pod, dict(spec["template"]["metadata"]["labels"]), spec["template"]["spec"],
                                 {pod}))

    def _selected(self, selector: dict[str, str]) -> list[Pod]:
        return [p for p in self.pods if selector.items() <= p.labels.items()]

    def resolve(self, host: str, port: int) -> int:
        """The local port that `host:port` reaches from inside the cluster."""
        for pod in self.pods:
            if host in pod.dns:
                return pod.local_port(port)
        for svc in self.services:
            if host not in self._suffixes(svc["metadata"]["name"]):
                continue
            if svc["spec"].get("clusterIP") == "None":
                raise ValueError(f"{host}: a headless Service has no address of its own; name one of its pods")
            for p in svc["spec"]["ports"]:
                if p["port"] == port:
                    backends = self._selected(svc["spec"]["selector"])
                    if not backends:
                        raise ValueError(f"Service {svc['metadata']['name']} selects no pod")
                    return backends[0].local_port(p.get("targetPort", port))
            raise ValueError(f"Service {svc['metadata']['name']} has no port {port}")
        raise ValueError(f"{host!r} is neither a pod nor a Service of this deployment")

    def service_port(self, service: str, port_name: str) -> int:
        svc = next(s for s in self.services if s["metadata"]["name"] == service)
        port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == port_name)
        return self.resolve(f"{service}.{self.namespace}.svc.{self.domain}", port)

    def _mounts(self, pod: Pod, container: dict) -> list[tuple[str, Path]]:
        """(mountPath, local directory) of the container's volumes, longest path first."""
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        out = []
        for m in container.get("volumeMounts", []):
            vol = volumes[m["name"]]
            if "hostPath" in vol:
                local = self.host_paths[vol["hostPath"]["path"]]
            elif "persistentVolumeClaim" in vol:
                local = self.host_paths[vol["persistentVolumeClaim"]["claimName"]]
            elif "secret" in vol:
                local = self._secret_files(pod, vol)
            elif "configMap" in vol:
                local = self._configmap_files(pod, vol)
            elif "emptyDir" in vol:
                local = self.workdir / pod.name / m["name"]
                local.mkdir(parents=True, exist_ok=True)
            else:
                raise ValueError(f"pod {pod.name}: volume {m['name']} of an unsupported kind: {vol}")
            out.append((m["mountPath"].rstrip("/"), local / m.get("subPath", "")))
        return sorted(out, key=lambda mp: len(mp[0]), reverse=True)

    def _secret_files(self, pod: Pod, volume: dict) -> Path:
        """A Secret volume as the kubelet makes it: one file per item (or per key), read-only."""
        source = volume["secret"]
        secret = self.secrets.get(source["secretName"])
        if secret is None:
            raise ValueError(f"pod {pod.name}: volume {volume['name']} names Secret {source['secretName']!r}, "
                             "which does not exist")
        local = self.workdir / pod.name / volume["name"]
        local.mkdir(parents=True, exist_ok=True)
        for item in source.get("items") or [{"key": k, "path": k} for k in secret["data"]]:
            if item["key"] not in secret["data"]:
                raise ValueError(f"pod {pod.name}: Secret {source['secretName']} has no key {item['key']!r}")
            (local / item["path"]).write_bytes(base64.b64decode(secret["data"][item["key"]]))
            (local / item["path"]).chmod(0o444)
        return local

    def _configmap_files(self, pod: Pod, volume: dict) -> Path:
        """A ConfigMap volume: one file per key, with its cluster addresses made local (the coordinator's group
        list names rank pods)."""
        name = volume["configMap"]["name"]
        config = self.configmaps.get(name)
        if config is None:
            raise ValueError(f"pod {pod.name}: volume {volume['name']} names ConfigMap {name!r}, which does not exist")
        local = self.workdir / pod.name / volume["name"]
        local.mkdir(parents=True, exist_ok=True)
        for key, text in config["data"].items():
            (local / key).write_text(self._addresses(pod, f"ConfigMap {name} {key}", text))
        return local

    def _downward(self, pod: Pod, source: dict) -> str:
        path = source.get("fieldRef", {}).get("fieldPath")
        if path is None:
            raise ValueError(f"pod {pod.name}: unsupported env source {source}")
        m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        if m:
            if m.group(1) not in pod.labels:
                raise ValueError(f"pod {pod.name}: no label {m.group(1)!r} for the downward API")
            return pod.labels[m.group(1)]
        fields = {"metadata.name": pod.name, "metadata.namespace": self.namespace, "status.podIP": "127.0.0.1",
                  "spec.nodeName": "localhost"}
        if path not in fields:
            raise ValueError(f"pod {pod.name}: unsupported downward API field {path!r}")
        return fields[path]

    def _addresses(self, pod: Pod, key: str, value: str) -> str:
        """`value` with every cluster `host:port` made the local address it reaches."""
        def address(m: re.Match) -> str:
            host, port = m.group(1), int(m.group(2))
            if host in BIND_ALL:
                return f"{host}:{pod.local_port(port)}"
            return f"127.0.0.1:{self.resolve(host, port)}"

        try:
            return HOST_PORT.sub(address, value)
        except ValueError as exc:
            raise ValueError(f"pod {pod.name}, {key}={value!r}: {exc}") from None

    def rewrite(self, pod: Pod, container: dict, key: str, value: str) -> str:
        """One env value or argument, with cluster addresses, own ports and mount paths made local."""
        value = self._addresses(pod, key, value)
        if key.endswith("_PORT") and value.isdigit():
            value = str(pod.local_port(int(value)))
        for mount, local in self._mounts(pod, container):
            if value == mount or value.startswith(mount + "/"):
                return str(local) + value[len(mount):]
        return value

    def command(self, pod: Pod) -> tuple[list[str], dict[str, str]]:
        (container,) = pod.spec["containers"]
        env: dict[str, str] = {}
        for e in container.get("env", []):
            env[e["name"]] = (self._downward(pod, e["valueFrom"]) if "valueFrom" in e
                              else self.rewrite(pod, container, e["name"], e.get("value", "")))
        args = [self.rewrite(pod, container, "arg", a) for a in container.get("args", [])]
        exe, *rest = container["command"]
        local_exe = shutil.which(exe) or str(Path(sys.executable).with_name(exe))
        return [local_exe, *rest, *args], env

    def start(self, pods: list[Pod]) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
        for pod in pods:
            cmd, env = self.command(pod)
            pod.log_path = self.workdir / f"{pod.name}.log"
            with open(pod.log_path, "wb") as log:
                pod.proc = subprocess.Popen(cmd, env=base | {"OMP_NUM_THREADS": "1", "HOSTNAME": pod.name} | env,
                                            stdout=log, stderr=subprocess.STDOUT)

    def check_running(self) -> None:
        for pod in self.pods:
            if pod.proc is not None and pod.proc.poll() is not None:
                raise RuntimeError(f"pod {pod.name} exited with {pod.proc.returncode}:\n{pod.log()}")

    def stop(self) -> None:
        running = [p.proc for p in self.pods if p.proc is not None and p.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        for proc in running:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def spec(model_dir: Path) -> dict[str, Any]:
    """TP 2, one group, the tiny checkpoint on a volume mounted at /models (as a user would mount one)."""
    return normalize({
        "model": {"path": f"/models/{model_dir.name}"},
        "tensorParallelSize": TP, "groups": 1,
        "kvCache": {"pages": 64},
        "volumes": [{"name": "models", "hostPath": {"path": "/srv/models"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    })


@pytest.fixture
def kubelet(tiny_llama, tmp_path):
    s = spec(tiny_llama)
    objects = [*build_all(NAME, NAMESPACE, s), group_token_secret(NAME, NAMESPACE, TOKEN)]
    k = LocalKubelet(objects, NAMESPACE, s["clusterDomain"], {"/srv/models": tiny_llama.parent}, tmp_path)
    yield k
    k.stop()


def ranks(k: LocalKubelet) -> list[Pod]:
    return [p for p in k.pods if p.labels.get("app.kubernetes.io/component") == "rank"]


def coordinator(k: LocalKubelet) -> Pod:
    (pod,) = [p for p in k.pods if p.labels.get("app.kubernetes.io/component") == "coordinator"]
    return pod


def test_rewritten_env_wires_every_rank_to_its_own_pod(kubelet: LocalKubelet, tiny_llama: Path) -> None:
    """Resolution alone (no process): the addresses in the specs point at pods that declare those ports."""
    rank_pods = ranks(kubelet)
    assert len(rank_pods) == TP
    envs = [kubelet.command(p)[1] for p in rank_pods]
    grpc_ports = [int(e["LOCKSTEP_GRPC_PORT"]) for e in envs]
    assert grpc_ports == [p.local_port(50051) for p in rank_pods]
    assert len(set(grpc_ports)) == TP
    # Rank 0's store is the rendezvous of every rank, and it is a port rank 0's pod declares.
    assert {e["LOCKSTEP_RENDEZVOUS"] for e in envs} == {f"127.0.0.1:{rank_pods[0].local_port('store')}"}
    assert [e["LOCKSTEP_POD_INDEX"] for e in envs] == [str(i) for i in range(TP)]
    assert {e["LOCKSTEP_MODEL"] for e in envs} == {str(tiny_llama)}
    coord_env = kubelet.command(coordinator(kubelet))[1]
    groups = Path(coord_env["LOCKSTEP_GROUPS_FILE"]).read_text()  # the group list ConfigMap, mounted
    assert groups == "g0=" + ",".join(f"127.0.0.1:{p}" for p in grpc_ports) + "\n"
    assert coord_env["LOCKSTEP_MODEL"] == str(tiny_llama)
    assert int(coord_env["LOCKSTEP_HTTP_PORT"]) == kubelet.service_port(NAME, "http")
    # Every rank and the coordinator read the same group token from the Secret's mounted file.
    for env in [*envs, coord_env]:
        assert Path(env["LOCKSTEP_GROUP_TOKEN_FILE"]).read_text() == TOKEN and "LOCKSTEP_GROUP_TOKEN" not in env


def test_unknown_address_is_refused(kubelet: LocalKubelet) -> None:
    pod = coordinator(kubelet)
    (container,) = pod.spec["containers"]
    with pytest.raises(ValueError, match="neither a pod nor a Service"):
        kubelet.rewrite(pod, container, "LOCKSTEP_GROUPS", f"g0=tiny-g1-0.tiny-g1.{NAMESPACE}.svc:50051")
    with pytest.raises(ValueError, match="declares no container port 29501"):
        kubelet.rewrite(pod, container, "LOCKSTEP_GROUPS", f"g0=tiny-g0-0.tiny-g0.{NAMESPACE}:29501")


def grpc_serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_operator_pod_specs_serve_a_request(kubelet: LocalKubelet, tiny_llama: Path) -> None:
    torch.set_num_threads(1)
    rank_pods, coord = ranks(kubelet), coordinator(kubelet)
    kubelet.start(rank_pods)  # podManagementPolicy: Parallel
    kubelet.start([coord])
    (container,) = coord.spec["containers"]
    probe = container["readinessProbe"]["httpGet"]
    health_url = f"http://127.0.0.1:{coord.local_port(probe['port'])}{probe['path']}"
    deadline = time.monotonic() + 180
    while True:
        kubelet.check_running()
        try:
            if http("GET", health_url, timeout=2)[0] == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "coordinator never ready:\n" + coord.log()
        time.sleep(0.3)

    # The probes the kubelet runs on the ranks pass on the ports their specs name.
    for pod in rank_pods:
        (rank_container,) = pod.spec["containers"]
        assert grpc_serving(pod.local_port(rank_container["readinessProbe"]["grpc"]["port"])), pod.log()
        with grpc.insecure_channel(f"127.0.0.1:{pod.local_port('grpc')}") as channel:  # but not to strangers
            with pytest.raises(grpc.RpcError) as refused:
                rank_pb2_grpc.RankServiceStub(channel).Info(rank_pb2.InfoRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # Clients come in through the Service, by port name, as the operator's status endpoint says.
    url = f"http://127.0.0.1:{kubelet.service_port(NAME, 'http')}"
    status, models = http("GET", url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [tiny_llama.name], models
    status, body = http("POST", url + "/v1/completions", {
        "prompt": list(range(5, 45)), "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert status == 200, body
    tokens = body["choices"][0]["token_ids"]
    assert len(tokens) == 6 and all(isinstance(t, int) for t in tokens), body
    assert body["usage"]["completion_tokens"] == 6
    assert http("GET", url + "/health")[0] == 200
    kubelet.check_running()
