"""`lockstep serve`: the embedded launcher starts a group, serves it, and stops every process it started."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch

from cluster import http
from lockstep.local_group import free_port
from lockstep.serve import default_tp


def _config(tmp_path: Path, **cfg) -> Path:
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64 * cfg["num_attention_heads"],
            "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
    return tmp_path


def test_default_tp_is_the_smallest_size_above_one_the_shapes_and_the_cores_allow(tmp_path):
    builtin = dict(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152)
    assert default_tp(_config(tmp_path, **builtin), slots=4) == 3  # two cores with shared-memory collectives
    assert default_tp(_config(tmp_path, **builtin), slots=2) == 1  # two cores over gloo, or two GPUs
    assert default_tp(_config(tmp_path, **builtin), slots=6, dp=2) == 3
    assert default_tp(_config(tmp_path, **builtin), slots=5, dp=2) == 1
    four = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=384)
    assert default_tp(_config(tmp_path, **four), slots=2) == 2
    assert default_tp(_config(tmp_path, **four), slots=1) == 1
    assert default_tp(_config(tmp_path, num_attention_heads=7, num_key_value_heads=7, intermediate_size=128,
                              vocab_size=384), slots=64) == 1


def test_a_tp_size_that_cannot_split_the_model_is_refused_before_any_rank_starts(tmp_path, capsys):
    """Found by fault injection: `lockstep serve --tp 2` of the built-in model (9 heads) started its ranks, each
    failed, the group was restarted five times (about 25 s) and serve exited without the reason."""
    from lockstep.serve import main

    model = _config(tmp_path, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                    vocab_size=49152)
    t0 = time.monotonic()
    assert main(["--model", str(model), "--tp", "2", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "tensor-parallel size 2 cannot split" in err and "TP sizes that work: 1, 3\n" in err
    assert time.monotonic() - t0 < 5 and "starting" not in err


def test_a_stopped_rank_process_is_continued_so_it_acts_on_its_sigterm_at_once():
    """Found by fault injection: restarting a group whose rank was SIGSTOPped waited out the whole SIGTERM grace
    (10 s), since a stopped process keeps its SIGTERM pending until it is continued."""
    from lockstep.local_ranks import stop_processes

    # as a rank does, it handles SIGTERM: a handled signal waits while the process is stopped
    handles = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(3)); "
               "print(1, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", handles], stdout=subprocess.PIPE)
    assert proc.stdout.readline()
    proc.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    stop_processes([proc], grace_s=5.0)
    assert time.monotonic() - t0 < 2.0 and proc.returncode == 3


def test_every_groups_ranks_are_stopped_at_once_so_a_stop_takes_one_grace_whatever_the_dp(tmp_path):
    """`lockstep serve --dp N` stopped its groups one after another, each with its own grace: ranks that did not act
    on their SIGTERM held its exit for N graces (two groups: 20.2 s), where the runbook says SIGKILL after 10 s."""
    from lockstep.local_ranks import LocalRanks, stop_groups

    def commands(group: int) -> list[list[str]]:
        ignores = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "open(sys.argv[1], 'w').close(); time.sleep(60)")
        return [[sys.executable, "-c", ignores, str(tmp_path / f"g{group}r{r}")] for r in range(2)]

    groups = [LocalRanks(lambda rendezvous, g=g: commands(g), os.environ, name=f"g{g}") for g in range(3)]
    try:
        for g in groups:
            g.start()
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 6:  # each ignores SIGTERM from now on
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        stop_groups(groups, grace_s=2.0)
        took = time.monotonic() - t0
    finally:
        for g in groups:
            for proc in g.procs:
                proc.kill()
                proc.wait()
    assert 2.0 <= took < 4.0, took  # one grace; one after another it is three
    assert all(proc.returncode == -signal.SIGKILL for g in groups for proc in g.procs)


def _free_port_pair() -> int:
    """A free port whose next one is free too: `lockstep serve --port P` serves gRPC on P + 1 (a CI run failed
    to bind it when only P had been checked)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row")


