"""The rebalance flags: flag over variable over default on `lockstep coordinator` and `lockstep serve` alike,
a bad value refused by name, and one `RebalancePolicy` out of them (DESIGN.md: rebalance flags)."""

from __future__ import annotations

import pytest

from lockstep.coordinator.config import CoordinatorConfig, parse_config
from lockstep.coordinator.rebalance import RebalancePolicy
from lockstep.serve import coordinator_settings
from lockstep.serve import parse_args as serve_args

GROUP = ["--group", "g0=127.0.0.1:1,127.0.0.1:2"]
ENV = {"LOCKSTEP_REBALANCE_INTERVAL_STEPS": "20", "LOCKSTEP_REBALANCE_COOLDOWN": "30.5",
       "LOCKSTEP_REBALANCE_MIN_SAMPLES": "0", "LOCKSTEP_REBALANCE_THRESHOLD": "1.5",
       "LOCKSTEP_REBALANCE_ENABLED": "0"}
FLAGS = ["--rebalance-interval-steps", "7", "--rebalance-cooldown", "0", "--rebalance-min-samples", "50",
         "--rebalance-threshold", "1.0"]


def coordinator_policy(argv: list[str], env: dict[str, str]) -> RebalancePolicy:
    return parse_config(GROUP + argv, env=env).rebalance_policy


def serve_policy(argv: list[str], env: dict[str, str]) -> RebalancePolicy:
    """What `lockstep serve` hands its coordinator: the same settings, through the same config."""
    return CoordinatorConfig(**coordinator_settings(serve_args(argv, env=env))).rebalance_policy


@pytest.mark.parametrize("policy", [coordinator_policy, serve_policy])
def test_defaults_are_the_policy_defaults(policy):
    assert policy([], {}) == RebalancePolicy() == RebalancePolicy(
        enabled=True, interval_steps=10, cooldown_s=120.0, min_samples=2000, threshold=1.25)


@pytest.mark.parametrize("policy", [coordinator_policy, serve_policy])
def test_variables_set_every_field(policy):
    assert policy([], ENV) == RebalancePolicy(enabled=False, interval_steps=20, cooldown_s=30.5, min_samples=0,
                                              threshold=1.5)


@pytest.mark.parametrize("policy", [coordinator_policy, serve_policy])
def test_flags_win_over_variables(policy):
    got = policy(FLAGS, ENV | {"LOCKSTEP_REBALANCE_ENABLED": "1"})
    assert got == RebalancePolicy(enabled=True, interval_steps=7, cooldown_s=0.0, min_samples=50, threshold=1.0)
    assert policy(["--no-rebalance"], {"LOCKSTEP_REBALANCE_ENABLED": "yes"}).enabled is False


@pytest.mark.parametrize("word, enabled", [("0", False), ("false", False), ("off", False), ("1", True),
                                           ("true", True), ("", True)])
def test_the_switch_variable_reads_in_its_own_sense(word, enabled):
    """`LOCKSTEP_REBALANCE_ENABLED=0` is `--no-rebalance`, as `LOCKSTEP_PREFIX_CACHING=0` is `--no-prefix-caching`."""
    env = {"LOCKSTEP_REBALANCE_ENABLED": word}
    assert coordinator_policy([], env).enabled is enabled
    assert serve_policy([], env).enabled is enabled


@pytest.mark.parametrize("argv, env, words", [
    (["--rebalance-interval-steps", "0"], {}, "--rebalance-interval-steps must be >= 1, got 0"),
    (["--rebalance-interval-steps", "2.5"], {}, "must be an integer, got '2.5'"),
    ([], {"LOCKSTEP_REBALANCE_INTERVAL_STEPS": "often"}, "LOCKSTEP_REBALANCE_INTERVAL_STEPS must be an integer"),
    ([], {"LOCKSTEP_REBALANCE_COOLDOWN": "-1"}, "LOCKSTEP_REBALANCE_COOLDOWN must be >= 0, got -1.0"),
    ([], {"LOCKSTEP_REBALANCE_COOLDOWN": "inf"}, "LOCKSTEP_REBALANCE_COOLDOWN must be a finite number"),
    (["--rebalance-min-samples", "-5"], {}, "--rebalance-min-samples must be >= 0, got -5"),
    ([], {"LOCKSTEP_REBALANCE_THRESHOLD": "0.9"}, "LOCKSTEP_REBALANCE_THRESHOLD must be >= 1.0, got 0.9"),
    (["--rebalance-threshold", "nan"], {}, "must be a finite number, got 'nan'"),
    ([], {"LOCKSTEP_REBALANCE_ENABLED": "maybe"}, "LOCKSTEP_REBALANCE_ENABLED must be 0 or 1"),
])
@pytest.mark.parametrize("policy", [coordinator_policy, serve_policy])
def test_bad_values_are_refused_by_name(policy, argv, env, words, capsys):
    with pytest.raises(SystemExit) as exc:
        policy(argv, env)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("field, value, words", [
    ("rebalance_interval_steps", 0, "rebalance interval"), ("rebalance_cooldown", -1.0, "cooldown"),
    ("rebalance_min_samples", -1, "minimum samples"), ("rebalance_threshold", 0.5, "threshold"),
])
def test_a_config_built_in_code_is_checked_too(field, value, words):
    """`lockstep serve` and tests build the config without the parser: a bad policy fails at once, not at a
    group's first rebalance check."""
    with pytest.raises(ValueError, match=words):
        CoordinatorConfig(**{field: value})
