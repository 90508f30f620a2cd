"""The operator's pure builders: every object valid for Kubernetes, and wired as commands.md says."""

from __future__ import annotations

import kubernetes_validate
import pytest

from lockstep.coordinator.group_list import parse_group_list
from lockstep_operator import manifests as m
from lockstep_operator.resource import SpecError, normalize

SPECS = {
    "default": {},
    "tp3x2": {"tensorParallelSize": 3, "groups": 2},
    "pvc-tp4": {"model": {"pvc": {"claimName": "weights", "path": "/llama/"}, "servedModelName": "llama"},
                "tensorParallelSize": 4, "groups": 3, "networkPolicy": False,
                "coordinator": {"serviceType": "LoadBalancer", "httpPort": 9000, "grpcPort": 9001},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "nodeSelector": {"gpu": "h100"},
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [
                        {"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                "imagePullSecrets": [{"name": "regcred"}]},
    "path-cpu": {"model": {"path": "/opt/model"}, "tensorParallelSize": 2,
                 "resources": {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "8Gi"}},
                 "kvCache": {"pages": 512, "prefixCaching": False},
                 "agreement": {"stallThresholdSeconds": 2, "deadRankTimeoutSeconds": 12}},
    "rebalance": {"tensorParallelSize": 3, "groups": 2,
                  "kvCache": {"rebalance": {"enabled": False, "intervalSteps": 25, "cooldownSeconds": 30.5,
                                            "minSamples": 0, "threshold": 1.5}}},
    "tls": {"tensorParallelSize": 3, "groups": 2, "tls": {"secretName": "rank-certs"}},
    "tls-mutual": {"model": {"path": "/opt/model"}, "tensorParallelSize": 2,
                   "tls": {"secretName": "rank-certs", "serverName": "lockstep-rank", "clientAuth": True}},
}
REBALANCE_VARIABLES = ("LOCKSTEP_REBALANCE_ENABLED", "LOCKSTEP_REBALANCE_INTERVAL_STEPS", "LOCKSTEP_REBALANCE_COOLDOWN",
                       "LOCKSTEP_REBALANCE_MIN_SAMPLES", "LOCKSTEP_REBALANCE_THRESHOLD")


def build(key: str, name: str = "demo", namespace: str = "ml") -> tuple[dict, list[dict]]:
    spec = normalize(SPECS[key])
    return spec, m.build_all(name, namespace, spec)


def by(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("version", ["1.30", "1.33"])
@pytest.mark.parametrize("key", sorted(SPECS))
def test_every_manifest_is_valid_kubernetes(key: str, version: str) -> None:
    _, objs = build(key)
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)


def test_names_and_counts_follow_the_design() -> None:
    spec, objs = build("tp3x2")
    names = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert names == sorted([("StatefulSet", "demo-g0"), ("Service", "demo-g0"), ("NetworkPolicy", "demo-g0"),
                            ("StatefulSet", "demo-g1"), ("Service", "demo-g1"), ("NetworkPolicy", "demo-g1"),
                            ("Deployment", "demo-coordinator"), ("Service", "demo"), ("ConfigMap", "demo-groups")])
    assert all(o["metadata"]["namespace"] == "ml" for o in objs)
    _, objs = build("pvc-tp4")
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "StatefulSet"] == ["demo-g0", "demo-g1", "demo-g2"]
    assert not [o for o in objs if o["kind"] == "NetworkPolicy"]


def test_rank_statefulset() -> None:
    spec, objs = build("tp3x2")
    sts = by(objs, "StatefulSet", "demo-g1")["spec"]
    assert sts["replicas"] == 3 and sts["podManagementPolicy"] == "Parallel"
    assert sts["serviceName"] == "demo-g1" and sts["updateStrategy"] == {"type": "OnDelete"}
    pod = sts["template"]
    assert sts["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["lockstep", "rank"]
    env = env_of(c)
    assert env["LOCKSTEP_WORLD_SIZE"] == "3"
    assert env["LOCKSTEP_RENDEZVOUS"] == "demo-g1-0.demo-g1.ml.svc.cluster.local:29500"
    assert env["LOCKSTEP_POD_INDEX"] == {"fieldRef": {
        "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert env["LOCKSTEP_GRPC_PORT"] == "50051" and env["LOCKSTEP_MODEL"] == "builtin"
    assert env["LOCKSTEP_PAGE_SIZE"] == "16" and env["LOCKSTEP_PREFIX_CACHING"] == "1"
    assert {p["containerPort"] for p in c["ports"]} == {50051, 29500}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"] == {"port": 50051}
    assert c["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]


def test_headless_service_publishes_not_ready_ranks() -> None:
    _, objs = build("tp3x2")
    svc = by(objs, "Service", "demo-g0")["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    assert {p["port"] for p in svc["ports"]} == {50051, 29500}
    assert svc["selector"] == by(objs, "StatefulSet", "demo-g0")["spec"]["selector"]["matchLabels"]


def test_network_policy_admits_only_coordinator_and_own_group() -> None:
    _, objs = build("tp3x2")
    pol = by(objs, "NetworkPolicy", "demo-g0")["spec"]
    coordinator_labels = by(objs, "Deployment", "demo-coordinator")["spec"]["template"]["metadata"]["labels"]
    g0_labels = by(objs, "StatefulSet", "demo-g0")["spec"]["template"]["metadata"]["labels"]
    g1_labels = by(objs, "StatefulSet", "demo-g1")["spec"]["template"]["metadata"]["labels"]
    assert pol["policyTypes"] == ["Ingress"]
    peers = [(rule["from"][0]["podSelector"]["matchLabels"], rule.get("ports")) for rule in pol["ingress"]]
    matches = lambda sel, labels: sel.items() <= labels.items()
    assert any(matches(s, coordinator_labels) and ports == [{"protocol": "TCP", "port": 50051}] for s, ports in peers)
    assert any(matches(s, g0_labels) for s, _ in peers)
    assert not any(matches(s, g1_labels) for s, _ in peers), "another group's ranks must not reach g0"


def test_coordinator_is_told_every_rank() -> None:
    _, objs = build("tp3x2")
    dep = by(objs, "Deployment", "demo-coordinator")["spec"]
    assert dep["replicas"] == 1 and dep["strategy"] == {"type": "Recreate"}
    (c,) = dep["template"]["spec"]["containers"]
    assert c["command"] == ["lockstep", "coordinator"]
    env = env_of(c)
    ranks = lambda g: ",".join(f"demo-{g}-{r}.demo-{g}.ml.svc.cluster.local:50051" for r in range(3))
    assert "LOCKSTEP_GROUPS" not in env
    assert env["LOCKSTEP_GROUPS_FILE"] == f"{m.GROUPS_MOUNT}/{m.GROUPS_KEY}"
    groups = by(objs, "ConfigMap", "demo-groups")
    assert groups["data"] == {m.GROUPS_KEY: f"g0={ranks('g0')}\ng1={ranks('g1')}\n"}
    assert groups["metadata"]["labels"] == dep["template"]["metadata"]["labels"]
    pod = dep["template"]["spec"]
    assert {"name": m.GROUPS_VOLUME, "configMap": {"name": "demo-groups"}} in pod["volumes"]
    # a directory mount: the kubelet never updates a subPath mount, so the coordinator would not see a change
    assert {"name": m.GROUPS_VOLUME, "mountPath": m.GROUPS_MOUNT, "readOnly": True} in c["volumeMounts"]
    assert env["LOCKSTEP_HTTP_PORT"] == "8000" and env["LOCKSTEP_GRPC_PORT"] == "8001"
    assert env["LOCKSTEP_API_WORKERS"] == "0"
    assert env["LOCKSTEP_STALL_THRESHOLD_SECONDS"] == "5"
    assert env["LOCKSTEP_DEAD_RANK_TIMEOUT_SECONDS"] == "30"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "httpGet" not in c["livenessProbe"], "a down group must not restart the coordinator"
    assert "nvidia.com/gpu" not in str(c["resources"])
    svc = by(objs, "Service", "demo")["spec"]
    assert svc["selector"].items() <= dep["template"]["metadata"]["labels"].items()
    assert {(p["name"], p["port"]) for p in svc["ports"]} == {("http", 8000), ("grpc", 8001)}


def test_pvc_model_scheduling_and_extra_env() -> None:
    spec, objs = build("pvc-tp4")
    pod = by(objs, "StatefulSet", "demo-g2")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = env_of(c)
    assert env["LOCKSTEP_MODEL"] == "/models/llama" and env["NCCL_DEBUG"] == "INFO"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert pod["tolerations"] == SPECS["pvc-tp4"]["tolerations"]
    assert pod["nodeSelector"] == {"gpu": "h100"} and "nodeAffinity" in pod["affinity"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    coord = by(objs, "Deployment", "demo-coordinator")["spec"]["template"]["spec"]
    cenv = env_of(coord["containers"][0])
    assert cenv["LOCKSTEP_MODEL"] == "/models/llama" and cenv["LOCKSTEP_SERVED_MODEL_NAME"] == "llama"
    # pinned to the ranks' (tainted) GPU nodes, it tolerates their taint, else it stays Pending
    assert coord["nodeSelector"] == {"gpu": "h100"} and coord["tolerations"] == SPECS["pvc-tp4"]["tolerations"]
    assert coord["affinity"] == SPECS["pvc-tp4"]["affinity"] and coord["imagePullSecrets"] == [{"name": "regcred"}]
    apart = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app.kubernetes.io/component": "rank"}},
         "topologyKey": "kubernetes.io/hostname"}]}}
    spread = normalize({**SPECS["pvc-tp4"], "affinity": {**SPECS["pvc-tp4"]["affinity"], **apart}})
    coord = m.coordinator_deployment("demo", "ml", spread)["spec"]["template"]["spec"]
    assert coord["affinity"] == SPECS["pvc-tp4"]["affinity"], "rank pod terms are not the coordinator's"
    groups = by(objs, "ConfigMap", "demo-groups")["data"][m.GROUPS_KEY]
    assert groups.count("\n") == 3 and groups.count(",") == 9
    assert by(objs, "Service", "demo")["spec"]["type"] == "LoadBalancer"
    assert m.endpoint("demo", "ml", spec) == "http://demo.ml.svc.cluster.local:9000"


def test_kv_and_agreement_settings_reach_the_commands() -> None:
    _, objs = build("path-cpu")
    rank_env = env_of(by(objs, "StatefulSet", "demo-g0")["spec"]["template"]["spec"]["containers"][0])
    assert rank_env["LOCKSTEP_KV_PAGES"] == "512" and rank_env["LOCKSTEP_PREFIX_CACHING"] == "0"
    assert rank_env["LOCKSTEP_MODEL"] == "/opt/model"
    coord_env = env_of(by(objs, "Deployment", "demo-coordinator")["spec"]["template"]["spec"]["containers"][0])
    assert coord_env["LOCKSTEP_STALL_THRESHOLD_SECONDS"] == "2"
    assert coord_env["LOCKSTEP_DEAD_RANK_TIMEOUT_SECONDS"] == "12"
    assert coord_env["LOCKSTEP_REPLAY_TIMEOUT_SECONDS"] == "300"
    assert coord_env["LOCKSTEP_PREFIX_CACHING"] == "0"


def _rebalance_env(container: dict) -> dict[str, str]:
    env = env_of(container)
    return {k: env[k] for k in env if k.startswith("LOCKSTEP_REBALANCE")}


@pytest.mark.parametrize(("key", "expected"), [
    ("default", ("1", "10", "120", "2000", "1.25")),
    ("rebalance", ("0", "25", "30.5", "0", "1.5")),
])
def test_rebalance_settings_reach_the_coordinator_only(key: str, expected: tuple[str, ...]) -> None:
    """The coordinator decides every rebalance; the ranks carry out the split its plan names and read none."""
    _, objs = build(key)
    (coordinator,) = by(objs, "Deployment", "demo-coordinator")["spec"]["template"]["spec"]["containers"]
    assert _rebalance_env(coordinator) == dict(zip(REBALANCE_VARIABLES, expected, strict=True))
    for o in objs:
        if o["kind"] == "StatefulSet":
            (rank,) = o["spec"]["template"]["spec"]["containers"]
            assert _rebalance_env(rank) == {}, f"{o['metadata']['name']}'s ranks must not get rebalance settings"


def test_changing_rebalance_settings_restarts_the_coordinator_but_rolls_no_group() -> None:
    """A rank pod template that does not change keeps its hash, so the operator rolls no group for it."""
    default, changed = normalize(SPECS["tp3x2"]), normalize(SPECS["rebalance"])
    h = lambda t: t["metadata"]["annotations"][m.ANNOTATION_HASH]
    for i in range(2):
        assert m.rank_pod_template("demo", "ml", default, i) == m.rank_pod_template("demo", "ml", changed, i)
        assert h(m.rank_pod_template("demo", "ml", default, i)) == h(m.rank_pod_template("demo", "ml", changed, i))
    template = lambda spec: m.coordinator_deployment("demo", "ml", spec)["spec"]["template"]
    assert template(default) != template(changed)


def test_scaling_groups_changes_the_group_list_but_not_the_coordinator() -> None:
    """The coordinator's Deployment is Recreate: a pod template that changed with `spec.groups` would restart
    it and drop the requests in flight on every group. Only the ConfigMap it re-reads changes."""
    two, three = (normalize({"tensorParallelSize": 3, "groups": n}) for n in (2, 3))
    assert m.coordinator_deployment("demo", "ml", two) == m.coordinator_deployment("demo", "ml", three)
    before, after = (m.groups_configmap("demo", "ml", s)["data"][m.GROUPS_KEY] for s in (two, three))
    assert after.startswith(before) and after[len(before):].startswith("g2=demo-g2-0.demo-g2.ml.svc.")
    assert parse_group_list(before) == {f"g{i}": tuple(f"demo-g{i}-{r}.demo-g{i}.ml.svc.cluster.local:50051"
                                                      for r in range(3)) for i in range(2)}


def test_template_hash_tracks_the_pod_spec() -> None:
    one = m.rank_pod_template("demo", "ml", normalize({"tensorParallelSize": 1}), 0)
    three = m.rank_pod_template("demo", "ml", normalize({"tensorParallelSize": 3}), 0)
    again = m.rank_pod_template("demo", "ml", normalize({"tensorParallelSize": 3}), 0)
    h = lambda t: t["metadata"]["annotations"][m.ANNOTATION_HASH]
    assert h(one) != h(three) and h(three) == h(again)


def test_group_objects_carry_their_index_but_the_pod_template_does_not() -> None:
    _, objs = build("pvc-tp4")
    for i in range(3):
        for kind in ("StatefulSet", "Service"):
            labels = by(objs, kind, f"demo-g{i}")["metadata"]["labels"]
            assert labels[m.LABEL_GROUP_INDEX] == str(i) and labels[m.LABEL_GROUP] == f"demo-g{i}"
        sts = by(objs, "StatefulSet", f"demo-g{i}")["spec"]
        # On the pods it would change every template hash, and so roll every group once on upgrade.
        assert m.LABEL_GROUP_INDEX not in sts["template"]["metadata"]["labels"]
        assert m.LABEL_GROUP_INDEX not in sts["selector"]["matchLabels"], "a selector cannot change"
    _, objs = build("tp3x2")
    assert by(objs, "NetworkPolicy", "demo-g1")["metadata"]["labels"][m.LABEL_GROUP_INDEX] == "1"


def test_group_token_secret_is_mounted_by_every_rank_and_the_coordinator() -> None:
    import base64

    secret = m.group_token_secret("demo", "ml", "tok-123")
    kubernetes_validate.validate(secret, "1.33", strict=True)
    assert secret["metadata"]["name"] == m.group_token_secret_name("demo") == "demo-group-token"
    assert secret["immutable"] is True and base64.b64decode(secret["data"]["token"]) == b"tok-123"
    _, objs = build("tp3x2")
    assert not [o for o in objs if o["kind"] == "Secret"], "the random Secret is created once, never applied"
    pods = [by(objs, "StatefulSet", g)["spec"]["template"]["spec"] for g in ("demo-g0", "demo-g1")]
    pods.append(by(objs, "Deployment", "demo-coordinator")["spec"]["template"]["spec"])
    for pod in pods:
        (c,) = pod["containers"]
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == "demo-group-token"
        (mount,) = [mt for mt in c["volumeMounts"] if mt["name"] == volume["name"]]
        assert mount["readOnly"] is True
        assert env_of(c)["LOCKSTEP_GROUP_TOKEN_FILE"] == f"{mount['mountPath']}/token"
        assert "LOCKSTEP_GROUP_TOKEN" not in env_of(c), "the token itself is never in a pod spec"


def _tls_parts(pod: dict) -> tuple[dict, dict, dict[str, str]]:
    """The TLS Secret volume, its mount and the env of a pod's one container."""
    (c,) = pod["containers"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == m.TLS_VOLUME]
    (mount,) = [mt for mt in c["volumeMounts"] if mt["name"] == m.TLS_VOLUME]
    return volume, mount, env_of(c)


def test_tls_ranks_serve_their_certificate_and_probes_go_to_the_plaintext_health_port() -> None:
    _, objs = build("tls")
    for g in ("demo-g0", "demo-g1"):
        pod = by(objs, "StatefulSet", g)["spec"]["template"]["spec"]
        volume, mount, env = _tls_parts(pod)
        assert volume["secret"] == {"secretName": "rank-certs", "items": [{"key": "tls.crt", "path": "tls.crt"},
                                                                        {"key": "tls.key", "path": "tls.key"}]}
        assert mount == {"name": m.TLS_VOLUME, "mountPath": m.TLS_MOUNT, "readOnly": True}
        assert env["LOCKSTEP_TLS_CERT"] == f"{m.TLS_MOUNT}/tls.crt"
        assert env["LOCKSTEP_TLS_KEY"] == f"{m.TLS_MOUNT}/tls.key"
        assert "LOCKSTEP_TLS_CA" not in env, "no client certificates asked without clientAuth"
        assert env["LOCKSTEP_HEALTH_PORT"] == str(m.RANK_HEALTH_PORT) != env["LOCKSTEP_GRPC_PORT"]
        (c,) = pod["containers"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "store": 29500,
                                                                       "health": m.RANK_HEALTH_PORT}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert c[probe]["grpc"] == {"port": m.RANK_HEALTH_PORT}
    coord = by(objs, "Deployment", "demo-coordinator")["spec"]["template"]["spec"]
    volume, _, env = _tls_parts(coord)
    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}], "the coordinator needs no rank key"
    assert env["LOCKSTEP_RANK_TLS_CA"] == f"{m.TLS_MOUNT}/ca.crt"
    assert not {"LOCKSTEP_RANK_TLS_CERT", "LOCKSTEP_RANK_TLS_KEY", "LOCKSTEP_RANK_TLS_SERVER_NAME"} & set(env)
    assert by(objs, "ConfigMap", "demo-groups")["data"][m.GROUPS_KEY].startswith(
        "g0=demo-g0-0.demo-g0.ml.svc.cluster.local:50051,"), "the coordinator verifies each rank by the name it dials"


def test_mutual_tls_and_a_server_name() -> None:
    _, objs = build("tls-mutual")
    rank = by(objs, "StatefulSet", "demo-g0")["spec"]["template"]["spec"]
    volume, _, env = _tls_parts(rank)
    assert [i["key"] for i in volume["secret"]["items"]] == ["tls.crt", "tls.key", "ca.crt"]
    assert env["LOCKSTEP_TLS_CA"] == f"{m.TLS_MOUNT}/ca.crt"
    coord = by(objs, "Deployment", "demo-coordinator")["spec"]["template"]["spec"]
    volume, _, env = _tls_parts(coord)
    assert [i["key"] for i in volume["secret"]["items"]] == ["ca.crt", "tls.crt", "tls.key"]
    assert env["LOCKSTEP_RANK_TLS_CERT"] == f"{m.TLS_MOUNT}/tls.crt"
    assert env["LOCKSTEP_RANK_TLS_KEY"] == f"{m.TLS_MOUNT}/tls.key"
    assert env["LOCKSTEP_RANK_TLS_SERVER_NAME"] == "lockstep-rank"


def test_api_workers_reach_the_coordinator_as_its_own_setting() -> None:
    from lockstep.coordinator.config import parse_config

    spec = normalize({"coordinator": {"apiWorkers": 3}})
    c = m.coordinator_deployment("demo", "ml", spec)["spec"]["template"]["spec"]["containers"][0]
    env = {k: v for k, v in env_of(c).items() if "TOKEN" not in k}  # the mounted token file is not here
    assert parse_config([], {**env, "LOCKSTEP_GROUPS_FILE": "", "LOCKSTEP_GROUPS": "g0=a:1"}).api_workers == 3


def test_the_scheduler_keep_alive_and_watchdog_fields_reach_the_coordinator_as_its_own_settings() -> None:
    from lockstep.coordinator.config import parse_config

    spec = normalize({"scheduler": {"maxNumBatchedTokens": 300, "maxNumSeqs": 20, "longPrefillTokenThreshold": 128}})
    c = m.coordinator_deployment("demo", "ml", spec)["spec"]["template"]["spec"]["containers"][0]
    env = {k: v for k, v in env_of(c).items() if "GROUP_TOKEN" not in k}  # the mounted token file is not here
    cfg = parse_config([], {**env, "LOCKSTEP_GROUPS_FILE": "", "LOCKSTEP_GROUPS": "g0=a:1"})
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.long_prefill_token_threshold) == (300, 20, 128)
    assert normalize({})["scheduler"]["longPrefillTokenThreshold"] == 0  # off, as vLLM's default
    assert cfg.http_keep_alive == 65  # above nginx's and an ALB's 60 s idle timeout, not the local 5 s
    assert cfg.watchdog_timeout == 120
    off = m.coordinator_deployment("demo", "ml", normalize({"coordinator": {"watchdogTimeoutSeconds": 0}}))
    off_env = {k: v for k, v in env_of(off["spec"]["template"]["spec"]["containers"][0]).items()
               if "GROUP_TOKEN" not in k}
    assert parse_config([], {**off_env, "LOCKSTEP_GROUPS_FILE": "", "LOCKSTEP_GROUPS": "g0=a:1"}).watchdog_timeout == 0
    with pytest.raises(SpecError, match="longPrefillTokenThreshold"):
        normalize({"scheduler": {"longPrefillTokenThreshold": -1}})


