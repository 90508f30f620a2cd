"""`spec.kvCache.rebalance` end to end without a cluster: the env the operator gives the coordinator is read
by the real coordinator config into the policy the spec asked for, and the CRD, the operator and the
coordinator agree on every default and every range (DESIGN.md "Rebalance agreement")."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.coordinator.config import parse_config
from lockstep.coordinator.rebalance import RebalancePolicy
from lockstep_operator import manifests as m
from lockstep_operator.crd import spec_schema
from lockstep_operator.resource import SpecError, normalize

# CRD field -> RebalancePolicy field
FIELDS = {"enabled": "enabled", "intervalSteps": "interval_steps", "cooldownSeconds": "cooldown_s",
          "minSamples": "min_samples", "threshold": "threshold"}


def coordinator_env(spec: dict, token_file: Path) -> dict[str, str]:
    """The coordinator container's env as the kubelet would give it: the token file and the groups file (the
    ConfigMap's data) are where they are mounted."""
    objs = m.build_all("demo", "ml", normalize(spec))
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["LOCKSTEP_GROUP_TOKEN_FILE"].startswith(m.GROUP_TOKEN_MOUNT)
    assert env["LOCKSTEP_GROUPS_FILE"].startswith(m.GROUPS_MOUNT)
    groups = token_file.parent / m.GROUPS_KEY
    groups.write_text(m.groups_configmap("demo", "ml", normalize(spec))["data"][m.GROUPS_KEY])
    return env | {"LOCKSTEP_GROUP_TOKEN_FILE": str(token_file), "LOCKSTEP_GROUPS_FILE": str(groups)}


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("a-group-token\n")
    return path


def policy_of(spec: dict, token_file: Path) -> RebalancePolicy:
    """What the coordinator started from the operator's Deployment would run with: no flags, only its env."""
    return parse_config([], env=coordinator_env(spec, token_file)).rebalance_policy


@pytest.mark.parametrize(("rebalance", "policy"), [
    ({}, RebalancePolicy()),
    ({"enabled": False}, RebalancePolicy(enabled=False)),
    ({"enabled": False, "intervalSteps": 20, "cooldownSeconds": 30.5, "minSamples": 0, "threshold": 1.5},
     RebalancePolicy(enabled=False, interval_steps=20, cooldown_s=30.5, min_samples=0, threshold=1.5)),
    ({"intervalSteps": 1, "cooldownSeconds": 0, "minSamples": 0, "threshold": 1},
     RebalancePolicy(interval_steps=1, cooldown_s=0.0, min_samples=0, threshold=1.0)),
    # floats whose str() is in exponent form must still be read back exactly
    ({"cooldownSeconds": 0.0001, "threshold": 1.0000001, "minSamples": 10**9, "intervalSteps": 10**6},
     RebalancePolicy(cooldown_s=0.0001, threshold=1.0000001, min_samples=10**9, interval_steps=10**6)),
    ({"cooldownSeconds": 1e20}, RebalancePolicy(cooldown_s=1e20)),
])
def test_the_coordinator_reads_the_spec_it_was_given(rebalance: dict, policy: RebalancePolicy,
                                                     token_file: Path) -> None:
    assert policy_of({"kvCache": {"rebalance": rebalance}}, token_file) == policy


def test_the_default_spec_is_the_coordinators_default_policy(token_file: Path) -> None:
    """A CR that says nothing of rebalance runs exactly as `lockstep coordinator` with no flag does."""
    bare = parse_config(["--group", "g0=h:1"], env={}).rebalance_policy
    assert policy_of({}, token_file) == RebalancePolicy() == bare
    crd = spec_schema()["properties"]["kvCache"]["properties"]["rebalance"]["properties"]
    assert {FIELDS[k]: s["default"] for k, s in crd.items()} == {f: getattr(bare, f) for f in FIELDS.values()}


def test_enabled_false_is_no_rebalance(token_file: Path) -> None:
    off = parse_config(["--no-rebalance"], env=coordinator_env({}, token_file)).rebalance_policy
    assert policy_of({"kvCache": {"rebalance": {"enabled": False}}}, token_file) == off
    assert off.enabled is False


# The lowest value each range takes, and a value just below it: the operator and the coordinator must both
# take the first and both refuse the second (a CR the operator takes must never crash-loop the coordinator).
EDGES = [("intervalSteps", "LOCKSTEP_REBALANCE_INTERVAL_STEPS", 1, 0),
         ("cooldownSeconds", "LOCKSTEP_REBALANCE_COOLDOWN", 0, -0.5),
         ("minSamples", "LOCKSTEP_REBALANCE_MIN_SAMPLES", 0, -1),
         ("threshold", "LOCKSTEP_REBALANCE_THRESHOLD", 1.0, 0.99)]


@pytest.mark.parametrize(("field", "variable", "lowest", "below"), EDGES)
def test_operator_and_coordinator_agree_on_each_range(field: str, variable: str, lowest: float, below: float,
                                                      token_file: Path, capsys: pytest.CaptureFixture) -> None:
    env = coordinator_env({"kvCache": {"rebalance": {field: lowest}}}, token_file)
    assert env[variable] == str(lowest)
    assert getattr(parse_config([], env=env).rebalance_policy, FIELDS[field]) == lowest
    with pytest.raises(SpecError, match=rf"spec\.kvCache\.rebalance\.{field}: must be at least"):
        normalize({"kvCache": {"rebalance": {field: below}}})
    with pytest.raises(SystemExit):
        parse_config([], env=env | {variable: str(below)})
    assert f"{variable} must be >=" in capsys.readouterr().err


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 10**400])
@pytest.mark.parametrize("field", ["cooldownSeconds", "threshold"])
def test_non_finite_numbers_are_refused_by_the_operator(field: str, value: float) -> None:
    """The coordinator refuses them (and NaN passes every range check): the operator must not write them."""
    with pytest.raises(SpecError, match=rf"spec\.kvCache\.rebalance\.{field}: must be a finite number"):
        normalize({"kvCache": {"rebalance": {field: value}}})
