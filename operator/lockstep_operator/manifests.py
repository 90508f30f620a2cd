"""Pure builders: a LockstepDeployment (name, namespace, normalized spec) in, manifest dicts out.

Nothing here talks to a cluster, so every object the operator can create is testable (and validated
against the Kubernetes schemas) without one. Ownership (`kopf.adopt`) is added by the handlers.

With `spec.tls`, the ranks serve their gRPC port over TLS from the named Secret (tls.crt, tls.key, ca.crt),
the coordinator verifies them with its ca.crt, and the kubelet's gRPC probes, which cannot speak TLS, go to
the ranks' plaintext health port (grpc.health.v1 alone).

The coordinator reads its groups from a ConfigMap (`groups_configmap`) mounted as a file it re-reads, so
a change of `spec.groups` changes only that ConfigMap, never the coordinator's pod template: the
coordinator (Recreate) is not restarted, and the requests in flight on the other groups go on.

The group token Secret (`group_token_secret`) is not in `build_all`: it holds a random value, so the
handlers create it once and never apply it again (a reconcile must not rotate it). Ranks and the
coordinator read it from a mounted file (`LOCKSTEP_GROUP_TOKEN_FILE`), never from the pod spec.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from typing import Any

from lockstep_operator.names import (  # noqa: F401 - the builders' callers read these names here too
    ANNOTATION_HASH,
    CACHE_MOUNT,
    GROUP_TOKEN_KEY,
    GROUP_TOKEN_MOUNT,
    GROUP_TOKEN_VOLUME,
    GROUPS_KEY,
    GROUPS_MOUNT,
    GROUPS_VOLUME,
    LABEL_COMPONENT,
    LABEL_GROUP,
    LABEL_GROUP_INDEX,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MODEL_MOUNT,
    RANK_GRPC_PORT,
    RANK_HEALTH_PORT,
    RANK_STORE_PORT,
    TLS_MOUNT,
    TLS_VOLUME,
    coordinator_name,
    group_labels,
    group_name,
    group_token_secret_name,
    groups_configmap_name,
    labels,
    rank_host,
    rank_selector_string,
    selector,
)

Manifest = dict[str, Any]


def groups_file(name: str, namespace: str, spec: dict[str, Any]) -> str:
    """The coordinator's groups file: one `g0=h:p,h:p` line per group, ranks in rank order."""
    lines = []
    for i in range(spec["groups"]):
        hosts = [f"{rank_host(name, namespace, i, r, spec['clusterDomain'])}:{RANK_GRPC_PORT}"
                 for r in range(spec["tensorParallelSize"])]
        lines.append(f"g{i}=" + ",".join(hosts) + "\n")
    return "".join(lines)


