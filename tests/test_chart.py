"""The Helm chart, rendered and linted by Helm's own Go engine (helm-python-sdk), every document valid."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")

from lockstep.coordinator.auth import parse_api_keys  # noqa: E402
from lockstep_operator.crd import build_crd, strict_schema, with_spec_schema  # noqa: E402
from lockstep_operator.resource import MAX_NAME_LENGTH, SpecError, check_name, normalize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm/lockstep"
# Kinds that are not part of Kubernetes itself: checked against their own schema or shape instead.
FOREIGN = {"LockstepDeployment", "ServiceMonitor", "PrometheusRule"}

VALUES = {
    "default": {},
    "monitoring-on": {"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                                     "prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
                                     "dashboard": {"enabled": True}}},
    "monitoring-off": {"monitoring": {"serviceMonitor": {"enabled": False}, "prometheusRule": {"enabled": False},
                                      "dashboard": {"enabled": False}}},
    "two-groups": {"deployment": {"spec": {"groups": 2, "tensorParallelSize": 3}}},
    "tp4-pvc-namespaced": {"operator": {"watchAllNamespaces": False},
                           "image": {"tag": "1.2.3", "pullPolicy": "Always"},
                           "imagePullSecrets": [{"name": "regcred"}],
                           "deployment": {"name": "llama", "spec": {
                               "model": {"pvc": {"claimName": "weights", "path": "llama"}},
                               "tensorParallelSize": 4, "groups": 2,
                               "coordinator": {"httpPort": 9000, "grpcPort": 9001}}}},
    "no-deployment": {"deployment": {"enabled": False}},
    "rebalance": {"deployment": {"spec": {"kvCache": {"pageSize": 32, "rebalance": {
        "enabled": False, "intervalSteps": 25, "cooldownSeconds": 30.5, "minSamples": 0, "threshold": 1.5}}}}},
    "coordinator-api-key": {"operator": {"coordinatorApiKeySecret": {"name": "lockstep-api", "key": "key"}}},
    "spec-env-api-key": {"deployment": {"spec": {"env": [{"name": "LOCKSTEP_API_KEY", "valueFrom": {
        "secretKeyRef": {"name": "own-keys", "key": "keys"}}}]}}},
}


def render(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        out = chart.render(values, name="demo", namespace="ml", is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def notes(values: dict) -> str:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="demo", namespace="ml", is_install=True)
    return out["lockstep/templates/NOTES.txt"]


def kinds(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


@pytest.mark.parametrize("key", sorted(VALUES))
def test_every_rendered_document_is_valid(key: str) -> None:
    docs = render(VALUES[key])
    assert docs
    cr_schema = jsonschema.Draft4Validator(strict_schema())
    for doc in docs:
        if doc["kind"] == "LockstepDeployment":
            cr_schema.validate(doc)
            normalize(doc["spec"])
        elif doc["kind"] not in FOREIGN:
            for version in ("1.30", "1.33"):
                kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("key", sorted(VALUES))
def test_lint_is_clean(key: str) -> None:
    for kube_version in ("v1.30.0", "v1.33.0"):
        report = helm.lint(CHART, VALUES[key], strict=True, kube_version=kube_version)
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, problems


def test_crd_ships_in_crds_dir_and_is_the_python_one() -> None:
    with helm.Chart.load(CHART) as chart:
        crds = chart.crds
    assert len(crds) == 1
    assert yaml.safe_load(crds[0]["data"]) == build_crd()


def test_default_install_serves_the_builtin_model() -> None:
    k = kinds(render({}))
    (cr,) = k["LockstepDeployment"]
    assert cr["metadata"]["name"] == "demo"
    spec = normalize(cr["spec"])
    assert spec["model"]["builtin"] and spec["groups"] == 1
    assert spec["image"] == "ghcr.io/lockstep-dev/lockstep:0.1.0"
    (op,) = k["Deployment"]
    (c,) = op["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["lockstep-operator"] and "--all-namespaces" in c["args"]
    assert op["spec"]["template"]["spec"]["serviceAccountName"] == k["ServiceAccount"][0]["metadata"]["name"]
    assert "ServiceMonitor" not in k and "PrometheusRule" not in k
    (dash,) = k["ConfigMap"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["lockstep.json"]) == json.loads((ROOT / "monitoring/dashboard.json").read_text())
    (test_pod,) = k["Pod"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test_pod["spec"]["containers"][0]["args"][-1] == "http://demo.ml.svc:8000/v1/completions"


def test_non_default_values_reach_the_resource() -> None:
    k = kinds(render(VALUES["tp4-pvc-namespaced"]))
    (cr,) = k["LockstepDeployment"]
    assert cr["metadata"]["name"] == "llama"
    spec = normalize(cr["spec"])
    assert spec["tensorParallelSize"] == 4 and spec["groups"] == 2
    assert spec["image"].endswith(":1.2.3") and spec["imagePullPolicy"] == "Always"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert "Role" in k and "RoleBinding" in k and "ClusterRole" not in k
    (c,) = k["Deployment"][0]["spec"]["template"]["spec"]["containers"]
    assert "--namespace=ml" in c["args"]
    assert k["Pod"][0]["spec"]["containers"][0]["args"][-1] == "http://llama.ml.svc:9000/v1/completions"
    assert "llama.ml.svc:9000" in notes(VALUES["tp4-pvc-namespaced"])
    k = kinds(render(VALUES["two-groups"]))
    assert normalize(k["LockstepDeployment"][0]["spec"])["groups"] == 2
    assert "LockstepDeployment" not in kinds(render(VALUES["no-deployment"]))


def test_rebalance_values_reach_the_resource_as_given() -> None:
    """The chart passes `deployment.spec.kvCache` through untouched: a false or a zero must survive the merge
    with the chart's own fields, and what is left out comes from the CRD's defaults."""
    (cr,) = kinds(render(VALUES["rebalance"]))["LockstepDeployment"]
    assert cr["spec"]["kvCache"] == VALUES["rebalance"]["deployment"]["spec"]["kvCache"]
    values = {"deployment": {"spec": {"kvCache": {"rebalance": {"threshold": 2.0}}}}}
    (cr,) = kinds(render(values))["LockstepDeployment"]
    assert normalize(cr["spec"])["kvCache"]["rebalance"] == {
        "enabled": True, "intervalSteps": 10, "cooldownSeconds": 120, "minSamples": 2000, "threshold": 2.0}


def test_monitoring_objects() -> None:
    k = kinds(render(VALUES["monitoring-on"]))
    (sm,) = k["ServiceMonitor"]
    assert sm["metadata"]["labels"]["release"] == "kps"
    assert sm["spec"]["endpoints"][0]["port"] == "http" and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "coordinator"
    (rule,) = k["PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"] == chart_alerts("demo", "ml")
    k = kinds(render(VALUES["monitoring-off"]))
    assert not {"ServiceMonitor", "PrometheusRule", "ConfigMap"} & set(k)


def chart_alerts(job: str | None, namespace: str) -> dict:
    """monitoring/alerts.yaml as the chart ships it: LockstepCoordinatorAbsent watches the chart's own
    LockstepDeployment (job = its coordinator Service's name = its name), or is left out without one."""
    spec = yaml.safe_load((ROOT / "monitoring/alerts.yaml").read_text())
    for group in spec["groups"]:
        for r in [r for r in group["rules"] if r["alert"] == "LockstepCoordinatorAbsent"]:
            assert r["expr"] == 'absent(up{job="lockstep"})'
            if job is None:
                group["rules"].remove(r)
            else:
                r["expr"] = f'absent(up{{namespace="{namespace}", job="{job}"}})'
    return spec


def test_prometheus_rule_watches_the_charts_own_coordinator(tmp_path: Path) -> None:
    on = VALUES["monitoring-on"]["monitoring"]
    (rule,) = kinds(render({"monitoring": on, "deployment": {"name": "llama"}}))["PrometheusRule"]
    assert rule["spec"] == chart_alerts("llama", "ml")
    (rule,) = kinds(render({"monitoring": on, "deployment": {"enabled": False}}))["PrometheusRule"]
    assert rule["spec"] == chart_alerts(None, "ml")
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    (rule,) = kinds(render({"monitoring": on}))["PrometheusRule"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    (absent,) = [r for g in rule["spec"]["groups"] for r in g["rules"] if r["alert"] == "LockstepCoordinatorAbsent"]
    annotations = json.dumps({k: v.replace("{{ $labels.job }}", "demo") for k, v in absent["annotations"].items()})
    # Another namespace's `demo`, or another job, is not this release's coordinator.
    up = "'1x20'"
    (tmp_path / "test.yaml").write_text(f"""
rule_files: [rules.yaml]
tests:
  - interval: 1m
    input_series:
      - {{series: 'up{{namespace="other",job="demo"}}', values: {up}}}
      - {{series: 'up{{namespace="ml",job="lockstep"}}', values: {up}}}
    alert_rule_test:
      - eval_time: 10m
        alertname: LockstepCoordinatorAbsent
        exp_alerts: [{{exp_labels: {{severity: critical, namespace: ml, job: demo}}, exp_annotations: {annotations}}}]
  - interval: 1m
    input_series:
      - {{series: 'up{{namespace="ml",job="demo",instance="a"}}', values: {up}}}
    alert_rule_test:
      - eval_time: 10m
        alertname: LockstepCoordinatorAbsent
        exp_alerts: []
""")
    out = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# Exactly the verbs the operator uses, per (API group, resource). From its own calls (kube.py's Kube, as
# handlers.py and observe.py use it): apply = get + create + patch; plus what kopf does for it (watch the
# LockstepDeployments and rank pods, patch finalizers/annotations and the status, post events; peering is
# off: standalone). A new call without a grant, or a grant nobody uses, fails here.
OPERATOR_GRANTS = {
    # and the chart's pre-delete hook, under the same ServiceAccount, deletes the chart's own (uninstall.py)
    ("lockstep.dev", "lockstepdeployments"): {"get", "list", "watch", "patch", "delete"},
    ("lockstep.dev", "lockstepdeployments/status"): {"patch"},
    # kopf.adopt sets blockOwnerDeletion: true on every child, which OwnerReferencesPermissionEnforcement
    # (OpenShift, hardened clusters) allows only with update on the owner's finalizers.
    ("lockstep.dev", "lockstepdeployments/finalizers"): {"update"},
    ("apps", "statefulsets"): {"get", "list", "create", "patch", "delete"},  # applied, listed, removed
    ("apps", "deployments"): {"get", "create", "patch"},  # the coordinator: applied; collected with its owner
    ("", "services"): {"get", "create", "patch", "delete"},  # applied; a removed group's deleted
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "create", "patch"},  # the coordinator's group list: applied
    ("", "pods"): {"list", "watch", "delete"},  # rank pods: watched (kopf), listed, deleted to roll/recreate
    ("", "events"): {"create"},
    ("", "secrets"): {"create"},  # the group token: created, never read
}


@pytest.mark.parametrize("key", ["default", "tp4-pvc-namespaced"])
def test_rbac_grants_exactly_what_the_operator_calls(key: str) -> None:
    k = kinds(render(VALUES[key]))
    (role,) = k.get("ClusterRole", []) + k.get("Role", [])
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames, no nonResourceURLs
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                grants.setdefault((g, r), set()).update(rule["verbs"])
    assert grants == OPERATOR_GRANTS
    # every kind the operator's client speaks has its grants
    from lockstep_operator.kube import PATHS
    assert {plural for _, plural in PATHS.values()} <= {r for _, r in grants}


def test_rbac_is_least_privilege() -> None:
    (role,) = kinds(render({}))["ClusterRole"]
    grants = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
              for v in rule["verbs"]}
    assert not any("*" in x for grant in grants for x in grant)
    assert ("", "pods", "delete") in grants and ("", "events", "create") in grants
    assert ("lockstep.dev", "lockstepdeployments/status", "patch") in grants
    assert not any(r == "nodes" for _, r, _ in grants)
    # The coordinators' group lists are applied, never listed or deleted (garbage collection deletes them).
    assert {v for _, r, v in grants if r == "configmaps"} == {"get", "create", "patch"}
    # The group token Secrets are created, never read: no get, list, watch, patch or delete of secrets.
    assert {v for _, r, v in grants if r == "secrets"} == {"create"}
    assert not any(r == "pods" and v in ("create", "patch") for _, r, v in grants)


