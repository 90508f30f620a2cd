"""The LockstepDeployment CustomResourceDefinition, built in Python.

This is the single source of the resource's schema: the chart's `crds/` file is generated from it
(`python -m lockstep_operator.crd > helm/lockstep/crds/lockstepdeployments.yaml`, checked by a test), and so is
`deployment.spec` in the chart's values.schema.json (`python -m lockstep_operator.crd --values-schema FILE`
rewrites it there), so a misspelt field fails `helm install` instead of being pruned by the API server;
and the operator's own defaults (`resource.py`) are read from it, so the API server, the chart and
the operator can never disagree on a default or a range.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import yaml

GROUP = "lockstep.dev"
VERSION = "v1alpha1"
PLURAL = "lockstepdeployments"
KIND = "LockstepDeployment"
CRD_NAME = f"{PLURAL}.{GROUP}"

Schema = dict[str, Any]


def _scalar(kind: str, description: str = "", **fields: Any) -> Schema:
    """One scalar schema; fields given as None are left out (their names are already JSON Schema's)."""
    s: Schema = {"type": kind, **{k: v for k, v in fields.items() if v is not None}}
    if description:
        s["description"] = description
    return s


def _int(minimum: int | None = None, maximum: int | None = None, default: int | None = None,
         description: str = "") -> Schema:
    return _scalar("integer", description, minimum=minimum, maximum=maximum, default=default)


def _num(minimum: float, maximum: float | None = None, default: float | None = None,
         exclusive_minimum: bool = False, description: str = "") -> Schema:
    return _scalar("number", description, minimum=minimum, exclusiveMinimum=exclusive_minimum or None,
                   maximum=maximum, default=default)


def _str(default: str | None = None, enum: list[str] | None = None, description: str = "",
         min_length: int | None = None) -> Schema:
    return _scalar("string", description, enum=enum, default=default, minLength=min_length)


def _obj(properties: dict[str, Schema], default: Any = None, description: str = "",
         required: list[str] | None = None) -> Schema:
    s: Schema = {"type": "object", "properties": properties}
    if default is not None:
        s["default"] = default
    if required:
        s["required"] = required
    if description:
        s["description"] = description
    return s


def _opaque(kind: str, description: str, required: tuple[str, ...] = ()) -> Schema:
    """A field holding a core Kubernetes type, passed through to the pod spec as given; an array's items must
    hold the `required` strings, so an item Kubernetes would refuse in the pod spec is refused in the resource
    itself (at `kubectl apply` or `helm install`), not later in the operator's event."""
    if kind == "array":
        item: Schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        if required:
            item |= {"required": list(required), "properties": {name: _str(min_length=1) for name in required}}
        return {"type": "array", "description": description, "items": item}
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


# A resource quantity as Kubernetes writes one (resource.Quantity), without a sign: no resource is negative.
_DECIMAL = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY_PATTERN = rf"^{_DECIMAL}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_DECIMAL}))?$"


def _quantities(description: str) -> Schema:
    return {"type": "object", "description": description,
            "additionalProperties": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string"}],
                                     "pattern": QUANTITY_PATTERN, "x-kubernetes-int-or-string": True}}


def _resources(default: Schema, description: str) -> Schema:
    return _obj({"requests": _quantities("Minimum resources."),
                 "limits": _quantities("Maximum resources.")}, default=default, description=description)


def _model_schema() -> Schema:
    """Where the checkpoint comes from: exactly one of builtin, path, pvc."""
    model = _obj(
        {
            "builtin": {"type": "boolean", "default": False,
                        "description": "Serve the built-in SmolLM2-135M-Instruct (TP 1 or 3)."},
            "path": _str(description="Checkpoint directory inside the container (image or extra volume)."),
            "pvc": _obj({"claimName": _str(min_length=1, description="The claim holding the model."),
                         "path": _str(default="", description="Checkpoint directory inside the claim."),
                         "readOnly": {"type": "boolean", "default": True}},
                        required=["claimName"]),
            "servedModelName": _str(description="Name in /v1/models (default: the directory's name)."),
        },
        default={"builtin": True},
        description="Where the checkpoint comes from: exactly one of builtin, path, pvc.",
    )
    model["x-kubernetes-validations"] = [{
        "rule": "(self.builtin ? 1 : 0) + (has(self.path) ? 1 : 0) + (has(self.pvc) ? 1 : 0) == 1",
        "message": "model must set exactly one of builtin: true, path, pvc",
    }]
    return model


