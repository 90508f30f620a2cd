#!/usr/bin/env bash
# Issue 11's GPU checks in one prepared run, for a session that is lent a GPU machine (no network there).
#
#   bash scripts/gpu_check.sh prepare      # here, with network: fills .gpu/ (git-ignored, about 11 MB)
#   bash scripts/gpu_check.sh run          # there: device tool, run(command="bash scripts/gpu_check.sh run",
#                                          #        carry=[".gpu"], timeout_s=540); results in $OUT
#   bash scripts/gpu_check.sh run --quick  # a small model and short runs: what the test runs on the CPU
#                                          # (GPU_CHECK_LIKE=DIR: another config and tokenizer than .gpu/like)
#
# `run` does, on whatever device a rank picks (lockstep.device: the GPU there):
#   1. a random-weight checkpoint of the built-in model's shape (SmolLM2-135M: its config and tokenizer are in
#      .gpu/; its weights, a 93 MB wheel, are more than a device call carries),
#   2. parity and decode tokens/s next to transformers on the same device, float32 (greedy tokens must agree
#      at batch 1) and the default dtype (bfloat16 on a GPU), scripts/bench_engine.py,
#   3. sample() on the device against the CPU path it replaces there (batch 256, 128k vocabulary),
#      then `lockstep serve --tp 1` answering a completion over HTTP,
#   4. `lockstep bench`: served and in-process throughput,
#   5. what a decode attention call costs there in gathered key slots (scripts/bench_decode_groups.py, an 8B
#      model's heads: the number behind lockstep.device.attention_call_tokens) and the rank's host work per
#      decode step on that machine's CPU (scripts/bench_rank_host.py), and the coordinator's
#      (scripts/bench_coordinator_host.py): a GPU host's CPU, where the control plane's ceiling matters.
# Every step writes into $OUT (default /tmp/gpu_check) and the run goes on past a failed step; the exit
# status counts the failed steps.
set -u
mode=${1:-}
quick=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

prepare() {
    set -e
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    mkdir -p .gpu/like .gpu/whl
    local model
    model=$(python3 -c 'from lockstep.model.builtin import resolve_model; print(resolve_model("builtin"))')
    for f in config.json tokenizer.json tokenizer_config.json generation_config.json; do
        [ -f "$model/$f" ] && cp "$model/$f" .gpu/like/
    done
    # what the GPU image lacks (device/KINDS.md) or may hold in an older version than the generated code needs
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.35.1
    du -sh .gpu
}

step() {  # step NAME COMMAND...: run it, log to $OUT/NAME.log, count a failure
    local name=$1
    shift
    local cmd="$*"
    echo "== $name: ${cmd:0:150}"
    if "$@" > "$OUT/$name.log" 2>&1; then
        echo "   ok"
    else
        echo "   FAILED ($?); the end of $OUT/$name.log:"
        tail -n 15 "$OUT/$name.log"
        failed=$((failed + 1))
    fi
}

serve_once() {  # lockstep serve --tp 1 answers one completion, then stops on SIGTERM
    local port=$1
    python3 -m lockstep.cli serve --model "$ckpt" --tp 1 --port "$port" --kv-pages 256 > "$OUT/serve_server.log" 2>&1 &
    local pid=$! up=""
    for _ in $(seq 1 240); do
        if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
            2>/dev/null; then up=1; break; fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    local rc=1
    if [ -n "$up" ]; then
        python3 - "$port" <<'EOF'
import json, sys, urllib.request
body = json.dumps({"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
                   "ignore_eos": True}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=120))
print(json.dumps(out, indent=1))
assert out["usage"]["completion_tokens"] == 16, out["usage"]
EOF
        rc=$?
    fi
    kill -TERM "$pid" 2>/dev/null
    wait "$pid"
    cat "$OUT/serve_server.log"
    return $rc
}

# sample() where the logits are (the device) against the CPU path with the copy it needs, batch 256 x 128k
SAMPLING_PY='
import sys, time, torch
from lockstep.device import pick_device
from lockstep.model.sampling import sample
from lockstep.steps import SamplingParams
dev = pick_device()
rows, vocab = (8, 4096) if sys.argv[1:] == ["--quick"] else (256, 128256)
x = 4 * torch.randn(rows, vocab, device=dev)
def timed(fn, n=5):
    fn()
    if dev.type == "cuda": torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    if dev.type == "cuda": torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3
