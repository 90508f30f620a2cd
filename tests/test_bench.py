"""`lockstep bench` end to end: a served TP 2 group and the in-process limit on one tiny workload."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from lockstep import local_group
from lockstep.bench.command import main
from lockstep.bench.report import percentile
from lockstep.bench.workload import make_workload, poisson_arrivals
from lockstep.model.config import ModelConfig
from lockstep.model.kv_cache import KVCache

REQUESTS, TOKENS = 6, 32


def test_bench_end_to_end_on_tiny_model(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["--tiny", "--requests", str(REQUESTS), "--concurrency", "3", "--max-tokens", str(TOKENS),
               "--min-prompt", "5", "--max-prompt", "60", "--warmup", "1", "--temperature", "0.8", "--json", str(out)])
    table = capsys.readouterr().out
    assert rc == 0, table
    report = json.loads(out.read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {"served", "in-process"}
    for name, run in runs.items():
        assert run["completed"] == REQUESTS and not run["errors"], (name, run["errors"])
        assert run["output_tokens"] == REQUESTS * TOKENS, name
        assert run["throughput_tok_s"] > 0 and run["wall_s"] > 0, name
        assert run["steps"] >= TOKENS, name  # a request gets at most one token per step
        for key in ("step", "engine", "coordinator", "latency"):
            assert 0 < run[key]["p50_ms"] <= run[key]["p99_ms"], (name, key, run[key])
        assert run["coordinator"]["p50_ms"] < run["step"]["p50_ms"], name
        assert run["coordinator_full_batch"]["steps"] > 0, name
    served = runs["served"]
    assert 0 < served["planned_ahead"] <= 1 and runs["in-process"]["planned_ahead"] is None
    assert {"plan", "send", "wait", "apply"} <= served["parts"].keys()
    assert served["parts"]["wait"]["p50_ms"] > 0
    comparison = report["comparison"]
    assert comparison["throughput_ratio"] > 0
    # seeded sampling (request i with seed i): served and in-process draw the same tokens, token for token
    assert comparison["identical_outputs"] == REQUESTS
    assert "served / in-process throughput" in table and "coordinator time / step p50" in table
    assert "steps planned ahead (%)" in table


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_dtype_reaches_every_rank_of_both_runs(how, tmp_path, capfd, monkeypatch):
    """The served ranks were started with `--dtype auto` whatever the bench was told (float32 on the CPU)."""
    flags = ["--dtype", "bfloat16"] if how == "flag" else []
    if how == "env":
        monkeypatch.setenv("LOCKSTEP_DTYPE", "bfloat16")
    in_process: list[bool] = []

    class Recording(local_group.LocalGroup):  # the in-process ranks' KV page bytes tell the dtype they loaded
        def __init__(self, model_dir: str, world_size: int, **kw) -> None:
            super().__init__(model_dir, world_size, **kw)
            config = ModelConfig.from_dir(model_dir)
            in_process.extend(dict(info.page_bytes) == {
                pool: KVCache.bytes_per_page(config, world_size, kw["page_size"], torch.bfloat16, pool)
                for pool in config.pool_names} for info in self.infos)

    monkeypatch.setattr(local_group, "LocalGroup", Recording)
    rc = main(["--tiny", "--requests", "2", "--concurrency", "2", "--max-tokens", "4", "--max-prompt", "20",
               "--warmup", "0", "--log-dir", str(tmp_path / "logs"), *flags])
    assert rc == 0, capfd.readouterr().out
    for rank in range(2):
        assert f"rank {rank}: bfloat16 on cpu" in (tmp_path / "logs" / f"rank{rank}.log").read_text()
    assert in_process == [True, True]


def test_the_tp_size_is_serves_by_default_and_one_the_model_cannot_split_is_one_line(tiny_llama, capsys):
    """Found by a helper following the README: `lockstep bench --model builtin` failed with a traceback, its
    --tp defaulting to 2, which the built-in model cannot split (1 or 3). The default is now the size `lockstep
    serve` chooses, and a size the model cannot split is refused in one line before anything starts."""
    from lockstep.bench.command import _tp
    from lockstep.device import rank_capacity
    from lockstep.serve import default_tp

    assert _tp(tiny_llama, 0) == default_tp(tiny_llama, rank_capacity())
    assert _tp(tiny_llama, 1) == 1
    assert main(["--model", str(tiny_llama), "--tp", "3", "--requests", "1"]) == 2
    err = capsys.readouterr().err
    assert "tensor-parallel size 3 cannot split" in err and "TP sizes that work" in err and "Traceback" not in err
    # found by a review: the in-process run finished before the served run's coordinator refused this
    assert main(["--model", str(tiny_llama), "--tp", "1", "--requests", "1", "--max-num-seqs", "600"]) == 2
    assert "--max-num-batched-tokens (512) must be at least --max-num-seqs (600)" in capsys.readouterr().err


def test_bad_model_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--tiny", "--min-prompt", "50", "--max-prompt", "10"])
    assert exc.value.code == 2
    assert "larger than --max-prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--tiny", "--requests", "0"])
    assert "positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--requests", "4"])  # neither --model nor --tiny
    for bad in ("3", "-1", "nan"):
        with pytest.raises(SystemExit):
            main(["--tiny", "--temperature", bad])
        assert "temperature must be in [0, 2]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--tiny", "--dtype", "float64"])
    assert "--dtype" in capsys.readouterr().err
    for bad in ("0", "-2", "nan", "fast"):
        with pytest.raises(SystemExit):
            main(["--tiny", "--request-rate", bad])
        assert "request rate must be a number > 0" in capsys.readouterr().err


def test_workload_is_deterministic_and_in_range():
    a = make_workload(20, 7, 40, 32, 4, vocab=100, seed=3)
    assert a == make_workload(20, 7, 40, 32, 4, vocab=100, seed=3)
    assert a != make_workload(20, 7, 40, 32, 4, vocab=100, seed=4)
    lengths = [len(p) for p in a.prompts]
    assert all(7 <= n <= 40 for n in lengths) and len(set(lengths)) > 1
    assert all(3 <= t < 100 for p in a.prompts for t in p)


def test_arrivals_are_a_seeded_poisson_process():
    """--request-rate as vLLM's benchmark_serving has it: exponential gaps at the rate, the same for a seed."""
    times = poisson_arrivals(4000, 20.0, seed=1)
    assert times == poisson_arrivals(4000, 20.0, seed=1) != poisson_arrivals(4000, 20.0, seed=2)
    gaps = [b - a for a, b in zip((0.0, *times), times, strict=False)]
    assert all(g > 0 for g in gaps) and abs(sum(gaps) / len(gaps) - 1 / 20.0) < 0.005
    assert sum(g > 1 / 20.0 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.03)  # P(gap > mean)
    assert poisson_arrivals(5, math.inf) == () and make_workload(3, 1, 2, 1, 1, vocab=9).arrivals == ()
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="request rate"):
            poisson_arrivals(3, bad)