def _rebalance_schema() -> Schema:
    """When the coordinator moves a hybrid model's KV split between its pools (DESIGN.md "Rebalance agreement").

    Read by the coordinator only (it decides; the ranks carry out the split its plan names), so changing
    it restarts the coordinator and never rolls a group. Ranges are the coordinator's own flags' ranges.
    """
    return _obj(
        {
            "enabled": {"type": "boolean", "default": True,
                        "description": "Move the split between the full and sliding KV pools as the workload "
                                       "changes; false keeps the split the ranks started with."},
            "intervalSteps": _int(1, None, 10, "Check at every plan step that is a multiple of this (>= 1)."),
            "cooldownSeconds": _num(0, None, 120, description=(
                "Seconds after a rebalance before the next one, on the coordinator's clock (>= 0).")),
            "minSamples": _int(0, None, 2000, "Finished requests sampled since the last rebalance before the "
                                              "next one (>= 0)."),
            "threshold": _num(1.0, None, 1.25, description=(
                "Rebalance only when a pool is off its target size by more than this ratio (>= 1.0).")),
        },
        default={},
        description="Rebalance of a hybrid model's KV pools; the coordinator's --rebalance-* flags.",
    )


def _tls_schema() -> Schema:
    """TLS on the ranks' gRPC port. No default: without `tls` the ranks speak plaintext (the group token still
    guards them), so an existing deployment keeps its pods until someone asks for TLS."""
    return _obj(
        {
            "secretName": _str(min_length=1, description=(
                "Secret with tls.crt and tls.key (the ranks' certificate and key) and ca.crt (the CA that signed "
                "it), as cert-manager writes them. Mounted into every rank and the coordinator; read at start, "
                "so a new certificate takes effect when the pods restart.")),
            "serverName": _str(default="", description=(
                "The name the coordinator verifies in every rank's certificate. Empty: each rank's own DNS name "
                "(NAME-gN-R.NAME-gN.NAMESPACE.svc.CLUSTER_DOMAIN), so the certificate must cover "
                "*.NAME-gN.NAMESPACE.svc.CLUSTER_DOMAIN for every group N.")),
            "clientAuth": {"type": "boolean", "default": False, "description": (
                "Mutual TLS: the ranks also require a client certificate signed by ca.crt, and the coordinator "
                "presents the Secret's tls.crt/tls.key (which must then allow client authentication).")},
        },
        required=["secretName"],
        description=("TLS on the ranks' gRPC port (the coordinator verifies them with ca.crt). The kubelet's "
                     "gRPC probes cannot speak TLS, so they go to a plaintext port that serves health checks "
                     "only."),
    )


def _runtime_schemas() -> dict[str, Schema]:
    """How the services run: KV cache, scheduler, agreement timeouts, rollout, coordinator."""
    return {
        "kvCache": _obj(
            {
                "pageSize": _int(1, 1024, 16, "Tokens per KV page."),
                "memoryFraction": _num(0, 1, 0.9, exclusive_minimum=True,
                                       description="Share of free device memory for KV pages."),
                "pages": _int(0, None, 0, "KV pages per pool; 0 uses memoryFraction."),
                "prefixCaching": {"type": "boolean", "default": True},
                "rebalance": _rebalance_schema(),
            },
            default={},
        ),
        "scheduler": _obj(
            {
                "maxNumBatchedTokens": _int(1, None, 512, "Token budget per step."),
                "maxNumSeqs": _int(1, None, 64, "Running requests per group."),
                "longPrefillTokenThreshold": _int(0, None, 0, (
                    "The most tokens of a step one request's prefill chunk takes, so short requests are admitted "
                    "beside a long prompt (vLLM's --long-prefill-token-threshold); 0: no cap.")),
            },
            default={},
        ),
        "agreement": _obj(
            {
                "stallThresholdSeconds": _num(0, 86400, 5, exclusive_minimum=True,
                                              description="A longer agreement wait is stalled."),
                "deadRankTimeoutSeconds": _num(0, 43200, 30, exclusive_minimum=True, description=(
                    "A rank silent this long is dead (at most 12 h: a rank's collectives time out at twice "
                    "this, and at most at 24 h).")),
                "replayTimeoutSeconds": _num(0, 86400, 300, description=(
                    "How long the requests of a group that went down wait for a group to take them when "
                    "no other is up (0: they fail at once with a retriable 503).")),
            },
            default={},
        ),
        "rollout": _obj(
            {
                "drainTimeoutSeconds": _int(0, None, 120, (
                    "Before a group is rolled, recreated or removed, the coordinator drains it (no new request, "
                    "its running ones finish or move to another group) for at most this long, then the operator "
                    "goes on anyway. 0: no drain.")),
            },
            default={},
        ),
        "coordinator": _obj(
            {
                "serviceType": _str(default="ClusterIP", enum=["ClusterIP", "NodePort", "LoadBalancer"]),
                "httpPort": _int(1, 65535, 8000),
                "grpcPort": _int(1, 65535, 8001),
                "apiWorkers": _int(0, 64, 0, "HTTP API frontend processes in the coordinator's pod, sharing its "
                                   "port and fed one message per step (vLLM's --api-server-count); 0: the API runs "
                                   "on the coordinator's own event loop. Give the pod a CPU per frontend."),
                "httpKeepAliveSeconds": _num(0, 86400, 65, exclusive_minimum=True, description=(
                    "How long an idle HTTP connection stays open. Keep it above the idle timeout of whatever "
                    "reuses connections in front (nginx and AWS ALB: 60 s; Google Cloud's: 600 s), or it may "
                    "send on a connection being closed and answer 502.")),
                "watchdogTimeoutSeconds": _num(0, 86400, 120, description=(
                    "End the coordinator, with every thread's stack in its log, when its event loop stalls this "
                    "long, so that the kubelet starts it again: a hung coordinator still accepts TCP connections "
                    "and answers the ranks' keepalive pings, so neither a tcpSocket probe nor the ranks would "
                    "notice. 0: never.")),
                "resources": _resources({"requests": {"cpu": "1", "memory": "2Gi"}},
                                        "Coordinator resources (it runs no model)."),
            },
            default={},
        ),
    }


