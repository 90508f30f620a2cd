"""The coordinator's CPU per streamed token: the real OpenAI HTTP app, SSE to real clients in another process.

    python scripts/bench_stream_frontend.py --batch 256 --tokens 64

The control-plane benchmark (`lockstep bench --control-plane`) stops at the step loop's dispatch: its
streams are drained in process. Here the rest of a streamed token's way out of the coordinator is measured:
the request's events, incremental detokenization and stop strings (`text_stream`), the SSE chunk's JSON and
the socket write, for `--batch` streaming /v1/completions requests at once. A stand-in for the step loop
hands every live request one token per tick, as `CoordinatorService._dispatch` does after each step, so the
server process does nothing else; its CPU time over the steady part, per token and per step of `--batch`
tokens, is the cost that sits on the coordinator's event loop beside plan, apply and dispatch.
A benchmark only: nothing in `lockstep serve` reaches the stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
from collections.abc import AsyncGenerator

import aiohttp

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

    def __init__(self, tokenizer: Tokenizer, tokens: int) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.live: dict[str, list] = {}

    def generate(self, request_id: str, spec: GenerateSpec) -> AsyncGenerator[TokenEvent, None]:
        box: Outbox[TokenEvent] = Outbox()
        self.live[request_id] = [box, 0]

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


def _server(model_dir: str, batch: int, tokens: int, port: int, ready, out) -> None:
    frontend = TickingFrontend(Tokenizer.from_dir(model_dir), tokens)

    async def main() -> None:
        runner = await run_app(OpenAIServer(frontend).app(), "127.0.0.1", port)
        ready.set()
        while len(frontend.live) < batch:  # every stream open before the clock starts
            await asyncio.sleep(TICK_S)
        cpu, wall, sent = time.process_time(), time.perf_counter(), 0
        while frontend.live:
            sent += len(frontend.live)
            frontend.tick()
            await asyncio.sleep(TICK_S)
        out.put((sent, time.process_time() - cpu, time.perf_counter() - wall))
        await asyncio.sleep(0.5)  # the last chunks go out
        await runner.cleanup()

    asyncio.run(main())


async def _clients(port: int, batch: int, tokens: int) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            body = {"model": "bench", "prompt": [1, 2, 3], "max_tokens": tokens, "stream": True}
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                async for _ in r.content:
                    pass

        await asyncio.gather(*(one() for _ in range(batch)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256, help="streams at once")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--model", default="builtin", help="whose tokenizer detokenizes (a directory, or builtin)")
    args = p.parse_args(argv)
    model_dir = args.model
    if model_dir.startswith("builtin"):
        from lockstep.model.builtin import resolve_model

        model_dir = str(resolve_model(model_dir))
    ctx = mp.get_context("spawn")
    ready, out, port = ctx.Event(), ctx.Queue(), free_port()
    server = ctx.Process(target=_server, args=(model_dir, args.batch, args.tokens, port, ready, out))
    server.start()
    if not ready.wait(60):
        server.kill()
        print("the server did not start", file=sys.stderr)
        return 1
    asyncio.run(_clients(port, args.batch, args.tokens))
    sent, cpu, wall = out.get(timeout=60)
    server.join(10)
    print(f"batch {args.batch}, {args.tokens} tokens each: {sent} tokens in {wall:.2f} s; coordinator CPU "
          f"{cpu * 1e3:.0f} ms = {cpu / sent * 1e6:.1f} us per token = {cpu / sent * args.batch * 1e3:.2f} ms per "
          f"step of {args.batch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
