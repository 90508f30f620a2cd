"""`spec.tls` end to end without a cluster: the env the operator writes, given to real processes.

The rank runs as `lockstep rank` with exactly the rank container's env (paths under the Secret's mount moved to
files of this test's CA); the coordinator's `RankClientAuth` comes from `parse_config` over the coordinator
container's env. The kubelet's probe is a plaintext grpc.health.v1 call to the port the manifest's probes name.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lockstep.coordinator.config import parse_config
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.proto_gen.lockstep.v1 import rank_pb2_grpc
from lockstep_operator import manifests as m
from lockstep_operator.resource import normalize
from test_rank_auth import TOKEN, _code, _info
from test_rank_auth import pki as pki  # noqa: F401 - the fixture, used by name
from test_rank_service import _free_port, _start_rank, _wait_for_health

SPEC = {"tensorParallelSize": 3, "tls": {"secretName": "rank-certs", "serverName": "lockstep-rank"}}


def _container_env(pod: dict, moved: dict[str, str]) -> dict[str, str]:
    """A pod's plain env values, with each mount path prefix in `moved` replaced by a local directory."""
    (c,) = pod["spec"]["containers"]
    env = {}
    for e in c["env"]:
        if "value" in e:
            value = e["value"]
            for mount, local in moved.items():
                value = value.replace(mount, local)
            env[e["name"]] = value
    return env


def test_operator_configured_rank_and_coordinator_talk_tls_and_probes_stay_plaintext(tmp_path: Path, pki):  # noqa: F811
    secret, token_dir = tmp_path / "tls", tmp_path / "token"
    secret.mkdir()
    token_dir.mkdir()
    # a certificate for the name `lockstep-rank` only, as `serverName` says
    (secret / "tls.crt").write_bytes(pki["named.pem"].read_bytes())
    (secret / "tls.key").write_bytes(pki["named.key"].read_bytes())
    (secret / "ca.crt").write_bytes(pki["ca.pem"].read_bytes())
    (token_dir / m.GROUP_TOKEN_KEY).write_text(TOKEN)
    groups_dir = tmp_path / "groups"
    groups_dir.mkdir()
    moved = {m.TLS_MOUNT: str(secret), m.GROUP_TOKEN_MOUNT: str(token_dir), m.GROUPS_MOUNT: str(groups_dir)}
    spec = normalize(SPEC)
    (groups_dir / m.GROUPS_KEY).write_text(m.groups_configmap("demo", "ml", spec)["data"][m.GROUPS_KEY])
    rank_pod = m.rank_pod_template("demo", "ml", spec, 0)
    rank_env = _container_env(rank_pod, moved)
    (container,) = rank_pod["spec"]["containers"]
    probe_port = container["readinessProbe"]["grpc"]["port"]
    assert probe_port == int(rank_env["LOCKSTEP_HEALTH_PORT"]) != int(rank_env["LOCKSTEP_GRPC_PORT"])

    port, health_port = _free_port(), _free_port()  # the pod's ports, moved to free ones on this machine
    proc = _start_rank(port, load_seconds=0.2, extra_env=rank_env | {
        "LOCKSTEP_GRPC_PORT": str(port), "LOCKSTEP_HEALTH_PORT": str(health_port), "XDG_CACHE_HOME": str(tmp_path)})
    probe = grpc.insecure_channel(f"127.0.0.1:{health_port}")
    try:
        seen = _wait_for_health(probe, health_pb2.HealthCheckResponse.SERVING, time.monotonic() + 60)
        assert seen[-1] == health_pb2.HealthCheckResponse.SERVING, seen
        assert _code(lambda: rank_pb2_grpc.RankServiceStub(probe).Info(pb.InfoRequest(), timeout=5)) == \
            grpc.StatusCode.UNIMPLEMENTED

        coord_pod = m.coordinator_deployment("demo", "ml", spec)["spec"]["template"]
        config = parse_config([], env=_container_env(coord_pod, moved))
        auth = config.rank_auth
        assert auth.tls and auth.tls_server_name == "lockstep-rank" and auth.token == TOKEN
        assert _info(auth, f"127.0.0.1:{port}") == 1
        with auth.channel(f"127.0.0.1:{port}") as channel:  # the coordinator's own health check, over TLS
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        probe.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