def spec_schema() -> Schema:
    """The openAPIV3Schema of `.spec`."""
    spec = _obj(
        {
            "image": _str(default="ghcr.io/lockstep-dev/lockstep:0.1.0", min_length=1,
                          description="Image with the `lockstep` command."),
            "imagePullPolicy": _str(default="IfNotPresent", enum=["Always", "IfNotPresent", "Never"]),
            "imagePullSecrets": {"type": "array", "description": "LocalObjectReferences for private registries.",
                                 "items": _obj({"name": _str(min_length=1)}, required=["name"])},
            "model": _model_schema(),
            "tensorParallelSize": _int(1, 64, 1, "Ranks per group (pods per StatefulSet)."),
            "groups": _int(0, 256, 1, "Data-parallel replicas: one StatefulSet each."),
            "resources": _resources({"limits": {"nvidia.com/gpu": 1}}, "Per-rank resources."),
            **_runtime_schemas(),
            "tls": _tls_schema(),
            "networkPolicy": {"type": "boolean", "default": True,
                              "description": "Only the coordinator and the group's ranks reach a rank."},
            "clusterDomain": _str(default="cluster.local", min_length=1),
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": {"type": "array", "description": "Tolerations for rank pods (and the coordinator's).",
                            "items": _obj({"key": _str(), "operator": _str(enum=["Exists", "Equal"]),
                                           "value": _str(),
                                           "effect": _str(enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"]),
                                           "tolerationSeconds": _int()})},
            "affinity": _opaque("object", "Affinity for rank pods."),
            "env": _opaque("array", "Extra EnvVars for every container.", ("name",)),
            "volumes": _opaque("array", "Extra Volumes for rank and coordinator pods.", ("name",)),
            "volumeMounts": _opaque("array", "Extra VolumeMounts for every container.", ("name", "mountPath")),
        },
    )
    spec["x-kubernetes-validations"] = [{
        "rule": "!self.model.builtin || self.tensorParallelSize in [1, 3]",
        "message": "the built-in model (9 attention heads, 3 KV heads) needs tensorParallelSize 1 or 3",
    }, {
        "rule": "self.coordinator.httpPort != self.coordinator.grpcPort",
        "message": "coordinator.httpPort and coordinator.grpcPort must differ",
    }, {
        "rule": "self.coordinator.watchdogTimeoutSeconds == 0.0 || self.coordinator.watchdogTimeoutSeconds > 1.0",
        "message": "coordinator.watchdogTimeoutSeconds must be 0 (off) or more than 1 (the watchdog's tick)",
    }, {
        "rule": "self.scheduler.maxNumBatchedTokens >= self.scheduler.maxNumSeqs",
        "message": "scheduler.maxNumBatchedTokens must be at least scheduler.maxNumSeqs (the coordinator refuses less)",
    }]
    return spec


def status_schema() -> Schema:
    condition = _obj({
        "type": _str(enum=["Ready", "Progressing", "Degraded", "Draining", "AgreementStalled"]),
        "status": _str(enum=["True", "False", "Unknown"]),
        "reason": _str(),
        "message": _str(),
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"},
    }, required=["type", "status"])
    group = _obj({
        "name": _str(),
        "ready": {"type": "boolean"},
        "readyRanks": {"type": "integer"},
        "restarts": {"type": "integer"},
        "pendingRecreate": {"type": "boolean"},
        "draining": {"type": "boolean", "description": "The coordinator is draining it before a roll, "
                                                       "recreate or removal."},
    }, required=["name"])
    return _obj({
        "phase": _str(enum=["Pending", "Progressing", "Ready", "Degraded"]),
        "observedGeneration": {"type": "integer"},
        "replicas": {"type": "integer", "description": "Groups that exist (the scale subresource)."},
        "readyGroups": {"type": "integer"},
        "selector": _str(description="Label selector of the rank pods (the scale subresource)."),
        "endpoint": _str(),
        "groups": {"type": "array", "items": group},
        "conditions": {"type": "array", "items": condition,
                       "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    })


# The longest rank pod name is N-g<255>-<63>, and the StatefulSet controller adds a
# controller-revision-hash label `N-g<255>-<10 chars>`: both must fit a 63-character label value.
MAX_NAME_LENGTH = 63 - len("-g255-") - 10
NAME_PATTERN = r"[a-z]([-a-z0-9]*[a-z0-9])?"  # a DNS label that starts with a letter (it names Services)


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object, ready to apply."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": "lockstepdeployment", "kind": KIND,
                      "listKind": f"{KIND}List", "shortNames": ["lsd"], "categories": ["lockstep"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A tensor-parallel LLM served by groups of lockstep ranks.",
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema() | {"default": {}},
                        "status": status_schema(),
                    },
                    "x-kubernetes-validations": [{
                        "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && "
                                f"self.metadata.name.matches('^{NAME_PATTERN}$')",
                        "message": f"metadata.name must be a DNS label that starts with a letter, of at most "
                                   f"{MAX_NAME_LENGTH} characters (the names of its pods and their labels are "
                                   "built from it)",
                    }],
                }},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.groups", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": [
                    {"name": "TP", "type": "integer", "jsonPath": ".spec.tensorParallelSize"},
                    {"name": "Groups", "type": "integer", "jsonPath": ".spec.groups"},
                    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyGroups"},
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }],
        },
    }


