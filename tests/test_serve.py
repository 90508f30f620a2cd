"""`lockstep serve`: the embedded launcher starts a group, serves it, and stops every process it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cluster import http
from lockstep.local_group import free_port
from lockstep.serve import default_tp


def _config(tmp_path: Path, **cfg) -> Path:
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64 * cfg["num_attention_heads"],
            "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
    return tmp_path


def test_default_tp_is_the_smallest_size_above_one_the_shapes_allow(tmp_path):
    builtin = dict(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152)
    assert default_tp(_config(tmp_path, **builtin)) == 3
    assert default_tp(_config(tmp_path, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                              vocab_size=384)) == 2
    assert default_tp(_config(tmp_path, num_attention_heads=7, num_key_value_heads=7, intermediate_size=128,
                              vocab_size=384)) == 1


def test_serve_runs_a_group_and_stops_all_of_it(tiny_llama, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep.cli", "serve", "--model", str(tiny_llama), "--port", str(port),
         "--kv-pages", "64", "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            if "Lockstep is serving" in (tmp_path / "serve.log").read_text():
                break
            time.sleep(0.3)
        text = (tmp_path / "serve.log").read_text()
        assert f"http://127.0.0.1:{port}/v1" in text and "starting 2 rank(s)" in text
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert len(ranks) == 2
        status, body = http("POST", f"http://127.0.0.1:{port}/v1/completions",
                            {"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        assert http("GET", f"http://127.0.0.1:{port}/health")[0] == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) in (0, 130)
        _, alive = psutil.wait_procs(ranks, timeout=15)
        assert not alive, "ranks outlived lockstep serve"
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def test_serve_stops_when_a_rank_dies(tiny_llama, tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep.cli", "serve", "--model", str(tiny_llama), "--port", str(port),
         "--kv-pages", "64", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and http_ok(port) is False:
            assert proc.poll() is None
            time.sleep(0.3)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        ranks[0].kill()
        assert proc.wait(timeout=30) != 0
        _, alive = psutil.wait_procs(ranks, timeout=15)
        assert not alive
    finally:
        if proc.poll() is None:
            proc.kill()


def http_ok(port: int) -> bool:
    try:
        return http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200
    except OSError:
        return False


@pytest.mark.slow
def test_builtin_model_served_says_paris(tmp_path):
    """The main job as a user runs it: `lockstep serve` with no --model, then the README's chat request."""
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while "Lockstep is serving" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(1)
        assert "starting 3 rank(s)" in (tmp_path / "serve.log").read_text()
        status, body = http("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                             "max_tokens": 24, "temperature": 0}, timeout=300)
        assert status == 200 and "Paris" in body["choices"][0]["message"]["content"], body
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