def groups_configmap(name: str, namespace: str, spec: dict[str, Any]) -> Manifest:
    """The group list the coordinator watches (LOCKSTEP_GROUPS_FILE): scaling groups rewrites only this."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": groups_configmap_name(name), "namespace": namespace,
                     "labels": labels(name, "coordinator")},
        "data": {GROUPS_KEY: groups_file(name, namespace, spec)},
    }


def _env(pairs: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in pairs.items()]


def _model_env_and_mounts(spec: dict[str, Any]) -> tuple[str, list[Manifest], list[Manifest]]:
    """LOCKSTEP_MODEL, the volumes and the mounts that put the checkpoint where it says."""
    model = spec["model"]
    volumes: list[Manifest] = [{"name": "cache", "emptyDir": {}}]
    mounts: list[Manifest] = [{"name": "cache", "mountPath": CACHE_MOUNT}]
    if model["builtin"]:
        path = "builtin"
    elif "pvc" in model:
        pvc = model["pvc"]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": pvc["claimName"],
                                                                   "readOnly": pvc["readOnly"]}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": pvc["readOnly"]})
        path = f"{MODEL_MOUNT}/{pvc['path'].strip('/')}".rstrip("/")
    else:
        path = model["path"]
    volumes += spec.get("volumes", [])
    mounts += spec.get("volumeMounts", [])
    return path, volumes, mounts


def _common_env(spec: dict[str, Any], model_path: str) -> dict[str, str]:
    env = {
        "LOCKSTEP_MODEL": model_path,
        "LOCKSTEP_PAGE_SIZE": str(spec["kvCache"]["pageSize"]),
        "LOCKSTEP_PREFIX_CACHING": "1" if spec["kvCache"]["prefixCaching"] else "0",
        # a rank stuck in a collective without its peer exits soon after the coordinator gives up on the peer
        "LOCKSTEP_COLLECTIVE_TIMEOUT_SECONDS": str(2 * spec["agreement"]["deadRankTimeoutSeconds"]),
        "XDG_CACHE_HOME": CACHE_MOUNT,
    }
    return env | _token_mount()[0]


def rebalance_env(spec: dict[str, Any]) -> dict[str, str]:
    """The coordinator's --rebalance-* settings from `kvCache.rebalance`.

    The coordinator alone decides a rebalance (the ranks carry out the split its plan names), so only its
    container gets these: on a rank they would be dead settings that roll every group when changed."""
    rebalance = spec["kvCache"]["rebalance"]
    return {
        "LOCKSTEP_REBALANCE_ENABLED": "1" if rebalance["enabled"] else "0",
        "LOCKSTEP_REBALANCE_INTERVAL_STEPS": str(rebalance["intervalSteps"]),
        "LOCKSTEP_REBALANCE_COOLDOWN": str(rebalance["cooldownSeconds"]),
        "LOCKSTEP_REBALANCE_MIN_SAMPLES": str(rebalance["minSamples"]),
        "LOCKSTEP_REBALANCE_THRESHOLD": str(rebalance["threshold"]),
    }


def _token_volume(name: str) -> Manifest:
    return {"name": GROUP_TOKEN_VOLUME, "secret": {"secretName": group_token_secret_name(name),
                                                    "items": [{"key": GROUP_TOKEN_KEY, "path": GROUP_TOKEN_KEY}]}}


def _token_mount() -> tuple[dict[str, str], Manifest]:
    """The env that names the token file, and the read-only mount that holds it."""
    return ({"LOCKSTEP_GROUP_TOKEN_FILE": f"{GROUP_TOKEN_MOUNT}/{GROUP_TOKEN_KEY}"},
            {"name": GROUP_TOKEN_VOLUME, "mountPath": GROUP_TOKEN_MOUNT, "readOnly": True})


def _rank_tls(spec: dict[str, Any], component: str) -> tuple[dict[str, str], list[Manifest], list[Manifest]]:
    """The env, volumes and mounts of `spec.tls` for a rank or the coordinator (none without `spec.tls`).

    Each gets only the Secret's keys it reads: a rank its certificate and key (and the CA when it asks for
    client certificates), the coordinator the CA (and the client certificate with `clientAuth`)."""
    tls = spec.get("tls")
    if not tls:
        return {}, [], []
    if component == "rank":
        keys = ["tls.crt", "tls.key"] + (["ca.crt"] if tls["clientAuth"] else [])
        env = {"LOCKSTEP_TLS_CERT": f"{TLS_MOUNT}/tls.crt", "LOCKSTEP_TLS_KEY": f"{TLS_MOUNT}/tls.key",
               "LOCKSTEP_HEALTH_PORT": str(RANK_HEALTH_PORT)}
        if tls["clientAuth"]:
            env["LOCKSTEP_TLS_CA"] = f"{TLS_MOUNT}/ca.crt"
    else:
        keys = ["ca.crt"] + (["tls.crt", "tls.key"] if tls["clientAuth"] else [])
        env = {"LOCKSTEP_RANK_TLS_CA": f"{TLS_MOUNT}/ca.crt"}
        if tls["clientAuth"]:
            env |= {"LOCKSTEP_RANK_TLS_CERT": f"{TLS_MOUNT}/tls.crt", "LOCKSTEP_RANK_TLS_KEY": f"{TLS_MOUNT}/tls.key"}
        if tls["serverName"]:
            env["LOCKSTEP_RANK_TLS_SERVER_NAME"] = tls["serverName"]
    volume = {"name": TLS_VOLUME, "secret": {"secretName": tls["secretName"],
                                              "items": [{"key": k, "path": k} for k in keys]}}
    return env, [volume], [{"name": TLS_VOLUME, "mountPath": TLS_MOUNT, "readOnly": True}]


def group_token_secret(name: str, namespace: str, token: str) -> Manifest:
    """The deployment's group token; immutable, so that only deleting it (and restarting the pods) rotates it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": group_token_secret_name(name), "namespace": namespace,
                     "labels": labels(name, "group-token")},
        "type": "Opaque",
        "immutable": True,
        "data": {GROUP_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def _pod_extras(spec: dict[str, Any]) -> Manifest:
    extras: Manifest = {}
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets"):
        if spec.get(key):
            extras[key] = spec[key]
    return extras


def _coordinator_extras(extras: Manifest) -> Manifest:
    """The ranks' scheduling fields the coordinator shares: it runs on the nodes they run on, so it takes their
    node selection and their tolerations (pinned to tainted GPU nodes without them it would stay Pending), but not
    their pod (anti-)affinity, whose terms are about rank pods."""
    out = {k: v for k, v in extras.items() if k in ("nodeSelector", "tolerations", "imagePullSecrets")}
    node = extras.get("affinity", {}).get("nodeAffinity")
    if node:
        out["affinity"] = {"nodeAffinity": node}
    return out


def template_hash(template: Manifest) -> str:
    """A short digest of a pod template: a group whose pods carry another one must be rolled."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def rank_pod_template(name: str, namespace: str, spec: dict[str, Any], index: int) -> Manifest:
    """The pod of one rank of group `index`; its rank is the StatefulSet pod index."""
    g = group_name(name, index)
    model_path, volumes, mounts = _model_env_and_mounts(spec)
    tls_env, tls_volumes, tls_mounts = _rank_tls(spec, "rank")
    rendezvous = rank_host(name, namespace, index, 0, spec["clusterDomain"])
    env = _env(_common_env(spec, model_path) | {
        "LOCKSTEP_WORLD_SIZE": str(spec["tensorParallelSize"]),
        "LOCKSTEP_RENDEZVOUS": f"{rendezvous}:{RANK_STORE_PORT}",
        "LOCKSTEP_HOST": "0.0.0.0",
        "LOCKSTEP_GRPC_PORT": str(RANK_GRPC_PORT),
        "LOCKSTEP_KV_PAGES": str(spec["kvCache"]["pages"]),
        "LOCKSTEP_KV_MEMORY_FRACTION": str(spec["kvCache"]["memoryFraction"]),
    } | tls_env)
    env.insert(0, {"name": "LOCKSTEP_POD_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}})
    env += spec.get("env", [])
    ports = [{"name": "grpc", "containerPort": RANK_GRPC_PORT, "protocol": "TCP"},
             {"name": "store", "containerPort": RANK_STORE_PORT, "protocol": "TCP"}]
    if tls_env:  # the kubelet's gRPC probes cannot speak TLS: they use the plaintext health port
        ports.append({"name": "health", "containerPort": RANK_HEALTH_PORT, "protocol": "TCP"})
    grpc_probe = {"grpc": {"port": RANK_HEALTH_PORT if tls_env else RANK_GRPC_PORT}}
    container = {
        "name": "rank",
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["lockstep", "rank"],
        "env": env,
        "ports": ports,
        "resources": spec["resources"],
        "startupProbe": grpc_probe | {"periodSeconds": 10, "failureThreshold": 90},
        "readinessProbe": grpc_probe | {"periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": grpc_probe | {"periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": mounts + [{"name": "dshm", "mountPath": "/dev/shm"}, _token_mount()[1]] + tls_mounts,
    }
    template: Manifest = {
        "metadata": {"labels": labels(name, "rank", g)},
        "spec": {
            "containers": [container],
            "volumes": volumes + [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, _token_volume(name)]
            + tls_volumes,
            "terminationGracePeriodSeconds": 30,
            "enableServiceLinks": False,
        } | _pod_extras(spec),
    }
    template["metadata"]["annotations"] = {ANNOTATION_HASH: template_hash(template)}
    return template


def group_statefulset(name: str, namespace: str, spec: dict[str, Any], index: int) -> Manifest:
    """One group: TP pods started together (Parallel) and replaced only as a whole (OnDelete)."""
    g = group_name(name, index)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": g, "namespace": namespace, "labels": group_labels(name, index)},
        "spec": {
            "serviceName": g,
            "replicas": spec["tensorParallelSize"],
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": selector(name, "rank", g)},
            "template": rank_pod_template(name, namespace, spec, index),
        },
    }


def group_service(name: str, namespace: str, index: int) -> Manifest:
    """Headless, and publishing not-ready pods: ranks must resolve each other before they are ready."""
    g = group_name(name, index)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": g, "namespace": namespace, "labels": group_labels(name, index)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(name, "rank", g),
            "ports": [{"name": "grpc", "port": RANK_GRPC_PORT, "targetPort": RANK_GRPC_PORT},
                      {"name": "store", "port": RANK_STORE_PORT, "targetPort": RANK_STORE_PORT}],
        },
    }


def group_network_policy(name: str, namespace: str, index: int) -> Manifest:
    """The coordinator reaches a rank's gRPC port; the group's own ranks reach every port (collectives)."""
    g = group_name(name, index)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": g, "namespace": namespace, "labels": group_labels(name, index)},
        "spec": {
            "podSelector": {"matchLabels": selector(name, "rank", g)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": selector(name, "coordinator")}}],
                 "ports": [{"protocol": "TCP", "port": RANK_GRPC_PORT}]},
                {"from": [{"podSelector": {"matchLabels": selector(name, "rank", g)}}]},
            ],
        },
    }


def coordinator_deployment(name: str, namespace: str, spec: dict[str, Any]) -> Manifest:
    """One coordinator (Recreate: two coordinators must never drive the same ranks at once). Its groups come
    from the `groups_configmap` file, so the pod template does not depend on `spec.groups`."""
    coord = spec["coordinator"]
    model_path, volumes, mounts = _model_env_and_mounts(spec)
    tls_env, tls_volumes, tls_mounts = _rank_tls(spec, "coordinator")
    pairs = _common_env(spec, model_path) | tls_env | {
        "LOCKSTEP_GROUPS_FILE": f"{GROUPS_MOUNT}/{GROUPS_KEY}",
        "LOCKSTEP_HOST": "0.0.0.0",
        "LOCKSTEP_HTTP_PORT": str(coord["httpPort"]),
        "LOCKSTEP_GRPC_PORT": str(coord["grpcPort"]),
        "LOCKSTEP_API_WORKERS": str(coord["apiWorkers"]),
        "LOCKSTEP_HTTP_TIMEOUT_KEEP_ALIVE": str(coord["httpKeepAliveSeconds"]),
        "LOCKSTEP_WATCHDOG_TIMEOUT_SECONDS": str(coord["watchdogTimeoutSeconds"]),
        "LOCKSTEP_MAX_BATCHED_TOKENS": str(spec["scheduler"]["maxNumBatchedTokens"]),
        "LOCKSTEP_MAX_NUM_SEQS": str(spec["scheduler"]["maxNumSeqs"]),
        "LOCKSTEP_LONG_PREFILL_TOKEN_THRESHOLD": str(spec["scheduler"]["longPrefillTokenThreshold"]),
        "LOCKSTEP_STALL_THRESHOLD_SECONDS": str(spec["agreement"]["stallThresholdSeconds"]),
        "LOCKSTEP_DEAD_RANK_TIMEOUT_SECONDS": str(spec["agreement"]["deadRankTimeoutSeconds"]),
        "LOCKSTEP_REPLAY_TIMEOUT_SECONDS": str(spec["agreement"]["replayTimeoutSeconds"]),
    } | rebalance_env(spec)
    if spec["model"].get("servedModelName"):
        pairs["LOCKSTEP_SERVED_MODEL_NAME"] = spec["model"]["servedModelName"]
    container = {
        "name": "coordinator",
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["lockstep", "coordinator"],
        "env": _env(pairs) + spec.get("env", []),
        "ports": [{"name": "http", "containerPort": coord["httpPort"], "protocol": "TCP"},
                  {"name": "grpc", "containerPort": coord["grpcPort"], "protocol": "TCP"}],
        "resources": coord["resources"],
        # Ready only when every rank of at least one group is up (that is what /health says);
        # alive as long as it serves HTTP, so a down group never restarts the coordinator.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": mounts + [_token_mount()[1], {"name": GROUPS_VOLUME, "mountPath": GROUPS_MOUNT,
                                                       "readOnly": True}] + tls_mounts,
    }
    pod_extras = _coordinator_extras(_pod_extras(spec))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": coordinator_name(name), "namespace": namespace,
                     "labels": labels(name, "coordinator")},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(name, "coordinator")},
            "template": {
                "metadata": {"labels": labels(name, "coordinator")},
                "spec": {"containers": [container], "enableServiceLinks": False,
                         "terminationGracePeriodSeconds": coordinator_stop_seconds(spec),
                         "volumes": volumes + [_token_volume(name), _groups_volume(name)] + tls_volumes} | pod_extras,
            },
        },
    }


def coordinator_stop_seconds(spec: dict[str, Any]) -> int:
    """Kubernetes' wait before it kills the coordinator: its grace (5 s, or LOCKSTEP_SHUTDOWN_GRACE_SECONDS in
    `spec.env`; a bad value fails the pod's start instead), max(grace, 5) s for its servers, 15 s for the rest
    of its bounded stop (docs/runbook.md) and 5 to spare; never under Kubernetes' own 30."""
    grace = 5.0
    for var in spec.get("env", []):
        if var.get("name") == "LOCKSTEP_SHUTDOWN_GRACE_SECONDS" and "value" in var:
            try:
                value = float(var["value"])
            except (TypeError, ValueError):
                continue
            if math.isfinite(value) and 0 <= value <= 3600:
                grace = value
    return max(30, math.ceil(grace + max(grace, 5.0) + 20))


def _groups_volume(name: str) -> Manifest:
    return {"name": GROUPS_VOLUME, "configMap": {"name": groups_configmap_name(name)}}


def coordinator_service(name: str, namespace: str, spec: dict[str, Any]) -> Manifest:
    coord = spec["coordinator"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name, "coordinator")},
        "spec": {
            "type": coord["serviceType"],
            "selector": selector(name, "coordinator"),
            "ports": [{"name": "http", "port": coord["httpPort"], "targetPort": "http", "protocol": "TCP"},
                      {"name": "grpc", "port": coord["grpcPort"], "targetPort": "grpc", "protocol": "TCP"}],
        },
    }


def endpoint(name: str, namespace: str, spec: dict[str, Any]) -> str:
    return f"http://{name}.{namespace}.svc.{spec['clusterDomain']}:{spec['coordinator']['httpPort']}"


def group_manifests(name: str, namespace: str, spec: dict[str, Any], index: int) -> list[Manifest]:
    out = [group_service(name, namespace, index), group_statefulset(name, namespace, spec, index)]
    if spec["networkPolicy"]:
        out.append(group_network_policy(name, namespace, index))
    return out


def build_all(name: str, namespace: str, spec: dict[str, Any]) -> list[Manifest]:
    """Every object of one LockstepDeployment, from a normalized spec (see `resource.normalize`)."""
    out: list[Manifest] = []
    for i in range(spec["groups"]):
        out += group_manifests(name, namespace, spec, i)
    out += [coordinator_service(name, namespace, spec), groups_configmap(name, namespace, spec),
            coordinator_deployment(name, namespace, spec)]
    return out
