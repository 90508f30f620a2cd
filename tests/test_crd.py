"""The LockstepDeployment CRD: valid for the API servers we support, and its schema refuses bad specs."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from lockstep_operator.crd import CRD_NAME, build_crd, crd_yaml, strict_schema
from lockstep_operator.resource import SpecError, apply_defaults, check_name, normalize

ROOT = Path(__file__).resolve().parents[1]
K8S_VERSIONS = ("1.30", "1.33")


def custom_resource(spec: dict) -> dict:
    return {"apiVersion": "lockstep.dev/v1alpha1", "kind": "LockstepDeployment",
            "metadata": {"name": "demo", "namespace": "default"}, "spec": spec}


def schema_validator() -> jsonschema.Draft4Validator:
    # The CRD schema is OpenAPI v3.0 (boolean exclusiveMinimum): Draft 4 semantics.
    return jsonschema.Draft4Validator(strict_schema())


def defaulted(spec: dict) -> dict:
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return apply_defaults(root, custom_resource(spec))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_is_valid_kubernetes(version: str) -> None:
    kubernetes_validate.validate(build_crd(), version, strict=True)


def test_crd_pins_names_subresources_and_columns() -> None:
    crd = build_crd()
    assert crd["metadata"]["name"] == CRD_NAME == "lockstepdeployments.lockstep.dev"
    v = crd["spec"]["versions"][0]
    assert v["name"] == "v1alpha1" and crd["spec"]["scope"] == "Namespaced"
    assert v["subresources"]["status"] == {}
    assert v["subresources"]["scale"]["specReplicasPath"] == ".spec.groups"
    columns = {c["name"]: c["jsonPath"] for c in v["additionalPrinterColumns"]}
    assert columns == {"TP": ".spec.tensorParallelSize", "Groups": ".spec.groups",
                       "Ready": ".status.readyGroups", "Phase": ".status.phase",
                       "Age": ".metadata.creationTimestamp"}


def _structural(schema: dict, path: str = "") -> None:
    """Every node has a type (or preserves unknown fields / is int-or-string): the structural rule."""
    ok = "type" in schema or schema.get("x-kubernetes-int-or-string") or \
        schema.get("x-kubernetes-preserve-unknown-fields")
    assert ok, f"{path or '<root>'} has no type"
    for key, sub in schema.get("properties", {}).items():
        _structural(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        _structural(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        _structural(schema["additionalProperties"], f"{path}.*")


def test_schema_is_structural() -> None:
    _structural(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def test_chart_crd_is_generated_from_python() -> None:
    shipped = (ROOT / "helm/lockstep/crds/lockstepdeployments.yaml").read_text()
    assert shipped == crd_yaml(), "regenerate: python -m lockstep_operator.crd > helm/lockstep/crds/..."
    assert yaml.safe_load(shipped) == build_crd()


GOOD_SPECS = [
    {},
    {"tensorParallelSize": 3, "groups": 2},
    {"model": {"pvc": {"claimName": "weights", "path": "llama"}}, "tensorParallelSize": 4,
     "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}}},
    {"model": {"builtin": False, "path": "/models/m"}, "tensorParallelSize": 8, "groups": 0,
     "kvCache": {"pageSize": 32, "memoryFraction": 0.5, "prefixCaching": False},
     "agreement": {"stallThresholdSeconds": 2.5, "deadRankTimeoutSeconds": 60},
     "coordinator": {"serviceType": "LoadBalancer"},
     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
     "nodeSelector": {"gpu": "h100"}, "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
]

BAD_SPECS = [
    ({"tensorParallelSize": 0}, "tensorParallelSize"),
    ({"tensorParallelSize": "2"}, "tensorParallelSize"),
    ({"groups": -1}, "groups"),
    ({"kvCache": {"memoryFraction": 0}}, "memoryFraction"),
    ({"kvCache": {"memoryFraction": 1.5}}, "memoryFraction"),
    ({"kvCache": {"pageSize": 0}}, "pageSize"),
    ({"coordinator": {"serviceType": "Ingress"}}, "serviceType"),
    ({"coordinator": {"httpPort": 70000}}, "httpPort"),
    ({"agreement": {"stallThresholdSeconds": 0}}, "stallThresholdSeconds"),
    ({"imagePullPolicy": "Sometimes"}, "imagePullPolicy"),
    ({"tensorParalelSize": 2}, "tensorParalelSize"),
    ({"model": {"pvc": {"path": "x"}}}, "claimName"),
    ({"resources": {"limits": {"nvidia.com/gpu": True}}}, "nvidia.com/gpu"),
]


@pytest.mark.parametrize("spec", GOOD_SPECS)
def test_good_specs_pass_the_crd_schema_and_the_operator(spec: dict) -> None:
    schema_validator().validate(defaulted(spec))
    full = normalize(spec)
    assert full["tensorParallelSize"] == spec.get("tensorParallelSize", 1)


@pytest.mark.parametrize(("spec", "field"), BAD_SPECS)
def test_bad_specs_are_refused_by_schema_and_operator(spec: dict, field: str) -> None:
    errors = list(schema_validator().iter_errors(defaulted(spec)))
    assert errors, f"schema accepted {spec}"
    assert any(field in (".".join(map(str, e.absolute_path)) + e.message) for e in errors)
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        normalize(spec)


def test_defaults_match_the_command_line_contract() -> None:
    full = normalize({})
    assert full["model"] == {"builtin": True}
    assert full["tensorParallelSize"] == 1 and full["groups"] == 1
    assert full["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert full["kvCache"] == {"pageSize": 16, "memoryFraction": 0.9, "pages": 0, "prefixCaching": True}
    assert full["scheduler"] == {"maxNumBatchedTokens": 512, "maxNumSeqs": 64}
    assert full["agreement"] == {"stallThresholdSeconds": 5, "deadRankTimeoutSeconds": 30, "replayTimeoutSeconds": 300}
    assert full["coordinator"]["httpPort"] == 8000 and full["coordinator"]["grpcPort"] == 8001


@pytest.mark.parametrize(("spec", "message"), [
    ({"tensorParallelSize": 2}, "must be 1 or 3"),
    ({"model": {"builtin": True, "path": "/m"}}, "exactly one"),
    ({"model": {"builtin": False}}, "exactly one"),
    ({"model": {"path": "relative/dir"}}, "absolute"),
    ({"coordinator": {"httpPort": 9000, "grpcPort": 9000}}, "must differ"),
])
def test_cross_field_rules(spec: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        normalize(spec)
    rules = [r["rule"] for r in build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
             ["properties"]["spec"]["x-kubernetes-validations"]]
    assert any("tensorParallelSize in [1, 3]" in r for r in rules)


@pytest.mark.parametrize("name", ["Demo", "9lives", "a_b", "x" * 60])
def test_bad_names(name: str) -> None:
    with pytest.raises(SpecError, match="metadata.name"):
        check_name(name)


def test_strict_schema_does_not_mutate_the_crd() -> None:
    crd = build_crd()
    before = copy.deepcopy(crd)
    strict_schema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    assert crd == before
