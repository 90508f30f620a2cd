"""The LockstepDeployment CRD: valid for the API servers we support, and its schema refuses bad specs."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from lockstep_operator.crd import CRD_NAME, build_crd, crd_yaml, strict_schema
from lockstep_operator.resource import SpecError, apply_defaults, check_buildable, check_name, normalize

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
    {"rollout": {"drainTimeoutSeconds": 0}},
    {"rollout": {"drainTimeoutSeconds": 3600}},
    {"kvCache": {"rebalance": {}}},
    {"kvCache": {"rebalance": {"enabled": False, "intervalSteps": 1, "cooldownSeconds": 0, "minSamples": 0,
                               "threshold": 1.0}}},
    {"kvCache": {"rebalance": {"intervalSteps": 50, "cooldownSeconds": 30.5, "minSamples": 100000,
                               "threshold": 2}}},
    {"tls": {"secretName": "rank-certs"}},
    {"tls": {"secretName": "rank-certs", "serverName": "lockstep-rank", "clientAuth": True}},
    {"agreement": {"stallThresholdSeconds": 86400, "deadRankTimeoutSeconds": 43200, "replayTimeoutSeconds": 86400}},
    {"resources": {"requests": {"cpu": "500m", "memory": "7.5Gi", "ephemeral-storage": "1e9"},
                   "limits": {"nvidia.com/gpu": 8, "cpu": 16, "memory": ".5Ti"}}},
    {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "h100", "effect": "NoExecute",
                      "tolerationSeconds": 300}, {"operator": "Exists"}],
     "imagePullSecrets": [{"name": "regcred"}]},
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
    ({"coordinator": {"apiWorkers": 65}}, "apiWorkers"),
    ({"coordinator": {"apiWorkers": -1}}, "apiWorkers"),
    ({"agreement": {"stallThresholdSeconds": 0}}, "stallThresholdSeconds"),
    ({"imagePullPolicy": "Sometimes"}, "imagePullPolicy"),
    ({"tensorParalelSize": 2}, "tensorParalelSize"),
    ({"model": {"pvc": {"path": "x"}}}, "claimName"),
    ({"resources": {"limits": {"nvidia.com/gpu": True}}}, "nvidia.com/gpu"),
    ({"rollout": {"drainTimeoutSeconds": -1}}, "drainTimeoutSeconds"),
    ({"rollout": {"drainTimeoutSeconds": 1.5}}, "drainTimeoutSeconds"),
    ({"rollout": {"drainTimeoutSeconds": "2m"}}, "drainTimeoutSeconds"),
    ({"rollout": {"drainTimeout": 5}}, "drainTimeout"),
    ({"kvCache": {"rebalance": {"intervalSteps": 0}}}, "rebalance.intervalSteps"),
    ({"kvCache": {"rebalance": {"intervalSteps": 2.5}}}, "rebalance.intervalSteps"),
    ({"kvCache": {"rebalance": {"cooldownSeconds": -1}}}, "rebalance.cooldownSeconds"),
    ({"kvCache": {"rebalance": {"cooldownSeconds": "2m"}}}, "rebalance.cooldownSeconds"),
    ({"kvCache": {"rebalance": {"minSamples": -1}}}, "rebalance.minSamples"),
    ({"kvCache": {"rebalance": {"threshold": 0.9}}}, "rebalance.threshold"),
    ({"kvCache": {"rebalance": {"enabled": "yes"}}}, "rebalance.enabled"),
    ({"kvCache": {"rebalance": {"interval": 5}}}, "interval"),
    ({"kvCache": {"rebalance": False}}, "rebalance"),
    ({"tls": {}}, "secretName"),
    ({"tls": {"secretName": ""}}, "secretName"),
    ({"tls": {"secretName": "x", "clientAuth": "yes"}}, "clientAuth"),
    ({"tls": {"secretName": "x", "ca": "ca.crt"}}, "ca"),
    ({"tls": "rank-certs"}, "tls"),
    # past what the services accept (the ranks' collectives time out at twice the dead-rank timeout)
    ({"agreement": {"deadRankTimeoutSeconds": 43201}}, "deadRankTimeoutSeconds"),
    ({"agreement": {"stallThresholdSeconds": 86401}}, "stallThresholdSeconds"),
    ({"agreement": {"replayTimeoutSeconds": 1e308}}, "replayTimeoutSeconds"),
    ({"coordinator": {"watchdogTimeoutSeconds": -1}}, "watchdogTimeoutSeconds"),
    ({"coordinator": {"watchdogTimeoutSeconds": 86401}}, "watchdogTimeoutSeconds"),
    # what the API server would refuse in the pods built from it
    ({"resources": {"requests": {"cpu": "lots"}}}, "cpu"),
    ({"resources": {"limits": {"memory": "1Gb"}}}, "memory"),
    ({"resources": {"limits": {"nvidia.com/gpu": -1}}}, "nvidia.com/gpu"),
    ({"resources": {"limits": {"nvidia.com/gpu": "-1"}}}, "nvidia.com/gpu"),
    ({"tolerations": [{"key": "gpu", "operator": "Sometimes"}]}, "operator"),
    ({"tolerations": [{"key": "gpu", "effect": "NoRun"}]}, "effect"),
    ({"tolerations": [{"key": "gpu", "tolerationSeconds": "60"}]}, "tolerationSeconds"),
    ({"tolerations": [{"keys": "gpu"}]}, "keys"),
    ({"imagePullSecrets": [{}]}, "name"),
    ({"imagePullSecrets": [{"name": ""}]}, "name"),
    ({"imagePullSecrets": ["regcred"]}, "imagePullSecrets"),
    ({"env": [{"value": "x"}]}, "name"),
    ({"env": [{"name": ""}]}, "name"),
    ({"volumes": [{"emptyDir": {}}]}, "name"),
    ({"volumeMounts": [{"name": "data"}]}, "mountPath"),
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
    assert full["kvCache"] == {"pageSize": 16, "memoryFraction": 0.9, "pages": 0, "prefixCaching": True,
                               "rebalance": {"enabled": True, "intervalSteps": 10, "cooldownSeconds": 120,
                                             "minSamples": 2000, "threshold": 1.25}}
    assert full["scheduler"] == {"maxNumBatchedTokens": 512, "maxNumSeqs": 64, "longPrefillTokenThreshold": 0}
    assert full["agreement"] == {"stallThresholdSeconds": 5, "deadRankTimeoutSeconds": 30, "replayTimeoutSeconds": 300}
    assert full["coordinator"]["httpPort"] == 8000 and full["coordinator"]["grpcPort"] == 8001
    assert full["coordinator"]["watchdogTimeoutSeconds"] == 120
    assert full["rollout"] == {"drainTimeoutSeconds": 120}


@pytest.mark.parametrize(("spec", "message"), [
    ({"tensorParallelSize": 2}, "must be 1 or 3"),
    ({"model": {"builtin": True, "path": "/m"}}, "exactly one"),
    ({"model": {"builtin": False}}, "exactly one"),
    ({"model": {"path": "relative/dir"}}, "absolute"),
    ({"coordinator": {"httpPort": 9000, "grpcPort": 9000}}, "must differ"),
    ({"coordinator": {"watchdogTimeoutSeconds": 0.5}}, r"watchdogTimeoutSeconds: must be 0 \(off\) or more than 1"),
    ({"scheduler": {"maxNumBatchedTokens": 32}}, r"maxNumBatchedTokens \(32\) must be at least maxNumSeqs \(64\)"),
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


def test_the_crd_refuses_the_names_the_operator_refuses() -> None:
    """`kubectl apply` of a name the operator cannot build from fails at once (a CEL rule on metadata.name), with
    the operator's own rule: the rule's length bound and pattern (RE2's `matches` finds, so it is anchored) agree
    with check_name on every name here."""
    (rule,) = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    found = re.fullmatch(r"self\.metadata\.name\.size\(\) <= (\d+) && self\.metadata\.name\.matches\('(.+)'\)",
                         rule["rule"])
    assert found, rule
    bound, pattern = int(found[1]), found[2]
    for name in ["demo", "a", "a-b-9", "x" * 47, "x" * 48, "Demo", "9lives", "a_b", "my.app", "a-", "-a", ""]:
        try:
            check_name(name)
            operator_says = True
        except SpecError:
            operator_says = False
        assert (len(name) <= bound and re.search(pattern, name) is not None) == operator_says, name


def test_strict_schema_does_not_mutate_the_crd() -> None:
    crd = build_crd()
    before = copy.deepcopy(crd)
    strict_schema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    assert crd == before


@pytest.mark.parametrize(("rebalance", "schema_says", "operator_says"), [
    ({"intervalSteps": 0}, "0 is less than the minimum of 1",
     "spec.kvCache.rebalance.intervalSteps: must be at least 1, got 0"),
    ({"threshold": 0.9}, "0.9 is less than the minimum of 1.0",
     "spec.kvCache.rebalance.threshold: must be at least 1.0, got 0.9"),
    ({"cooldownSeconds": -1}, "-1 is less than the minimum of 0",
     "spec.kvCache.rebalance.cooldownSeconds: must be at least 0, got -1"),
    ({"minSamples": -5}, "-5 is less than the minimum of 0",
     "spec.kvCache.rebalance.minSamples: must be at least 0, got -5"),
])
def test_rebalance_ranges_are_refused_with_the_field_and_the_bound(rebalance: dict, schema_says: str,
                                                                   operator_says: str) -> None:
    """The API server (the CRD's minimum) and the operator both name the field, the bound and the value."""
    (field,) = rebalance
    errors = list(schema_validator().iter_errors(defaulted({"kvCache": {"rebalance": rebalance}})))
    assert [(list(e.absolute_path), e.message) for e in errors] == [
        (["spec", "kvCache", "rebalance", field], schema_says)]
    with pytest.raises(SpecError) as exc:
        normalize({"kvCache": {"rebalance": rebalance}})
    assert str(exc.value) == operator_says


def test_rebalance_is_defaulted_by_the_api_server_inside_a_partial_kv_cache() -> None:
    """A CR that sets other kvCache fields, or some rebalance fields, gets the rest from the CRD's defaults."""
    kv = defaulted({"kvCache": {"pageSize": 32, "rebalance": {"threshold": 2.0}}})["spec"]["kvCache"]
    assert kv["rebalance"] == {"enabled": True, "intervalSteps": 10, "cooldownSeconds": 120, "minSamples": 2000,
                               "threshold": 2.0}
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rebalance = schema["properties"]["spec"]["properties"]["kvCache"]["properties"]["rebalance"]
    assert rebalance["default"] == {} and all(s.get("description") for s in rebalance["properties"].values())


@pytest.mark.parametrize("field", ["memoryFraction", "rebalance.threshold", "rebalance.cooldownSeconds"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_refused(field: str, value: float) -> None:
    """NaN passes every range check (each comparison is false), so the operator refuses it by name."""
    kv: dict = {}
    *parents, leaf = field.split(".")
    node = kv
    for parent in parents:
        node = node.setdefault(parent, {})
    node[leaf] = value
    with pytest.raises(SpecError, match=rf"spec\.kvCache\.{field.replace('.', '[.]')}: must be a finite number"):
        normalize({"kvCache": kv})


def test_tls_is_off_unless_asked_and_defaulted_inside() -> None:
    assert "tls" not in normalize({})
    assert normalize({"tls": {"secretName": "c"}})["tls"] == {"secretName": "c", "serverName": "", "clientAuth": False}


@pytest.mark.parametrize(("extra", "message"), [
    ({"volumes": [{"name": "dshm", "emptyDir": {}}]}, r"volume name\(s\) \['dshm'\] twice"),
    ({"volumes": [{"name": "x", "emptyDir": {}}, {"name": "x", "emptyDir": {}}]}, r"\['x'\] twice"),
    ({"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "/dev/shm"}]},
     r"mount path\(s\) \['/dev/shm'\] are taken twice"),
    ({"volumeMounts": [{"name": "nowhere", "mountPath": "/data"}]}, r"mount\(s\) of \['nowhere'\]"),
])
def test_extra_volumes_that_clash_with_the_operators_own_are_refused_with_the_reason(extra: dict,
                                                                                     message: str) -> None:
    """The API server would refuse the StatefulSet (422) and the deployment would wait on it for ever; the operator
    says why instead. Extra volumes and mounts that do not clash are built."""
    with pytest.raises(SpecError, match=message):
        check_buildable("demo", normalize(extra))
    check_buildable("demo", normalize({"volumes": [{"name": "data", "emptyDir": {}}],
                                       "volumeMounts": [{"name": "data", "mountPath": "/data"}]}))