def test_tls_env_names_are_the_services_own_settings() -> None:
    from lockstep.rank.main import SETTINGS as RANK_OWN
    from lockstep.rank_auth import COORDINATOR_SETTINGS, RANK_SETTINGS

    spec = normalize(SPECS["tls-mutual"])
    rank_env, _, _ = m._rank_tls(spec, "rank")
    coord_env, _, _ = m._rank_tls(spec, "coordinator")
    assert set(rank_env) <= {s.env for s in RANK_SETTINGS + RANK_OWN}
    assert set(coord_env) <= {s.env for s in COORDINATOR_SETTINGS}


def test_without_tls_nothing_changes_and_turning_it_on_rolls_the_groups() -> None:
    plain = m.rank_pod_template("demo", "ml", normalize({"tensorParallelSize": 3}), 0)
    assert not [v for v in plain["spec"]["volumes"] if v["name"] == m.TLS_VOLUME]
    (c,) = plain["spec"]["containers"]
    assert c["readinessProbe"]["grpc"] == {"port": 50051} and "LOCKSTEP_HEALTH_PORT" not in env_of(c)
    tls = m.rank_pod_template("demo", "ml", normalize({"tensorParallelSize": 3, "tls": {"secretName": "x"}}), 0)
    h = lambda t: t["metadata"]["annotations"][m.ANNOTATION_HASH]
    assert h(plain) != h(tls)


@pytest.mark.parametrize("env, seconds", [
    ([], 30),  # the default grace of 5 s: 5 + 5 + 20 fits Kubernetes' own 30
    ([{"name": "LOCKSTEP_SHUTDOWN_GRACE_SECONDS", "value": "60"}], 140),  # 60 + 60 + 20
    ([{"name": "LOCKSTEP_SHUTDOWN_GRACE_SECONDS", "value": "12.5"}], 45),
    ([{"name": "LOCKSTEP_SHUTDOWN_GRACE_SECONDS", "value": "soon"}], 30),  # refused at start, not here
    ([{"name": "LOCKSTEP_SHUTDOWN_GRACE_SECONDS", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}], 30),
])
def test_the_coordinator_pod_gets_time_for_its_whole_bounded_stop(env, seconds) -> None:
    """Kubernetes kills a pod terminationGracePeriodSeconds after SIGTERM: shorter than the coordinator's own
    bounded stop (grace, then its servers, groups and leftovers), streams would be cut with no error event."""
    spec = normalize({"env": env})
    pod = m.coordinator_deployment("demo", "ml", spec)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == seconds