for name, p in [("greedy", SamplingParams()), ("temperature 1", SamplingParams(temperature=1.0)),
                ("top_p 0.9", SamplingParams(temperature=1.0, top_p=0.9)), ("top_k 50", SamplingParams(temperature=1.0, top_k=50))]:
    ps, seeds = [p] * rows, list(range(rows))
    here = timed(lambda: sample(x, ps, seeds))
    host = timed(lambda: sample(x.to("cpu"), ps, seeds), n=1)
    print(f"{name:14s} batch {rows} vocab {vocab}: on {dev} {here:8.2f} ms, copied to the CPU {host:8.2f} ms")
'

run() {
    OUT=${OUT:-/tmp/gpu_check}
    mkdir -p "$OUT"
    failed=0
    export PYTHONUNBUFFERED=1 PYTHONPATH="$root/services${PYTHONPATH:+:$PYTHONPATH}"
    if ls .gpu/whl/*.whl > /dev/null 2>&1 && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_site \
            .gpu/whl/*.whl && export PYTHONPATH="/tmp/gpu_site:$PYTHONPATH"
    fi
    local layers=0 batches=(1 8 32) half=(1 32 128) tokens=64 requests=256 concurrency=64
    local groups=(--heads 32 --kv-heads 8 --head-dim 128) host=(--batch 8,64,256)
    if [ "$quick" = "--quick" ]; then
        layers=2 batches=(1 4) half=(1 4) tokens=8 requests=8 concurrency=4
        groups=(--batch 16 --repeat 2 --layers 1 --fit-rows 4 16 --fit-pages 2 8 --call-tokens 256 16384)
        host=(--batch 8 --steps 5 --warmup 2)
    fi
    ckpt=$OUT/ckpt
    step env python3 -c 'import torch, lockstep.device as d; print(torch.__version__, torch.version.cuda,
torch.cuda.is_available() and torch.cuda.get_device_name(0), d.pick_device())'
    cat "$OUT/env.log"
    step checkpoint python3 scripts/random_checkpoint.py --like "${GPU_CHECK_LIKE:-.gpu/like}" --out "$ckpt" \
        --layers "$layers"
    step engine_float32 python3 scripts/bench_engine.py --model "$ckpt" --batch "${batches[@]}" \
        --new-tokens "$tokens" --dtype float32 --json "$OUT/engine_float32.json"
    local auto
    auto=$(python3 -c "import torch, lockstep.device as d; from lockstep.model.config import ModelConfig as M
print(str(d.pick_dtype('auto', d.pick_device(), M.checkpoint_dtype('$ckpt'))).removeprefix('torch.'))")
    if [ "$auto" != float32 ]; then  # on a GPU: what a rank serves in by default
        step "engine_$auto" python3 scripts/bench_engine.py --model "$ckpt" --batch "${half[@]}" \
            --new-tokens "$tokens" --dtype "$auto" --json "$OUT/engine_$auto.json"
    fi
    step sampling python3 -c "$SAMPLING_PY" "$quick"
    step serve serve_once 8311
    step bench python3 -m lockstep.cli bench --model "$ckpt" --tp 1 --requests "$requests" \
        --concurrency "$concurrency" --max-tokens "$tokens" --max-num-seqs "$concurrency" --json "$OUT/bench.json"
    step decode_groups python3 scripts/bench_decode_groups.py "${groups[@]}"
    step rank_host python3 scripts/bench_rank_host.py "${host[@]}"
    step coordinator_host python3 scripts/bench_coordinator_host.py "${host[@]}"
    for f in "$OUT"/engine_*.log "$OUT"/sampling.log "$OUT"/bench.log "$OUT"/decode_groups.log "$OUT"/rank_host.log \
             "$OUT"/coordinator_host.log; do echo "---- $f"; tail -n 12 "$f"; done
    echo "failed steps: $failed"
    return "$failed"
}

case "$mode" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash scripts/gpu_check.sh prepare | run [--quick]" >&2; exit 2 ;;
esac
