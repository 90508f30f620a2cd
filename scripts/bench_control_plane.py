"""The control plane's ceiling: the real coordinator, gRPC streams and rank service around a no-op forward.

    python scripts/bench_control_plane.py --batch 8,64,256 --tp 1,2 --steps 200 --agreement both --profile 25
    python scripts/bench_control_plane.py --batch 256 --tp 1 --overlap on --split-cores  # as on a GPU host

Prints, per (TP, agreement, batch), the p50 and p90 of every part of a steady decode step (plan, serialize,
round trip, rank apply, apply, total) beside vLLM's and TensorRT-LLM's published numbers; see
`lockstep.bench.control_plane` for what each part covers. A benchmark mode only: nothing in `lockstep serve`
or `lockstep rank` reaches it.
"""

from __future__ import annotations

import sys

from lockstep.bench.control_plane_cli import main

if __name__ == "__main__":
    sys.exit(main())
