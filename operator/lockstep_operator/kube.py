"""A small REST client over the `kubernetes` package's ApiClient, speaking plain dicts.

The operator reads and writes only a handful of kinds; going through their raw paths keeps the
objects exactly as the pure builders made them (no model round trip that drops or renames fields).
"""

from __future__ import annotations

import json
from typing import Any

import kubernetes

from lockstep_operator.crd import GROUP, PLURAL, VERSION

# kind -> (API prefix, plural)
PATHS: dict[str, tuple[str, str]] = {
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "Secret": ("/api/v1", "secrets"),  # created only, never read: the group token
    "ConfigMap": ("/api/v1", "configmaps"),  # the coordinator's group list
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "LockstepDeployment": (f"/apis/{GROUP}/{VERSION}", PLURAL),
}


class KubeError(RuntimeError):
    """A Kubernetes API call that failed; `status` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Kube:
    """Namespaced get / list / create / patch / delete of the kinds in PATHS."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self.api = api_client

    def _path(self, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        if kind not in PATHS:
            raise ValueError(f"unsupported kind {kind!r}; known: {sorted(PATHS)}")
        prefix, plural = PATHS[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        if name is not None:
            path += f"/{name}"
        if sub is not None:
            path += f"/{sub}"
        return path

    def _call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self.api.param_serialize(method, path, query_params=query, header_params=headers,
                                           body=body, auth_settings=["BearerToken"])
        response = self.api.call_api(*request)
        data = response.read()
        if response.status >= 400:
            raise KubeError(response.status, data.decode(errors="replace")[:500])
        return json.loads(data) if data else {}

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self._call("GET", self._path(kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        items = self._call("GET", self._path(kind, namespace), query=[("labelSelector", selector)])
        # Servers filter by the selector; check again so a server that does not still gets it right.
        return [item for item in items.get("items", [])
                if all(item.get("metadata", {}).get("labels", {}).get(k) == v for k, v in labels.items())]

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self._call("POST", self._path(obj["kind"], meta["namespace"]), body=obj)

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        return self._call("PATCH", self._path(kind, namespace, name, subresource), body=patch,
                          content_type="application/merge-patch+json")

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete in the background (dependents go by garbage collection); False if it was gone."""
        try:
            self._call("DELETE", self._path(kind, namespace, name),
                       body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True

    def apply(self, obj: dict[str, Any]) -> str:
        """Create the object or patch it to the desired state; says which (or 'unchanged').

        Only `metadata` and `spec` (a ConfigMap's `data`) are compared and patched: what the server adds
        (defaults, status) never counts as a difference. A merge patch removes a field only when it says
        `null`, so the object keeps what was applied last (LAST_APPLIED, kubectl's three-way merge), and a
        field the operator applied before and wants no more (a nodeSelector taken out of the spec) is patched
        to null.
        """
        meta = obj["metadata"]
        desired = {k: v for k, v in obj.items() if k in ("metadata", "spec", "data")}
        record = {**desired, "metadata": {**meta, "annotations": {
            **meta.get("annotations", {}), LAST_APPLIED: json.dumps(desired, sort_keys=True, separators=(",", ":"))}}}
        current = self.get(obj["kind"], meta["namespace"], meta["name"])
        if current is None:
            self.create({**obj, "metadata": record["metadata"]})
            return "created"
        if contains(current, record):
            return "unchanged"
        self.patch(obj["kind"], meta["namespace"], meta["name"], with_removals(last_applied(current), record))
        return "patched"


LAST_APPLIED = "lockstep.dev/last-applied"


def last_applied(obj: dict[str, Any]) -> dict[str, Any]:
    """What the operator applied to this object last ({} for one applied before it kept that, or unreadable)."""
    raw = obj.get("metadata", {}).get("annotations", {}).get(LAST_APPLIED)
    try:
        found = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def with_removals(before: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """`desired` as a merge patch over an object `before` was applied to: each key `before` had and `desired`
    lacks is null (removed), in nested objects too; lists are replaced whole by a merge patch anyway."""
    out = dict(desired)
    for k, was in before.items():
        if k not in desired:
            out[k] = None
        elif isinstance(was, dict) and isinstance(desired[k], dict):
            out[k] = with_removals(was, desired[k])
    return out


def contains(actual: Any, desired: Any) -> bool:
    """Whether `actual` already has every field of `desired` (servers add defaults; those are fine)."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(k in actual and contains(actual[k], v)
                                                for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(actual, list) and len(actual) == len(desired)
                and all(contains(a, d) for a, d in zip(actual, desired, strict=True)))
    return actual == desired


def default_api_client() -> kubernetes.client.ApiClient:
    """In a pod: the service account; elsewhere: the current kubeconfig context."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()
