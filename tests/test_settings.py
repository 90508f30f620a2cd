"""Flags and environment are read one way by every service: flag over variable over default, and a bad
value is an error naming where it came from."""

from __future__ import annotations

import argparse

import pytest

from lockstep.coordinator.config import CoordinatorConfig, parse_config, parse_groups
from lockstep.rank.main import parse_args as rank_args
from lockstep.serve import parse_args as serve_args
from lockstep.settings import Setting, add_settings, boolean, integer, number, resolve, within

GROUP = ["--group", "g0=127.0.0.1:1,127.0.0.1:2"]


def _resolve(argv: list[str], env: dict[str, str], *settings: Setting) -> dict:
    p = argparse.ArgumentParser(prog="t")
    add_settings(p, settings)
    return resolve(p, p.parse_args(argv), settings, env)


def test_flag_wins_over_variable_over_default():
    s = Setting("port", "--port", "T_PORT", integer, 7, check=within(0, 65535))
    assert _resolve([], {}, s) == {"port": 7}
    assert _resolve([], {"T_PORT": " 9 "}, s) == {"port": 9}
    assert _resolve(["--port", "11"], {"T_PORT": "9"}, s) == {"port": 11}
    assert _resolve([], {"T_PORT": ""}, s) == {"port": 7}  # an empty variable is unset


@pytest.mark.parametrize("argv, env, words", [
    ([], {"T_PORT": "http"}, "T_PORT must be an integer, got 'http'"),
    ([], {"T_PORT": "70000"}, "T_PORT must be in [0, 65535], got 70000"),
    (["--port", "-1"], {}, "--port must be in [0, 65535], got -1"),
    (["--port", "x"], {}, "must be an integer, got 'x'"),
    ([], {"T_RATE": "nan"}, "T_RATE must be a finite number, got 'nan'"),
    ([], {"T_RATE": "Infinity"}, "T_RATE must be a finite number"),
])
def test_bad_values_name_their_source(argv, env, words, capsys):
    settings = (Setting("port", "--port", "T_PORT", integer, 7, check=within(0, 65535)),
                Setting("rate", "--rate", "T_RATE", number, 1.0))
    with pytest.raises(SystemExit):
        _resolve(argv, env, *settings)
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("word, value", [("1", True), ("true", True), ("ON", True), ("yes", True),
                                         ("0", False), ("false", False), ("off", False), ("No", False)])
def test_booleans(word, value):
    assert boolean(word) is value


@pytest.mark.parametrize("word, caching", [("false", False), ("0", False), ("no", False), ("true", True),
                                           ("1", True), ("", True)])
def test_prefix_caching_variable_means_the_same_to_every_service(word, caching):
    """`LOCKSTEP_PREFIX_CACHING=false` used to leave the coordinator caching while the ranks did not."""
    env = {"LOCKSTEP_PREFIX_CACHING": word}
    assert rank_args([], env=env, hostname="laptop").prefix_caching is caching
    assert parse_config(GROUP, env=env).prefix_caching is caching
    assert serve_args([], env=env).prefix_caching is caching


@pytest.mark.parametrize("argv, env, words", [
    (GROUP, {"LOCKSTEP_HTTP_PORT": "eighty"}, "LOCKSTEP_HTTP_PORT must be an integer, got 'eighty'"),
    (GROUP, {"LOCKSTEP_STALL_THRESHOLD_SECONDS": "soon"}, "LOCKSTEP_STALL_THRESHOLD_SECONDS must be a number"),
    (GROUP + ["--max-num-seqs", "0"], {}, "--max-num-seqs must be >= 1, got 0"),
    (GROUP, {"LOCKSTEP_PREFIX_CACHING": "maybe"}, "LOCKSTEP_PREFIX_CACHING must be 0 or 1"),
    ([], {}, "no group given"),
    (["--group", "g0"], {}, "a group is NAME=HOST:PORT"),
])
def test_coordinator_refuses_bad_settings_by_name(argv, env, words, capsys):
    """A bad environment value used to be a ValueError traceback in the coordinator."""
    with pytest.raises(SystemExit) as exc:
        parse_config(argv, env=env)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_coordinator_config_from_flags_and_environment():
    config = parse_config(["--max-num-seqs", "8"], env={"LOCKSTEP_GROUPS": "a=h:1,h:2; b=h:3",
                                                        "LOCKSTEP_REPLAY_TIMEOUT_SECONDS": "60"})
    assert config.groups == {"a": ("h:1", "h:2"), "b": ("h:3",)}
    assert (config.max_num_seqs, config.replay_timeout, config.page_size) == (8, 60.0, 16)
    assert parse_groups(["g0=x:1", "g1=y:1,y:2"]) == {"g0": ("x:1",), "g1": ("y:1", "y:2")}
    with pytest.raises(ValueError, match="page_size must be an integer >= 1"):
        CoordinatorConfig(page_size=0)


def test_serve_refuses_a_bad_rank_kv_pages(capsys):
    with pytest.raises(SystemExit):
        serve_args(["--rank-kv-pages", "one=5"], env={})
    assert "--rank-kv-pages takes RANK=PAGES" in capsys.readouterr().err
    assert serve_args(["--rank-kv-pages", "1=32"], env={}).rank_pages == {(0, 1): 32}