@contextlib.contextmanager
def _serving(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    """`lockstep serve ARGS` logging to tmp_path/serve.log; yields (process, port, log path), then stops it."""
    port = _free_port_pair()
    log_path = tmp_path / "serve.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    try:
        yield proc, port, log_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _wait_healthy(proc: subprocess.Popen, port: int, log_path: Path, within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while http_ok(port) is False:
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.3)


def test_serve_runs_a_group_and_stops_all_of_it(tiny_llama, tmp_path):
    with _serving(tmp_path, "--model", str(tiny_llama), "--kv-pages", "64", "--threads", "1") as (proc, port, log):
        deadline = time.monotonic() + 120
        while "Lockstep is serving" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        text = log.read_text()
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


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP])
def test_ranks_stop_when_lockstep_serve_is_gone_however_it_died(tiny_llama, tmp_path, how):
    """Found by a helper: `lockstep serve` killed (-9), or hung up on with its terminal (SIGHUP, which its ranks,
    in sessions of their own, never got), left its ranks running with the model loaded (1.4 GB each at TP 3, for
    ever). A rank started by serve now stops once the process that started it is gone."""
    with _serving(tmp_path, "--model", str(tiny_llama), "--kv-pages", "64", "--threads", "1") as (proc, port, log):
        _wait_healthy(proc, port, log)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert len(ranks) == 2
        proc.send_signal(how)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(ranks, timeout=20)
        for r in alive:
            r.kill()
        assert not alive, "ranks outlived lockstep serve"


def _sse_tokens(text: str) -> list[int]:
    ids = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                ids += choice.get("token_ids", [])
    return ids


def test_serve_brings_its_group_back_when_a_rank_dies_and_finishes_every_request(tiny_llama, tmp_path):
    """Each rank in turn is killed (-9) while a request runs, one of them streaming: `lockstep serve` stops
    the survivors, starts the whole group again, and every request ends with exactly the tokens of an
    undisturbed run; none is dropped."""
    # long enough that a quiet machine with shared-memory collectives is still generating when the rank dies
    body = {"prompt": list(range(5, 25)), "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with _serving(tmp_path, "--model", str(tiny_llama), "--kv-pages", "64", "--threads", "1") as (proc, port, log):
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, port, log)
        status, first = http("POST", url + "/v1/completions", body)
        assert status == 200, first
        undisturbed = first["choices"][0]["token_ids"]
        for victim, stream in ((0, False), (1, True)):
            ranks = psutil.Process(proc.pid).children(recursive=True)
            assert len(ranks) == 2
            with ThreadPoolExecutor(1) as pool:
                fut = pool.submit(http, "POST", url + "/v1/completions", {**body, "stream": stream}, 120)
                deadline = time.monotonic() + 60  # kill only while the request runs, never an idle group
                while 'lockstep_requests{group="g0",state="running"} 1.0' not in http("GET", url + "/metrics")[1]:
                    assert time.monotonic() < deadline and not fut.done(), "the request never ran"
                    time.sleep(0.02)
                ranks[victim].kill()
                status, got = fut.result(timeout=120)
            assert status == 200, got
            tokens = _sse_tokens(got) if stream else got["choices"][0]["token_ids"]
            assert tokens == undisturbed, (victim, stream)
        text = log.read_text()
        assert text.count("restarting the group") == 2, text
        status, metrics = http("GET", url + "/metrics")
        assert "lockstep_requests_dropped_total{group=\"g0\"} 0.0" in metrics
        assert proc.poll() is None


@pytest.mark.slow
def test_a_stopped_rank_is_named_then_declared_dead_and_its_group_recreated(tiny_llama, tmp_path):
    """SIGSTOP a rank under load: past the stall threshold the stall gauge reads 1 and the log names the
    rank as not responding; past the dead-rank timeout the group goes down, the survivor's collective times
    out, `lockstep serve` recreates the group, and the request ends with the undisturbed tokens."""
    body = {"prompt": list(range(7, 27)), "max_tokens": 160, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    args = ("--model", str(tiny_llama), "--kv-pages", "64", "--threads", "1", "--stall-threshold", "1",
            "--dead-rank-timeout", "4")  # before the survivor's collective times out, as by default (30 s, 60 s)
    with _serving(tmp_path, *args, env={"LOCKSTEP_COLLECTIVE_TIMEOUT_SECONDS": "6"}) as (proc, port, log):
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, port, log)
        undisturbed = http("POST", url + "/v1/completions", body)[1]["choices"][0]["token_ids"]
        ranks = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(http, "POST", url + "/v1/completions", body, 180)
            time.sleep(0.4)
            ranks[1].suspend()
            stalled = 0.0
            while time.monotonic() - t0 < 5 and not stalled:
                metrics = http("GET", url + "/metrics")[1]
                stalled = float(re.search(r'lockstep_agreements_stalled\{group="g0"\} (\S+)', metrics).group(1))
                time.sleep(0.2)
            assert stalled == 1.0
            status, got = fut.result(timeout=180)
        assert status == 200 and got["choices"][0]["token_ids"] == undisturbed
        text = log.read_text()
        assert "not responding at all: [1]" in text and "restarting the group" in text, text
        assert "rank(s) [1] of group g0 silent" in text, text  # the stopped one alone, not its live peer
        print(f"recovered in {time.monotonic() - t0:.1f} s")


