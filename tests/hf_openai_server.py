"""Another engine to measure next to Lockstep: a transformers model behind a small OpenAI-compatible
`/v1/completions` (greedy, streamed, `usage` at the end), one request at a time, the way a plain
transformers server answers. Run: python tests/hf_openai_server.py MODEL_DIR PORT
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import torch
from aiohttp import web
from transformers import AutoModelForCausalLM, AutoTokenizer


def make_app(model_dir: str) -> web.Application:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    lock = threading.Lock()  # one generation at a time

    def generate(prompt: str, max_tokens: int, emit) -> int:
        ids = tok(prompt)["input_ids"]  # with the BOS, as Lockstep and vLLM tokenize a completion prompt
        out: list[int] = []
        with lock, torch.inference_mode():
            past, x, text = None, torch.tensor([ids]), ""
            for _ in range(max_tokens):
                res = model(input_ids=x, past_key_values=past, use_cache=True)
                past = res.past_key_values
                nxt = int(res.logits[0, -1].argmax())
                out.append(nxt)
                full = tok.decode(out, skip_special_tokens=True)
                if not full.endswith("\ufffd"):
                    emit(full[len(text):])
                    text = full
                x = torch.tensor([[nxt]])
        full = tok.decode(out, skip_special_tokens=True)
        if full != text:  # the last token's bytes end mid-character: what is there is flushed, as vLLM does
            emit(full[len(text):])
        return len(out)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(piece: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, piece)

        task = loop.run_in_executor(None, generate, body["prompt"], int(body["max_tokens"]), emit)
        while not (task.done() and queue.empty()):
            try:
                piece = await asyncio.wait_for(queue.get(), 0.05)
            except TimeoutError:
                continue
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": piece, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 0, "completion_tokens": await task}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


if __name__ == "__main__":
    torch.set_num_threads(1)
    web.run_app(make_app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), print=None)