def crd_yaml() -> str:
    """The CRD as the chart ships it (byte-for-byte what a test compares the chart's file with)."""
    header = "# Generated by `python -m lockstep_operator.crd`; edit operator/lockstep_operator/crd.py.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


def strict_schema(schema: Schema | None = None) -> Schema:
    """The CR schema with unknown fields refused, as `kubectl apply` (field validation Strict) does.

    The API server prunes unknown fields of a structural schema; kubectl's default strict field
    validation turns that pruning into an error. Plain jsonschema needs additionalProperties: false to
    do the same, added here to every object that lists its properties and preserves nothing else.
    """
    if schema is None:
        schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    out = copy.deepcopy(schema)

    def walk(s: Schema, top: bool) -> None:
        if "properties" in s and not s.get("x-kubernetes-preserve-unknown-fields"):
            if not top:
                s["additionalProperties"] = False
            for sub in s["properties"].values():
                walk(sub, False)
        if isinstance(s.get("items"), dict):
            walk(s["items"], False)

    walk(out, True)
    return out


def with_spec_schema(values_schema: Schema) -> Schema:
    """The chart's values schema with `deployment.spec` the resource's spec schema, unknown fields refused."""
    out = copy.deepcopy(values_schema)
    out["properties"]["deployment"]["properties"]["spec"] = _draft7(strict_schema()["properties"]["spec"])
    return out


def _draft7(schema: Any) -> Any:
    """OpenAPI 3.0's schema as JSON Schema draft 7 (Helm's): an exclusive bound is the bound itself, not a flag."""
    if isinstance(schema, list):
        return [_draft7(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _draft7(v) for k, v in schema.items()}
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if out.get(flag) is True:
            out[flag] = out.pop(bound)
        elif out.get(flag) is False:
            del out[flag]
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--values-schema"]:
        from pathlib import Path

        path = Path(sys.argv[2])
        path.write_text(json.dumps(with_spec_schema(json.loads(path.read_text())), indent=2) + "\n")
    else:
        sys.stdout.write(crd_yaml())