def http_ok(port: int) -> bool:
    try:
        return http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200
    except OSError:
        return False


@pytest.mark.slow
def test_builtin_model_served_says_paris(tmp_path):
    """The main job as a user runs it: `lockstep serve` with no --model, then the README's chat request."""
    with _serving(tmp_path) as (proc, port, log):
        deadline = time.monotonic() + 900
        while "Lockstep is serving" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(1)
        from lockstep.device import rank_capacity

        assert f"starting {3 if rank_capacity() >= 3 else 1} rank(s)" in log.read_text()
        status, body = http("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                             "max_tokens": 24, "temperature": 0}, timeout=300)
        assert status == 200 and "Paris" in body["choices"][0]["message"]["content"], body


def test_rank_kv_pages_takes_a_group_prefix(capsys):
    """A bare `RANK=PAGES` keeps its one-group meaning (group 0); `G:RANK=PAGES` names another group."""
    from lockstep.serve import parse_args

    args = parse_args(["--dp", "2", "--rank-kv-pages", "1=32", "--rank-kv-pages", "g1:0=16"], env={})
    assert args.dp == 2 and args.rank_pages == {(0, 1): 32, (1, 0): 16}
    assert parse_args([], env={"LOCKSTEP_DP": "3"}).dp == 3
    with pytest.raises(SystemExit):
        parse_args(["--rank-kv-pages", "1:0=16"], env={})
    assert "names group 1, but --dp is 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--dp", "0"], env={})
    assert "--dp must be >= 1" in capsys.readouterr().err


def _routed(metrics: str, group: str) -> float:
    return sum(float(n) for n in re.findall(rf'lockstep_routing_decisions_total\{{group="{group}",[^}}]*\}} (\S+)',
                                            metrics))


def _running(url: str, group: str) -> bool:
    metrics = http("GET", url + "/metrics")[1]
    return bool(re.search(rf'lockstep_requests\{{group="{group}",state="running"\}} [1-9]', metrics))


def _groups_up(port: int) -> dict[str, bool]:
    try:
        return {name: g["up"] for name, g in http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[1].items()}
    except (OSError, AttributeError, TypeError, KeyError):
        return {}