def test_a_request_rate_holds_each_request_back_until_it_arrives(tmp_path):
    """4 requests at 1/s arrive over 7.5 s; unheld, both runs take well under a second on the tiny model."""
    out = tmp_path / "bench.json"
    rc = main(["--tiny", "--tp", "1", "--requests", "4", "--concurrency", "4", "--max-tokens", "4", "--max-prompt",
               "20", "--warmup", "0", "--request-rate", "1", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    last = poisson_arrivals(4, 1.0, 0)[-1]
    assert report["workload"]["request_rate"] == 1.0
    for run in report["runs"]:
        assert run["completed"] == 4 and last <= run["wall_s"] < last + 30, run


def test_percentile_interpolates():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0], 100) == 3.0
    assert percentile([1.0] * 99 + [100.0], 99) == pytest.approx(1.99)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_control_plane_mode_is_reached_through_lockstep_bench(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--control-plane", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "lockstep bench --control-plane" in out and "--agreement" in out and "NoopForwardEngine" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--control-plane" in capsys.readouterr().out


@pytest.mark.slow
def test_the_prepared_gpu_check_runs_through_on_the_cpu(tiny_llama, tmp_path):
    """scripts/gpu_check.sh is what a session lent a GPU runs, in one call, with no network: it must not
    have rotted by then. Here every step of its quick mode runs on the CPU and writes its results."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), "run", "--quick"], cwd=root,
                          env={**os.environ, "OUT": str(tmp_path), "GPU_CHECK_LIKE": str(tiny_llama)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    engine = json.loads((tmp_path / "engine_float32.json").read_text())
    assert engine["results"][0]["batch"] == 1 and engine["results"][0]["greedy_same"] == 1
    assert json.loads((tmp_path / "bench.json").read_text())
    assert '"completion_tokens": 16' in (tmp_path / "serve.log").read_text()
    assert "one call costs" in (tmp_path / "decode_groups.log").read_text()
    assert "rank host work per decode step" in (tmp_path / "rank_host.log").read_text()
    assert "coordinator host work per decode step" in (tmp_path / "coordinator_host.log").read_text()


@pytest.mark.parametrize("api_workers", [0, 2])
def test_the_streaming_benchmark_streams_every_token(tiny_llama, api_workers):
    """scripts/bench_stream_frontend.py: every stream gets its tokens through the real HTTP app (in the coordinator,
    or through real API frontends), and the number it reports is per token actually sent."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_stream_frontend.py"
    proc = subprocess.run([sys.executable, str(script), "--batch", "5", "--tokens", "7", "--model", str(tiny_llama),
                           "--api-workers", str(api_workers)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = "2 API frontend process(es)" if api_workers else "HTTP in the coordinator"
    assert f"batch 5, 7 tokens each, {where}: 35 tokens sent, 35 received in" in proc.stdout, proc.stdout
    assert "us per token" in proc.stdout and ("frontends' CPU" in proc.stdout) == bool(api_workers)


@pytest.mark.parametrize(("name", "parts", "positive"), [("bench_rank_host.py", 8, 4),
                                                          ("bench_coordinator_host.py", 4, 4)])
def test_a_host_work_benchmark_times_every_part_of_a_decode_step(name, parts, positive):
    """scripts/bench_rank_host.py: the serving engine's step with a no-op forward, part by part; the cache it
    leaves is consistent (the script checks it). scripts/bench_coordinator_host.py: the real scheduler planning
    ahead against a no-op rank; it fails unless every measured step was planned ahead and every request got a
    token in each. In both the parts add up to the step."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / name
    proc = subprocess.run([sys.executable, str(script), "--batch", "3,9", "--steps", "5", "--warmup", "2",
                           "--min-prompt", "5", "--max-prompt", "40", "--page-size", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split() and line.split()[0] in ("3", "9")]
    assert [r[0] for r in rows] == ["3", "9"]
    for row in rows:
        times, step = [float(x) for x in row[1:-1]], float(row[-1])
        assert len(times) == parts and all(x > 0 for x in times[:positive]) and sum(times) <= step * 1.5


def test_the_decode_groups_benchmark_fits_a_call_cost_and_groups_fewer_as_calls_cost_more():
    """scripts/bench_decode_groups.py: the fit's line has a positive cost per gathered slot, and the sweep's
    batch is cut into fewer groups (never more) as one call is counted dearer."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode_groups.py"
    proc = subprocess.run([sys.executable, str(script), "--batch", "24", "--repeat", "2", "--layers", "1",
                           "--threads", "1", "--fit-rows", "2", "8", "--fit-pages", "1", "6",
                           "--call-tokens", "16", "256", "100000", "--min-len", "3", "--max-len", "300"],
                          env={**os.environ, "LOCKSTEP_DEVICE": "cpu"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("one call,") == 4
    slot_ns = float(proc.stdout.split(" ns a gathered slot")[0].rsplit("+ ", 1)[1])
    assert slot_ns > 0
    sweep = [line.split() for line in proc.stdout.splitlines()
             if line.split()[:1] in (["16"], ["256"], ["100000"]) and len(line.split()) == 3]
    groups = [int(row[1]) for row in sweep]
    assert len(groups) == 3 and groups == sorted(groups, reverse=True) and groups[-1] == 1 < groups[0]
    assert all(float(row[2]) > 0 for row in sweep)
    assert "fastest: call tokens " in proc.stdout
