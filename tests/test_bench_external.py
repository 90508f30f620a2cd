"""`lockstep bench --url`: one client measures Lockstep and another OpenAI-compatible server (here transformers
behind a small HTTP server) with the same streamed workload in one run; on the same weights, greedy, both
answer every request with the same text."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lockstep.bench.external import Target, format_runs, run_external

PROMPTS = ["The quick brown fox", "Every rank holds its own shard", "A page holds the keys", "How vexingly quick",
           "Pack my box with", "The coordinator decides, once,"]
MAX_TOKENS = 8


@pytest.fixture
def hf_server(tiny_llama, tmp_path):
    from cluster import http
    from lockstep.local_group import free_port

    port = free_port()
    log = open(tmp_path / "hf.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "hf_openai_server.py"), str(tiny_llama),
                             str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "hf.log").read_text()
            try:
                if http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_one_client_measures_lockstep_and_another_server_in_one_run(tiny_llama, tmp_path, hf_server):
    from cluster import Cluster

    c = Cluster(tiny_llama, tp=1, kv_pages=64, log_dir=tmp_path, coordinator_args=["--api-key", "k1"])
    try:
        runs = [run_external(Target(c.url + "/v1", api_key="k1"), PROMPTS, MAX_TOKENS, concurrency=3),
                run_external(Target(hf_server), PROMPTS, MAX_TOKENS, concurrency=3)]
        c.assert_no_leak()
    finally:
        c.close()
    table = format_runs(runs)
    print(table)
    for run in runs:
        assert not run.errors, run.errors
        assert len(run.latency_s) == len(PROMPTS) and run.output_tokens == [MAX_TOKENS] * len(PROMPTS)
        assert all(0 < t <= lat for t, lat in zip(run.ttft_s, run.latency_s, strict=True))
        assert run.summary()["output_tok_s"] > 0
    assert runs[0].texts == runs[1].texts  # the same greedy answers from both engines
    assert c.url in table and hf_server in table


def test_the_command_and_its_errors(tiny_llama, tmp_path, capsys):
    """`lockstep bench --url`: a table per server; a wrong key is an error per request, a bad URL a usage error."""
    from cluster import Cluster
    from lockstep.bench.command import main

    common = ["--model", str(tiny_llama), "--requests", "4", "--concurrency", "2", "--max-tokens", "4",
              "--min-prompt", "4", "--max-prompt", "12", "--warmup", "1"]
    assert main([*common, "--url", "ftp://x/v1"]) == 2
    assert "is not an http(s) URL" in capsys.readouterr().err
    c = Cluster(tiny_llama, tp=1, kv_pages=64, log_dir=tmp_path, coordinator_args=["--api-key", "k1"])
    try:
        run = run_external(Target(c.url + "/v1", api_key="wrong"), PROMPTS[:2], MAX_TOKENS, 1, warmup=0)
        capsys.readouterr()
        assert main([*common, "--url", c.url + "/v1"]) == 1  # no key: its warmup request fails, said in one line
        err = capsys.readouterr().err
        assert "lockstep bench: HTTP 401" in err and "Traceback" not in err, err
        assert main([*common, "--url", c.url + "/v1", "--api-key", "k1", "--json", str(tmp_path / "o.json")]) == 0
        c.assert_no_leak()
    finally:
        c.close()
    assert len(run.errors) == 2 and all("HTTP 401" in e for e in run.errors)
    assert "output tok/s" in capsys.readouterr().out
    import json

    (summary,) = json.loads((tmp_path / "o.json").read_text())["runs"]
    assert summary["requests"] == 4 and summary["errors"] == 0


def test_each_request_carries_the_workloads_temperature_and_its_own_seed():
    """`--temperature` reaches the measured server: request i with the workload's temperature and seed i (it
    used to send temperature 0 whatever was asked)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from lockstep.bench.workload import Workload, sampling_of

    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            chunk = json.dumps({"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}})
            payload = f"data: {chunk}\n\ndata: [DONE]\n\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        workload = Workload(((3,),) * len(PROMPTS), MAX_TOKENS, 2, temperature=0.7)
        run = run_external(Target(f"http://127.0.0.1:{server.server_port}/v1"), PROMPTS, MAX_TOKENS, 2, warmup=0,
                           sampling=lambda i: sampling_of(workload, i))
    finally:
        server.shutdown()
    assert not run.errors and len(bodies) == len(PROMPTS)
    for body in bodies:
        assert body["temperature"] == 0.7 and body["seed"] == PROMPTS.index(body["prompt"]), body


def test_flags_that_only_set_up_the_runs_bench_starts_are_refused_with_url(capsys):
    """With --url the server runs as it was started: --tp, --dtype or --kv-pages there would silently do nothing,
    so they are a usage error naming them; the client's own flags are taken."""
    from lockstep.bench.command import parse_args

    url = ["--model", "m", "--url", "http://127.0.0.1:8000/v1"]
    for extra, named in ((["--tp", "4"], "--tp"), (["--dtype", "float32"], "--dtype"),
                         (["--kv-pages", "9", "--api-workers", "2"], "--kv-pages, --api-workers")):
        with pytest.raises(SystemExit) as exit_:
            parse_args([*url, *extra])
        assert exit_.value.code == 2 and f"{named}: " in capsys.readouterr().err
    args = parse_args([*url, "--requests", "5", "--concurrency", "2", "--temperature", "0.5"])
    assert args.requests == 5 and args.url == ["http://127.0.0.1:8000/v1"]
    assert parse_args(["--model", "m", "--tp", "4"]).tp == 4  # without --url: the runs it starts