def _wait_both_up(proc: subprocess.Popen, port: int, log: Path, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while _groups_up(port) != {"g0": True, "g1": True}:
        assert proc.poll() is None and time.monotonic() < deadline, (_groups_up(port), log.read_text())
        time.sleep(0.3)


def test_serve_dp_runs_two_groups_and_recreates_only_the_one_whose_rank_died(tiny_llama, tmp_path):
    """`--dp 2 --tp 1`: both groups take requests; g1's rank is killed (-9) while requests run on both:
    only g1 is restarted, g0's rank lives on, every request ends with the undisturbed tokens, and g1
    comes back up."""
    body = {"prompt": list(range(5, 25)), "max_tokens": 160, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    args = ("--model", str(tiny_llama), "--dp", "2", "--tp", "1", "--kv-pages", "64", "--threads", "1",
            "--routing", "least-loaded")  # both groups must get a request: prefix routing would pick one
    with _serving(tmp_path, *args) as (proc, port, log_path):
        url = f"http://127.0.0.1:{port}"
        _wait_both_up(proc, port, log_path, 120)
        undisturbed = http("POST", url + "/v1/completions", body)[1]["choices"][0]["token_ids"]
        g1_port = re.search(r"g1: rank ports (\d+)", log_path.read_text()).group(1)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert len(ranks) == 2
        g1 = next(r for r in ranks if r.cmdline()[r.cmdline().index("--port") + 1] == g1_port)
        g0 = next(r for r in ranks if r is not g1)
        routed = [_routed(http("GET", url + "/metrics")[1], g) for g in ("g0", "g1")]
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(http, "POST", url + "/v1/completions", {**body, "stream": s}, 120)
                    for s in (False, True)]
            deadline = time.monotonic() + 20  # both running (a fast machine finishes 160 tokens in < 1 s)
            while time.monotonic() < deadline and not all(_running(url, g) for g in ("g0", "g1")):
                time.sleep(0.01)
            metrics = http("GET", url + "/metrics")[1]
            assert [_routed(metrics, g) - n for g, n in zip(("g0", "g1"), routed, strict=True)] == [1, 1], metrics
            g1.kill()
            results = [f.result(timeout=120) for f in futs]
        assert [r[0] for r in results] == [200, 200], results
        assert results[0][1]["choices"][0]["token_ids"] == undisturbed
        assert _sse_tokens(results[1][1]) == undisturbed
        assert g0.is_running() and g0 in psutil.Process(proc.pid).children(recursive=True)
        deadline = time.monotonic() + 60
        while "restarting the group" not in log_path.read_text():  # the supervisor saw g1's rank exit
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        _wait_both_up(proc, port, log_path, 60)
        text = log_path.read_text()
        assert text.count("restarting the group") == 1 and "g1: rank 0 exited" in text, text
        metrics = http("GET", url + "/metrics")[1]
        assert 'lockstep_requests_dropped_total{group="g1"} 0.0' in metrics


def test_a_group_that_dies_before_it_serves_is_given_up_but_one_that_served_is_always_restarted():
    """A crash loop (ranks that die before the coordinator ever served their group) ends after a few
    tries; a group that served and then lost a rank (a kill, a lost node) is started again every time."""
    import asyncio

    from lockstep.local_ranks import LocalRanks

    dies = [sys.executable, "-c", "import time, sys; time.sleep(0.2); sys.exit(3)"]
    said: list[str] = []
    looping = LocalRanks(lambda rendezvous: [dies], os.environ, max_quick_failures=3, pause_s=0.01)
    looping.start()
    asyncio.run(asyncio.wait_for(looping.supervise(said.append), 30))
    assert looping.restarts == 2 and "giving up" in said[-1]

    async def served_every_time() -> None:
        ranks = LocalRanks(lambda rendezvous: [dies], os.environ, max_quick_failures=3, pause_s=0.01)
        ranks.start()
        task = asyncio.ensure_future(ranks.supervise(said.append))
        while ranks.restarts < 5:
            ranks.mark_whole()  # the coordinator serves it after every start
            await asyncio.sleep(0.05)
        assert not task.done()
        task.cancel()
        ranks.stop()

    asyncio.run(served_every_time())


def test_rank_capacity_counts_two_ranks_a_core_only_with_shared_memory_collectives(monkeypatch):
    import platform

    from lockstep.device import rank_capacity

    monkeypatch.setenv("LOCKSTEP_DEVICE", "cpu")
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCKSTEP_COMM", "gloo")
    assert rank_capacity() == cores
    monkeypatch.setenv("LOCKSTEP_COMM", "auto")
    assert rank_capacity() == (2 * cores if platform.machine() in ("x86_64", "AMD64") else cores)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")  # no shared-memory transport there
    assert rank_capacity() == cores


@pytest.mark.parametrize(("damage", "words"), [
    ("truncate", ".safetensors cannot be read as safetensors"),
    ("config", "config.json is not valid JSON"),
    ("quantized", "quantization_config.quant_method='fp8'"),
    ("positions", "max_position_embeddings must be at least 2, got 1"),
    ("rope", "rope_theta must be positive and finite, got 0.0"),
    ("tokenizer", "has no tokenizer.json"),
])
def test_a_checkpoint_that_cannot_be_served_is_refused_in_one_line_before_any_rank_starts(
        tiny_llama, tmp_path, capsys, damage, words):
    """Found by a fault-finding helper: a truncated safetensors file failed each rank as it loaded, the group was
    restarted five times, and the error named no file; a bad config.json printed a traceback; a quantized
    checkpoint loaded its codes as weights and served garbage; max_position_embeddings 1 left serve retrying for
    ever. Each is now one line naming the file or field, and exit status 2."""
    import shutil

    from lockstep.serve import main

    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    if damage == "truncate":
        shard = sorted(model.glob("*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "config":
        (model / "config.json").write_text("{not json")
    elif damage == "quantized":
        (model / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    elif damage == "positions":
        (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1}))
    elif damage == "rope":  # served, every logit was NaN: token 0 every time, with HTTP 200
        rope = {"rope_parameters": {**config["rope_parameters"], "rope_theta": 0}} if "rope_parameters" in config \
            else {"rope_theta": 0}
        (model / "config.json").write_text(json.dumps({**config, **rope}))
    else:
        (model / "tokenizer.json").unlink()
    assert main(["--model", str(model), "--tp", "1", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and "starting" not in err, err


def test_a_gguf_file_given_as_the_model_is_refused_saying_why(tmp_path, capsys):
    """GGUF is imported for the built-ins only: a user who passes one is told so, not only that config.json is
    missing."""
    from lockstep.serve import main

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert main(["--model", str(tmp_path / "m.gguf"), "--tp", "1", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "not a checkpoint directory (no config.json) (a GGUF file is served only as a built-in's source" in err


def test_a_rank_that_cannot_serve_its_checkpoint_is_not_started_again(tiny_llama, tmp_path):
    """A tensor the loader refuses (an int8 weight here) is found only as a rank loads: the rank exits with
    EXIT_UNSERVABLE, and its group gives up at once instead of loading the checkpoint five more times."""
    import asyncio
    import shutil

    from safetensors.torch import load_file, save_file

    from lockstep.local_ranks import LocalRanks, rank_command

    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    for shard in model.glob("*.safetensors"):
        tensors = load_file(shard)
        name = next((n for n in tensors if n.endswith("q_proj.weight")), None)
        if name is not None:
            tensors[name] = tensors[name].to(torch.int8)
            save_file(tensors, shard, metadata={"format": "pt"})
            break
    said: list[str] = []
    ranks = LocalRanks(lambda rendezvous: [rank_command(0, 1, rendezvous, free_port(), model, 16, 32, 1, True,
                                                        "float32")], dict(os.environ), name="g0")
    ranks.start()
    try:
        asyncio.run(asyncio.wait_for(ranks.supervise(said.append), 120))
    finally:
        ranks.stop()
    assert ranks.restarts == 0 and len(said) == 1 and "cannot serve the checkpoint" in said[0], said


@pytest.mark.parametrize("held", [0, 1])
def test_a_port_in_use_is_refused_in_one_line_before_any_rank_starts(tiny_llama, capsys, held):
    """Found by a docs walkthrough: `lockstep serve --port P` with P (or P+1, gRPC's) held by another server
    started the ranks, loaded the model, then failed with aiohttp's traceback; grpc would even have shared a
    held gRPC port (SO_REUSEPORT). Now one line, exit status 1, and no rank started."""
    from lockstep.serve import main

    port = _free_port_pair()
    with socket.create_server(("127.0.0.1", port + held)):
        assert main(["--model", str(tiny_llama), "--tp", "1", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port + held}: Address already in use" in err, err
    assert "Traceback" not in err and "starting" not in err, err


def test_a_coordinator_whose_http_port_is_taken_says_so_in_one_line_and_exits_1(tiny_llama, tmp_path):
    """The same for `lockstep coordinator`, whose ports are bound after it starts connecting to its ranks: one
    line naming the address, exit status 1, no traceback, with or without API frontends."""
    for frontends in ([], ["--api-workers", "1"]):
        http_port, grpc_port = _free_port_pair(), free_port()
        with socket.create_server(("127.0.0.1", http_port)):
            out = subprocess.run(
                [sys.executable, "-m", "lockstep.cli", "coordinator", "--group", f"g0=127.0.0.1:{free_port()}",
                 "--model", str(tiny_llama), "--host", "127.0.0.1", "--http-port", str(http_port),
                 "--grpc-port", str(grpc_port), *frontends], capture_output=True, text=True, timeout=60)
        said = out.stdout + out.stderr
        assert out.returncode == 1, said
        assert "cannot serve: " in said and str(http_port) in said and "address already in use" in said.lower(), said
        assert "Traceback" not in said, said


def test_a_port_held_on_any_address_of_the_host_is_refused(monkeypatch):
    """`--host localhost` where /etc/hosts names ::1 and 127.0.0.1 (Debian, Fedora: ::1 first): only the first
    address was tried, while the HTTP server binds both; a server on 127.0.0.1:P went unseen until the ranks had
    loaded the model. A family the machine lacks (EADDRNOTAVAIL) is no refusal while another address binds."""
    from lockstep.serve import taken_port

    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            pass
    except OSError:
        pytest.skip("no IPv6 loopback here")
    real = socket.getaddrinfo
    both = lambda host, port, *args, **kwargs: [*real("::1", port, *args, **kwargs),
                                                 *real("127.0.0.1", port, *args, **kwargs)]
    lacking_v6 = lambda host, port, *args, **kwargs: [*real("2001:db8::1", port, *args, **kwargs),  # not ours
                                                       *real("127.0.0.1", port, *args, **kwargs)]
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        monkeypatch.setattr(socket, "getaddrinfo", both)
        assert f"cannot listen on localhost:{port}: Address already in use" in taken_port("localhost", [port])
        monkeypatch.setattr(socket, "getaddrinfo", lacking_v6)
        assert f"cannot listen on localhost:{port}: Address already in use" in taken_port("localhost", [port])
    monkeypatch.setattr(socket, "getaddrinfo", both)
    assert taken_port("localhost", [port]) is None
    monkeypatch.setattr(socket, "getaddrinfo", lacking_v6)
    assert taken_port("localhost", [port]) is None
