"""The coordinator's CPU per streamed token: the real OpenAI HTTP app, SSE to real clients in another process.

    python scripts/bench_stream_frontend.py --batch 256 --tokens 64
    python scripts/bench_stream_frontend.py --batch 256 --tokens 64 --api-workers 2

The control-plane benchmark (`lockstep bench --control-plane`) stops at the step loop's dispatch: its
streams are drained in process. Here the rest of a streamed token's way out of the coordinator is measured:
the request's events, incremental detokenization and stop strings (`text_stream`), the SSE chunk's JSON and
the socket write, for `--batch` streaming /v1/completions requests at once. A stand-in for the step loop
hands every live request one token per tick, as `CoordinatorService._dispatch` does after each step, so the
server process does nothing else; its CPU time over the steady part, per token and per step of `--batch`
tokens, is the cost that sits on the coordinator's event loop beside plan, apply and dispatch.

With `--api-workers N` the HTTP app runs in N real frontend processes (coordinator/remote.py) behind the real
frontend link (coordinator/frontend_link.py), as `lockstep serve --api-workers N` runs it; the stand-in is then
the coordinator the link submits to, and the coordinator's CPU per token is what the link leaves on its loop.
The frontends' CPU is reported beside it. A benchmark only: nothing in `lockstep serve` reaches the stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncGenerator

import aiohttp
import psutil

from lockstep.coordinator.api_workers import reserve
from lockstep.coordinator.frontend_link import start_link
from lockstep.coordinator.generation import GenerateSpec, TokenEvent
from lockstep.coordinator.openai_api import OpenAIServer, run_app
from lockstep.coordinator.outbox import Outbox
from lockstep.coordinator.request import FinishReason
from lockstep.local_group import free_port
from lockstep.tokenizer import Tokenizer

TICK_S = 0.002  # the stand-in step: short, so the clients' reads, not the ticks, pace the run
FIRST_ID = 1000  # ordinary word pieces of the built-in tokenizer


class TickingFrontend:
    """Every live request gets one token per tick until it has `tokens`; nothing is scheduled or run."""

    model_name = "bench"
    max_model_len = 1 << 16
    max_logprobs = 20

    def __init__(self, tokenizer: Tokenizer, tokens: int) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.live: dict[str, list] = {}

    def submit(self, request_id: str, spec: GenerateSpec, queue) -> None:
        """As `Coordinator.submit`: the frontend link's way in."""
        self.live[request_id] = [queue, 0]

    def _end(self, request_id: str, finished: bool) -> None:
        self.live.pop(request_id, None)

    def generate(self, request_id: str, spec: GenerateSpec) -> AsyncGenerator[TokenEvent, None]:
        box: Outbox[TokenEvent] = Outbox()
        self.submit(request_id, spec, box)

        async def events() -> AsyncGenerator[TokenEvent, None]:
            while True:
                ev = await box.get()
                yield ev
                if ev.finish_reason is not None:
                    return

        return events()

    def tick(self) -> int:
        for rid, state in list(self.live.items()):
            state[1] += 1
            done = state[1] >= self.tokens
            state[0].put(TokenEvent(FIRST_ID + state[1] % 500, FinishReason.LENGTH if done else None))
            if done:
                del self.live[rid]
        return len(self.live)

    def healthy(self) -> bool:
        return True

    def health_detail(self) -> dict:
        return {}

    def metrics_text(self) -> bytes:
        return b""

    async def reset_prefix_cache(self, rank: int | None) -> None:
        return None

    def step_log(self, group: str | None, since: int) -> dict:
        return {}


def _server(model_dir: str, batch: int, tokens: int, port: int, api_workers: int, ready, received, out) -> None:
    frontend = TickingFrontend(Tokenizer.from_dir(model_dir), tokens)

    async def main() -> None:
        procs: list[subprocess.Popen] = []
        if api_workers:
            address = f"unix:{tempfile.mkdtemp(prefix='lockstep-bench-link-')}/link.sock"
            link, _ = await start_link(frontend, address)  # type: ignore[arg-type]
            held = reserve("127.0.0.1", port)
            procs = [subprocess.Popen([sys.executable, "-m", "lockstep.coordinator.remote", "--link", address,
                                       "--model", model_dir, "--port", str(port)]) for _ in range(api_workers)]
            await _until_serving(port)
        else:
            runner = await run_app(OpenAIServer(frontend).app(), "127.0.0.1", port)
        ready.set()
        while len(frontend.live) < batch:  # every stream open before the clock starts
            await asyncio.sleep(TICK_S)
        children = [psutil.Process(p.pid) for p in procs]
        cpu, wall, sent = time.process_time(), time.perf_counter(), 0
        theirs = [sum(c.cpu_times()[:2]) for c in children]
        while frontend.live:
            sent += len(frontend.live)
            frontend.tick()
            await asyncio.sleep(TICK_S)
        while not received.is_set():  # the clock stops when the clients have every token, wherever it was sent
            await asyncio.sleep(TICK_S)
        out.put((sent, time.process_time() - cpu, time.perf_counter() - wall,
                 [sum(c.cpu_times()[:2]) - t for c, t in zip(children, theirs, strict=True)]))
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        if api_workers:
            await link.stop(0)
            held.close()
        else:
            await runner.cleanup()

    asyncio.run(main())


async def _until_serving(port: int) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            try:
                async with session.get(f"http://127.0.0.1:{port}/v1/models") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("the API frontends did not start")


async def _clients(port: int, batch: int, tokens: int) -> int:
    """The token ids every stream received, counted from the chunks (return_token_ids)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> int:
            body = {"model": "bench", "prompt": [1, 2, 3], "max_tokens": tokens, "stream": True,
                    "return_token_ids": True}
            got = 0
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        got += sum(len(c.get("token_ids") or ()) for c in json.loads(line[6:])["choices"])
            return got

        return sum(await asyncio.gather(*(one() for _ in range(batch))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256, help="streams at once")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--model", default="builtin", help="whose tokenizer detokenizes (a directory, or builtin)")
    p.add_argument("--api-workers", type=int, default=0,
                   help="serve HTTP from this many frontend processes over the frontend link (0: in process)")
    args = p.parse_args(argv)
    model_dir = args.model
    if model_dir.startswith("builtin"):
        from lockstep.model.builtin import resolve_model

        model_dir = str(resolve_model(model_dir))
    ctx = mp.get_context("spawn")
    ready, received, out, port = ctx.Event(), ctx.Event(), ctx.Queue(), free_port()
    server = ctx.Process(target=_server, args=(model_dir, args.batch, args.tokens, port, args.api_workers, ready,
                                               received, out))
    server.start()
    if not ready.wait(60):
        server.kill()
        print("the server did not start", file=sys.stderr)
        return 1
    got = asyncio.run(_clients(port, args.batch, args.tokens))
    received.set()
    sent, cpu, wall, theirs = out.get(timeout=60)
    server.join(60)
    where = f"{args.api_workers} API frontend process(es)" if args.api_workers else "HTTP in the coordinator"
    per_token = cpu / sent
    shares = ", ".join(f"{t / sum(theirs):.0%}" for t in theirs) if sum(theirs) > 0 else "too little to tell"
    print(f"batch {args.batch}, {args.tokens} tokens each, {where}: {sent} tokens sent, {got} received in "
          f"{wall:.2f} s; coordinator CPU {cpu * 1e3:.0f} ms = {per_token * 1e6:.1f} us per token = "
          f"{per_token * args.batch * 1e3:.2f} ms per step of {args.batch}"
          + (f"; frontends' CPU {sum(theirs) / sent * 1e6:.1f} us per token (shares {shares})" if theirs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