@pytest.mark.parametrize("key", ["default", "tp4-pvc-namespaced"])
def test_uninstall_deletes_the_deployment_first_while_the_operator_runs(key: str) -> None:
    """Helm deletes a LockstepDeployment (a kind it does not know) after the operator: a pre-delete hook, run under
    the operator's ServiceAccount, deletes the chart's own first and waits for it (lockstep_operator.uninstall)."""
    k = kinds(render(VALUES[key]))
    (job,) = k["Job"]
    (cr,) = k["LockstepDeployment"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "lockstep_operator.uninstall"]
    assert c["args"] == [cr["metadata"]["name"], f"--namespace={cr['metadata']['namespace']}", "--timeout=300"]
    assert c["image"] == cr["spec"]["image"] and pod["restartPolicy"] == "Never"
    assert pod["serviceAccountName"] == k["Deployment"][0]["spec"]["template"]["spec"]["serviceAccountName"]
    assert job["spec"]["activeDeadlineSeconds"] > 300
    from lockstep_operator import uninstall
    assert uninstall.main.__module__ == "lockstep_operator.uninstall"  # the module the hook runs
    assert "Job" not in kinds(render(VALUES["no-deployment"])), "no deployment of the chart's own: no hook"


def test_operator_gets_the_coordinators_api_key_for_drains_without_reading_secrets() -> None:
    """The operator calls /admin/drain and /admin/resume with the coordinators' key: the kubelet puts it in
    its environment from the Secret named in the values, so its RBAC still reads no Secret."""
    def operator_env(values: dict) -> list[dict]:
        (dep,) = [d for d in kinds(render(values))["Deployment"] if d["metadata"]["name"].endswith("operator")]
        return dep["spec"]["template"]["spec"]["containers"][0].get("env", [])
    assert operator_env({}) == []
    assert operator_env(VALUES["coordinator-api-key"]) == [{"name": "LOCKSTEP_OPERATOR_API_KEY", "valueFrom": {
        "secretKeyRef": {"name": "lockstep-api", "key": "key"}}}]


