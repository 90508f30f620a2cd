"""Real local groups for integration tests: `lockstep rank` processes and a `lockstep coordinator` process.

The processes are the ones a pod runs, started with their real command lines, talking real gRPC
and real gloo collectives on 127.0.0.1. Like the operator's pods, the ranks and the coordinator share a
group token, passed by environment (`group_token=False` starts them without one).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from lockstep.local_group import free_port
from lockstep.local_ranks import rank_command


def http(method: str, url: str, body: dict | bytes | None = None, timeout: float = 120.0) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    text = raw.decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


class Cluster:
    """`groups` groups of `tp` ranks and one coordinator; `url` is the coordinator's HTTP root.

    `ranks` are group g0's processes; `group_ranks[i]` those of group g<i>.
    """

    def __init__(self, model_dir: Path, tp: int = 2, kv_pages: list[int] | int = 128, page_size: int = 16,
                 coordinator_args: list[str] | None = None, log_dir: Path | None = None,
                 prefix_caching: bool = True, groups: int = 1, group_token: bool = True,
                 coordinator_env: dict[str, str] | None = None, groups_file: Path | None = None) -> None:
        self.model_dir = model_dir
        self.groups_file = groups_file  # the coordinator reads its groups from here (and re-reads them)
        self.token = secrets.token_urlsafe(16) if group_token else None
        self.tp = tp
        self.log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        self.pages = [kv_pages] * tp if isinstance(kv_pages, int) else kv_pages
        self.page_size, self.prefix_caching = page_size, prefix_caching
        self.coordinator_args = coordinator_args or []
        self.coordinator_env = coordinator_env or {}
        self.group_ports = [[free_port() for _ in range(tp)] for _ in range(groups)]
        self.rank_ports = self.group_ports[0]
        self.group_ranks: list[list[subprocess.Popen]] = [[] for _ in range(groups)]
        self.http_port, self.grpc_port = free_port(), free_port()
        self.coordinator: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.http_port}"
        try:
            for g in range(groups):
                self.start_ranks(g)
            self.start_coordinator()
            self.wait_healthy()
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> list[subprocess.Popen]:
        return self.group_ranks[0]

    def start_coordinator(self) -> None:
        cmd = [sys.executable, "-m", "lockstep.cli", "coordinator"]
        if self.groups_file is not None:
            self.write_groups(range(len(self.group_ports)))
            cmd += ["--groups-file", str(self.groups_file)]
        else:
            for g in range(len(self.group_ports)):
                cmd += ["--group", self.group_entry(g)]
        cmd += ["--model", str(self.model_dir), "--host", "127.0.0.1", "--http-port", str(self.http_port),
                "--grpc-port", str(self.grpc_port), "--page-size", str(self.page_size), *self.coordinator_args]
        if not self.prefix_caching:
            cmd.append("--no-prefix-caching")
        self.coordinator = self._spawn(cmd, self._env() | self.coordinator_env, "coordinator")

    def group_entry(self, group: int) -> str:
        """`g<i>=host:port,...`: group `group` as --group and the groups file name it."""
        return f"g{group}=" + ",".join(f"127.0.0.1:{p}" for p in self.group_ports[group])

    def write_groups(self, groups: range | list[int]) -> None:
        """Replace the groups file as the kubelet updates a mounted ConfigMap: a new file renamed over it."""
        assert self.groups_file is not None, "the cluster was started without a groups file"
        tmp = self.groups_file.with_name(self.groups_file.name + ".new")
        tmp.write_text("".join(self.group_entry(g) + "\n" for g in groups))
        os.replace(tmp, self.groups_file)

    def start_ranks(self, group: int = 0) -> None:
        """(Re)start every rank of a group as a new group at the same addresses, as the operator does."""
        rendezvous = f"127.0.0.1:{free_port()}"
        env = self._env()
        procs = self.group_ranks[group] = []
        for r in range(self.tp):
            cmd = rank_command(r, self.tp, rendezvous, self.group_ports[group][r], self.model_dir, self.page_size,
                               self.pages[r], 1, self.prefix_caching)
            procs.append(self._spawn(cmd, env, f"g{group}-rank{r}"))

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("LOCKSTEP_GROUP_TOKEN", "LOCKSTEP_GROUP_TOKEN_FILE")}
        return env | {"OMP_NUM_THREADS": "1"} | ({"LOCKSTEP_GROUP_TOKEN": self.token} if self.token else {})

    def _spawn(self, cmd: list[str], env: dict, name: str) -> subprocess.Popen:
        path = self.log_dir / f"lockstep-{name}-{os.getpid()}-{time.monotonic_ns()}.log"
        f = open(path, "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        proc.log_path = path  # type: ignore[attr-defined]
        return proc

    def log(self, proc: subprocess.Popen) -> str:
        return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in [*self.all_ranks(), self.coordinator]:
                if p.poll() is not None:
                    raise RuntimeError(f"a process exited with {p.returncode}:\n{self.log(p)[-3000:]}")
            try:
                status, _ = http("GET", self.url + "/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError("the group did not become healthy:\n" + self.log(self.coordinator)[-3000:])

    def complete(self, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
        return http("POST", self.url + "/v1/completions", body, timeout)  # type: ignore[return-value]

    def metrics(self) -> str:
        status, text = http("GET", self.url + "/metrics")
        assert status == 200
        return text  # type: ignore[return-value]

    def metric(self, name: str, **labels: str) -> list[float]:
        """Values of every series of `name` whose labels include `labels`."""
        out = []
        for line in self.metrics().splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
            if not m:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                out.append(float(m.group(2)))
        return out

    def assert_no_leak(self, timeout: float = 30.0) -> None:
        """Once idle, every rank holds no used (so no pinned) page, and free + evictable = total."""
        deadline = time.monotonic() + timeout
        while True:
            used = self.metric("lockstep_rank_pages", state="used")
            running = sum(self.metric("lockstep_requests", state="running"))
            waiting = sum(self.metric("lockstep_requests", state="waiting"))
            if used and all(u == 0 for u in used) and running == 0 and waiting == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"pages still used after idle: used={used} running={running} waiting={waiting}")
            time.sleep(0.2)

    def assert_clean(self) -> None:
        """After a test's load: no page held, and no step was ever refused by a rank."""
        self.assert_no_leak()
        assert "refused by the ranks" not in self.log(self.coordinator)

    def assert_request_table_empty(self, timeout: float = 10.0) -> None:
        """Once idle, the coordinator keeps no record of any request (/health's `requests_in_flight` per
        group): a client that hung up is noticed at the server's next write, hence the wait."""
        deadline = time.monotonic() + timeout
        while True:
            _, health = http("GET", self.url + "/health")
            in_flight = {name: g["requests_in_flight"] for name, g in health.items()}  # type: ignore[union-attr]
            if not any(in_flight.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the coordinator still has records of requests: {in_flight}")
            time.sleep(0.2)

    def all_ranks(self) -> list[subprocess.Popen]:
        return [p for group in self.group_ranks for p in group]

    def close(self) -> None:
        procs = [p for p in [self.coordinator, *self.all_ranks()] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def tokens_of(group: Cluster, tokens: list[int], n: int, **extra) -> tuple[list[int], dict]:
    """A greedy completion of token ids that ignores EOS: its token ids and the whole body."""
    status, body = group.complete({"prompt": tokens, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                   "return_token_ids": True, **extra})
    assert status == 200, body
    return body["choices"][0]["token_ids"], body


def hf_greedy(model_dir: Path):
    """transformers' greedy continuation of a checkpoint, EOS not stopping it: the served tokens' reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def greedy(tokens: list[int], n: int) -> list[int]:
        # ignore_eos on our side; min_new_tokens would instead mask EOS out of transformers' argmax
        out = model.generate(torch.tensor([tokens]), max_new_tokens=n, eos_token_id=None, do_sample=False)
        return out[0, len(tokens):].tolist()

    return greedy
