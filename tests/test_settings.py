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
    # vLLM's rule too: no more than the token budget could run at once (found by a helper: silently 4 of 16)
    (GROUP + ["--max-num-batched-tokens", "8"], {}, "max_num_batched_tokens (8) must be at least max_num_seqs (64)"),
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


def test_dtype_reaches_the_rank_from_serve_and_from_its_variable(capsys):
    """`--dtype` / LOCKSTEP_DTYPE mean the same to `lockstep rank` and `lockstep serve`, which hands it to the
    ranks it starts; a dtype the engine does not hold is refused by name."""
    from lockstep.local_ranks import rank_command

    assert rank_args([], env={}, hostname="laptop").engine_config().dtype == "auto"
    assert rank_args([], env={"LOCKSTEP_DTYPE": "bfloat16"}, hostname="laptop").engine_config().dtype == "bfloat16"
    assert rank_args(["--dtype", "float16"], env={"LOCKSTEP_DTYPE": "bfloat16"}, hostname="x").dtype == "float16"
    assert serve_args(["--dtype", "bfloat16"], env={}).dtype == "bfloat16"
    cmd = rank_command(0, 1, "127.0.0.1:1", 2, "m", 16, 8, 1, True, "bfloat16")
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    with pytest.raises(SystemExit):
        rank_args(["--dtype", "float64"], env={}, hostname="laptop")
    assert "--dtype must be one of auto, float32, bfloat16, float16, got 'float64'" in capsys.readouterr().err


@pytest.mark.parametrize("requested, device, checkpoint, want", [
    ("auto", "cpu", "bfloat16", "float32"),  # the CPU keeps float32 whatever the checkpoint says
    ("auto", "cuda", "bfloat16", "bfloat16"),
    ("auto", "cuda", "float16", "float16"),
    ("auto", "cuda", "float32", "bfloat16"),  # float32 checkpoints run in bfloat16 on a GPU (vLLM: float16)
    ("auto", "cuda", None, "bfloat16"),
    ("float32", "cuda", "bfloat16", "float32"),  # asked for: taken as it is
    ("float16", "cpu", None, "float16"),
])
def test_auto_dtype_is_float32_on_the_cpu_and_the_checkpoints_half_dtype_on_a_gpu(requested, device, checkpoint,
                                                                                   want):
    import torch

    from lockstep.device import pick_dtype

    assert pick_dtype(requested, torch.device(device), checkpoint) == getattr(torch, want)


@pytest.mark.parametrize("config, want", [
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),  # transformers 4's name
    ({"text_config": {"torch_dtype": "torch.bfloat16"}}, "bfloat16"),  # a multimodal checkpoint's text model
    ({}, None),
])
def test_checkpoint_dtype_is_read_from_either_name(tmp_path, config, want):
    import json

    from lockstep.model.config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.checkpoint_dtype(tmp_path) == want


def test_serve_refuses_a_token_budget_below_max_num_seqs_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit):
        serve_args(["--max-num-batched-tokens", "16", "--max-num-seqs", "32"], env={})
    assert "max_num_batched_tokens (16) must be at least max_num_seqs (32)" in capsys.readouterr().err
    assert serve_args(["--max-num-batched-tokens", "16", "--max-num-seqs", "16"], env={}).max_num_seqs == 16


def test_the_long_prefill_threshold_reaches_the_coordinator_by_flag_and_environment(capsys):
    assert parse_config(GROUP + ["--long-prefill-token-threshold", "64"], env={}).long_prefill_token_threshold == 64
    env = {"LOCKSTEP_LONG_PREFILL_TOKEN_THRESHOLD": "128"}
    assert parse_config(GROUP, env=env).long_prefill_token_threshold == 128
    assert serve_args([], env=env).long_prefill_token_threshold == 128
    assert parse_config(GROUP, env={}).long_prefill_token_threshold == 0
    with pytest.raises(SystemExit):
        parse_config(GROUP + ["--long-prefill-token-threshold", "-1"], env={})
