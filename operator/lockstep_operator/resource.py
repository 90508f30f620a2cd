"""A LockstepDeployment's spec: the CRD's defaults applied and its rules checked, in Python.

The API server applies the same defaults and refuses the same specs (the CRD in `crd.py` is the one
source); the operator checks again because a CR written before a CRD upgrade, or a test that never saw
an API server, must still fail with a clear message instead of producing broken pods.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from typing import Any

from lockstep_operator.crd import MAX_NAME_LENGTH, NAME_PATTERN, Schema, spec_schema

BUILTIN_TP_SIZES = (1, 3)


class SpecError(ValueError):
    """A LockstepDeployment spec that cannot be served; the message names the field."""


def apply_defaults(schema: Schema, value: Any) -> Any:
    """Fill in defaults the way the API server does: a missing field with a default gets it, recursively."""
    if schema.get("type") != "object" or not isinstance(value, dict):
        return value
    out = dict(value)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(sub, out[key])
    return out


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float),
}


def _check(schema: Schema, value: Any, path: str) -> None:
    """SpecError unless `value` fits `schema` (the subset of OpenAPI the CRD uses), naming the field."""
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise SpecError(f"{path}: must be an integer or a string, got {value!r}")
        low = next((s["minimum"] for s in schema.get("anyOf", []) if s.get("type") == "integer" and "minimum" in s),
                   None)
        if isinstance(value, int) and low is not None and value < low:
            raise SpecError(f"{path}: must be at least {low}, got {value!r}")
        if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
            raise SpecError(f"{path}: {value!r} is not a Kubernetes quantity (e.g. 2, 500m, 8Gi)")
        return
    _check_value(schema, value, path)
    if schema.get("type") == "object":
        _check_fields(schema, value, path)
    if schema.get("type") == "array" and "items" in schema:
        for i, item in enumerate(value):
            _check(schema["items"], item, f"{path}[{i}]")


def _finite(value: float) -> bool:
    """JSON has no NaN or Infinity, but a spec built in Python or read from YAML (.nan, .inf) can: NaN passes
    every range check (each comparison is false) and the services refuse it, as they do an integer too big
    to be a float (the env value is parsed as one)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_value(schema: Schema, value: Any, path: str) -> None:
    """Type, enum, range and length of one value."""
    kind = schema.get("type")
    if kind and (not isinstance(value, _TYPES[kind]) or (kind != "boolean" and isinstance(value, bool))):
        raise SpecError(f"{path}: must be of type {kind}, got {value!r}")
    if kind == "number" and not _finite(value):
        raise SpecError(f"{path}: must be a finite number, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise SpecError(f"{path}: must be one of {schema['enum']}, got {value!r}")
    if "minimum" in schema:
        low = schema["minimum"]
        if value < low or (schema.get("exclusiveMinimum") and value == low):
            relation = "greater than" if schema.get("exclusiveMinimum") else "at least"
            raise SpecError(f"{path}: must be {relation} {low}, got {value!r}")
    if "maximum" in schema and value > schema["maximum"]:
        raise SpecError(f"{path}: must be at most {schema['maximum']}, got {value!r}")
    if "minLength" in schema and len(value) < schema["minLength"]:
        raise SpecError(f"{path}: must not be empty")


def _check_fields(schema: Schema, value: dict[str, Any], path: str) -> None:
    """An object's required, unknown and nested fields."""
    for key in schema.get("required", []):
        if key not in value:
            raise SpecError(f"{path}.{key}: is required")
    props = schema.get("properties")
    if props is not None:
        unknown = sorted(set(value) - set(props))
        if unknown and not schema.get("x-kubernetes-preserve-unknown-fields"):
            raise SpecError(f"{path}: unknown field(s) {', '.join(unknown)}")
        for key, item in value.items():
            if key in props:  # the others are preserved as given (a core Kubernetes type's)
                _check(props[key], item, f"{path}.{key}")
    elif "additionalProperties" in schema:
        for key, item in value.items():
            _check(schema["additionalProperties"], item, f"{path}.{key}")


def normalize(spec: Mapping[str, Any] | None) -> dict[str, Any]:
    """The spec with every default filled in, or SpecError saying what is wrong with it."""
    schema = spec_schema()
    full = apply_defaults(schema, dict(spec or {}))
    _check(schema, full, "spec")
    model = full["model"]
    sources = [k for k in ("builtin", "path", "pvc") if (model[k] if k == "builtin" else k in model)]
    if len(sources) != 1:
        raise SpecError(f"spec.model: set exactly one of builtin: true, path, pvc (got {sources or 'none'})")
    if model["builtin"] and full["tensorParallelSize"] not in BUILTIN_TP_SIZES:
        raise SpecError(f"spec.tensorParallelSize: the built-in model has 9 attention heads and 3 KV heads, "
                        f"so it must be 1 or 3, got {full['tensorParallelSize']}")
    if "path" in model and not model["path"].startswith("/"):
        raise SpecError(f"spec.model.path: must be an absolute path, got {model['path']!r}")
    coordinator = full["coordinator"]
    if coordinator["httpPort"] == coordinator["grpcPort"]:
        raise SpecError("spec.coordinator: httpPort and grpcPort must differ")
    if 0 < coordinator["watchdogTimeoutSeconds"] <= 1:
        raise SpecError(f"spec.coordinator.watchdogTimeoutSeconds: must be 0 (off) or more than 1 (the watchdog's "
                        f"tick), got {coordinator['watchdogTimeoutSeconds']}")
    scheduler = full["scheduler"]
    if scheduler["maxNumBatchedTokens"] < scheduler["maxNumSeqs"]:
        raise SpecError(f"spec.scheduler: maxNumBatchedTokens ({scheduler['maxNumBatchedTokens']}) must be at least "
                        f"maxNumSeqs ({scheduler['maxNumSeqs']}): the coordinator refuses less")
    return full


def check_name(name: str) -> None:
    """A LockstepDeployment name that every derived object name and label can be built from."""
    if not re.fullmatch(NAME_PATTERN, name):
        raise SpecError(f"metadata.name: {name!r} must be a DNS label (lower case, digits, '-'), "
                        "starting with a letter")
    if len(name) > MAX_NAME_LENGTH:
        raise SpecError(f"metadata.name: {name!r} is {len(name)} characters; at most {MAX_NAME_LENGTH} fit "
                        "the names of its pods")


def check_buildable(name: str, spec: dict[str, Any]) -> None:
    """SpecError for a spec whose extra volumes and mounts the API server would refuse in the pods built from it:
    a volume named as one of the operator's own (or twice), a mount path taken twice in a container, a mount of no
    volume. Checked here, so the deployment says why instead of waiting on a StatefulSet never made."""
    from lockstep_operator import manifests as m

    for what, pod in (("rank", m.rank_pod_template(name, "x", spec, 0)["spec"]),
                      ("coordinator", m.coordinator_deployment(name, "x", spec)["spec"]["template"]["spec"])):
        volumes = [v.get("name") for v in pod.get("volumes", [])]
        twice = sorted({v for v in volumes if volumes.count(v) > 1})
        if twice:
            raise SpecError(f"spec.volumes: the {what} pod would have volume name(s) {twice} twice (the operator "
                            f"mounts its own as {sorted(set(volumes) - set(twice))}); rename yours")
        for c in pod["containers"]:
            paths = [v.get("mountPath") for v in c.get("volumeMounts", [])]
            taken = sorted({p for p in paths if paths.count(p) > 1})
            if taken:
                raise SpecError(f"spec.volumeMounts: mount path(s) {taken} are taken twice in the {what} container "
                                f"(the operator's own mounts: {sorted(set(paths) - set(taken))})")
            missing = sorted({v.get("name") for v in c.get("volumeMounts", [])} - set(volumes))
            if missing:
                raise SpecError(f"spec.volumeMounts: mount(s) of {missing}, which spec.volumes does not define")