def helm_test_container(values: dict) -> dict:
    (pod,) = kinds(render(values))["Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    return container


def run_test_pod(container: dict, tmp_path: Path, key: str | None) -> list[str]:
    """The test pod's command run here with a stand-in curl that prints its arguments (one a line)."""
    fake = tmp_path / "curl"
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "LOCKSTEP_API_KEY"} | {
        "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    if key is not None:
        env["LOCKSTEP_API_KEY"] = key
    out = subprocess.run(container.get("command", []) + container.get("args", []), env=env, capture_output=True,
                         text=True, timeout=30, check=True)
    return out.stdout.splitlines()


def test_helm_test_sends_no_key_when_none_is_configured(tmp_path: Path) -> None:
    container = helm_test_container({})
    assert "env" not in container
    args = run_test_pod(container, tmp_path, None)
    assert not any(a.startswith("Authorization") for a in args)
    assert args[-1] == "http://demo.ml.svc:8000/v1/completions"
    assert "Authorization" not in notes({})


@pytest.mark.parametrize("keys", ["k1", "k1,k2", " k1 , k2 ", ",,k1,k2\n", "k1\n"])
def test_helm_test_sends_the_coordinators_first_key(keys: str, tmp_path: Path) -> None:
    """With coordinator API keys on, /v1/completions answers 401 without one: the test pod gets the key
    file from the Secret the operator uses and sends its first key, as the coordinator parses the list."""
    container = helm_test_container(VALUES["coordinator-api-key"])
    assert container["env"] == [{"name": "LOCKSTEP_API_KEY", "valueFrom": {
        "secretKeyRef": {"name": "lockstep-api", "key": "key"}}}]
    args = run_test_pod(container, tmp_path, keys)
    first = parse_api_keys([], keys)[0]
    assert args[args.index("-H") + 1] == f"Authorization: Bearer {first}"
    assert args[-1] == "http://demo.ml.svc:8000/v1/completions"


def test_helm_test_uses_the_deployments_own_key_first(tmp_path: Path) -> None:
    """A LOCKSTEP_API_KEY in the deployment's spec.env is what the coordinators check: the pod takes that."""
    values = VALUES["spec-env-api-key"] | {"operator": VALUES["coordinator-api-key"]["operator"]}
    container = helm_test_container(values)
    assert container["env"] == VALUES["spec-env-api-key"]["deployment"]["spec"]["env"]
    assert "Authorization: Bearer k9" in run_test_pod(container, tmp_path, "k9,k8")
    container = helm_test_container({"deployment": {"spec": {"env": [{"name": "LOCKSTEP_API_KEY", "value": "a,b"}]}}})
    assert container["env"] == [{"name": "LOCKSTEP_API_KEY", "value": "a,b"}]


def test_notes_tell_how_to_send_the_key() -> None:
    text = notes(VALUES["spec-env-api-key"])
    assert "The coordinators require an API key" in text and "Authorization: Bearer" in text
    assert "kubectl -n ml get secret own-keys -o jsonpath='{.data.keys}' | base64 -d" in text
    text = notes(VALUES["spec-env-api-key"] | {"operator": VALUES["coordinator-api-key"]["operator"]})
    assert "kubectl -n ml get secret own-keys -o jsonpath='{.data.keys}' | base64 -d" in text


def test_notes_say_an_operator_key_alone_leaves_the_api_open() -> None:
    """Bug fix: with only `operator.coordinatorApiKeySecret` set, the NOTES said "The coordinators require an API
    key" and told the user to send it; but that value gives the operator its key for /admin (values.yaml), and the
    chart's LockstepDeployment sets no LOCKSTEP_API_KEY, so its coordinator serves anyone."""
    (lsd,) = kinds(render(VALUES["coordinator-api-key"]))["LockstepDeployment"]
    assert not any(e.get("name") == "LOCKSTEP_API_KEY" for e in lsd["spec"].get("env", []))
    text = notes(VALUES["coordinator-api-key"])
    assert "require an API key" not in text and "Authorization: Bearer" not in text
    assert "operator.coordinatorApiKeySecret" in text and "spec.env" in text
    assert "curl http://127.0.0.1:8000/v1/completions" in text


NAMES = ["demo", "a" * MAX_NAME_LENGTH, "a" * (MAX_NAME_LENGTH + 1), "a" * 53, "1st", "my.app", "my-app-",
         "-app", "My-app", "x", "a-1", "a--b"]


def operator_accepts(name: str) -> bool:
    try:
        check_name(name)
    except SpecError:
        return False
    return True


def renders(values: dict, release: str) -> str | None:
    """None if the chart renders for this release name, else Helm's error."""
    try:
        with helm.Chart.load(CHART) as chart:
            chart.validate_schema(values)
            chart.render(values, name=release, namespace="ml", is_install=True)
    except Exception as e:  # noqa: BLE001 - Helm's template and schema errors alike
        return str(e)
    return None


@pytest.mark.parametrize("name", NAMES)
def test_chart_refuses_the_names_the_operator_refuses(name: str) -> None:
    """The LockstepDeployment takes the release name unless deployment.name is set: a name the operator
    would answer with InvalidSpec fails the install, saying to set deployment.name."""
    assert operator_accepts("a" * MAX_NAME_LENGTH) and not operator_accepts("a" * (MAX_NAME_LENGTH + 1))
    error = renders({}, name)
    if operator_accepts(name):
        assert error is None, error
    else:
        assert error is not None and "deployment.name" in error and repr(name)[1:-1] in error, error
        assert renders({"deployment": {"name": "llama"}}, name) is None
        assert renders({"deployment": {"enabled": False}}, name) is None
    # deployment.name itself: the schema takes exactly the names the operator takes
    error = renders({"deployment": {"name": name}}, "demo")
    assert (error is None) == operator_accepts(name), error


def test_chart_copies_equal_the_monitoring_sources() -> None:
    for name in ("alerts.yaml", "dashboard.json"):
        assert (CHART / "files" / name).read_bytes() == (ROOT / "monitoring" / name).read_bytes(), \
            f"cp monitoring/{name} helm/lockstep/files/{name}"


GOOD_DURATIONS = ["15s", "1m30s", "1m", "500ms", "2h", "1h30m", "1d", "1w", "1y", "1y2w3d4h5m6s7ms", "90s", "0s"]
BAD_DURATIONS = ["", "often", "15", "30s1m", "1.5m", "1m 30s", "m", "1M", "-1s", "1ms1s", "1h1h"]


@pytest.mark.parametrize("interval", GOOD_DURATIONS)
def test_values_schema_takes_prometheus_durations(interval: str) -> None:
    """Prometheus durations: units y w d h m s ms, each at most once, largest first (1m30s)."""
    values = {"monitoring": {"serviceMonitor": {"enabled": True, "interval": interval}}}
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
    (sm,) = kinds(render(values))["ServiceMonitor"]
    assert sm["spec"]["endpoints"][0]["interval"] == interval


def test_every_duration_value_uses_the_duration_grammar() -> None:
    """Each value whose default is a duration (15s) is checked by the schema's one duration definition."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    found = []

    def walk(value: object, node: dict, path: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if k != "resources":  # Kubernetes quantities (100m CPU), not durations
                    walk(v, node.get("properties", {}).get(k, {}), f"{path}.{k}")
        elif isinstance(value, str) and re.fullmatch(r"([0-9]+(y|w|d|h|m|s|ms))+", value):
            found.append(path)
            assert node == {"$ref": "#/definitions/duration"}, path
    walk(yaml.safe_load((CHART / "values.yaml").read_text()), schema, "")
    assert found == [".monitoring.serviceMonitor.interval"]


@pytest.mark.parametrize("interval", BAD_DURATIONS)
def test_values_schema_refuses_what_is_not_a_duration(interval: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="interval"):
        chart.validate_schema({"monitoring": {"serviceMonitor": {"interval": interval}}})


@pytest.mark.parametrize(("values", "field"), [
    ({"deployment": {"spec": {"tensorParallelSize": 0}}}, "tensorParallelSize"),
    ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ({"operator": {"replicas": 2}}, "replicas"),
    ({"monitoring": {"serviceMonitor": {"interval": "often"}}}, "interval"),
    ({"unknownKey": 1}, "unknownKey"),
    ({"deployment": {"spec": {"tensorParalelSize": 2}}}, "tensorParalelSize"),  # the API server would prune it
    ({"deployment": {"spec": {"env": [{"value": "x"}]}}}, "name"),  # Kubernetes refuses it in the pod spec
    ({"deployment": {"spec": {"volumeMounts": [{"name": "data"}]}}}, "mountPath"),
    ({"deployment": {"spec": {"tls": {"enabled": True, "secretNam": "t"}}}}, "secretNam"),
])
def test_values_schema_refuses_bad_values(values: dict, field: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match=field):
        chart.validate_schema(values)


def test_values_schema_spec_is_the_resources_own() -> None:
    """`deployment.spec` in values.schema.json is generated from the CRD (`python -m lockstep_operator.crd
    --values-schema`), with unknown fields refused: a chart value the resource would lose never installs."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema == with_spec_schema(schema)


def test_extra_labels_override_the_charts_own_and_each_key_appears_once() -> None:
    """A label given in values that the chart sets too (the Grafana sidecar's `grafana_dashboard`, a chart label)
    is written once, with the value given: a duplicate key in one map is refused by Flux and kustomize."""
    values = {"monitoring": {"dashboard": {"labels": {"grafana_dashboard": "lockstep", "team": "ml"}},
                             "serviceMonitor": {"enabled": True, "labels": {"app.kubernetes.io/name": "x"}},
                             "prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}}
    for template, key, value in (("dashboard.yaml", "grafana_dashboard", "lockstep"),
                                 ("servicemonitor.yaml", "app.kubernetes.io/name", "x"),
                                 ("prometheusrule.yaml", "release", "kps")):
        text = chart_text(values, template)
        metadata = re.split(r"\n(spec|data):", text)[0]
        assert metadata.count(f"{key}:") == 1, metadata
        labels = yaml.safe_load(text)["metadata"]["labels"]
        assert labels[key] == value and labels["app.kubernetes.io/instance"] == "demo"
    assert yaml.safe_load(chart_text(values, "dashboard.yaml"))["metadata"]["labels"]["team"] == "ml"
    assert yaml.safe_load(chart_text({}, "dashboard.yaml"))["metadata"]["labels"]["grafana_dashboard"] == "1"


def chart_text(values: dict, template: str) -> str:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name="demo", namespace="ml", is_install=True)[f"lockstep/templates/{template}"]
