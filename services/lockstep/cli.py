"""`lockstep` command line: one subcommand per service, each owning its own flags."""

from __future__ import annotations

import importlib.util
import sys

USAGE = """usage: lockstep {serve,rank,coordinator,bench} [options]

  serve        a coordinator and N local rank processes on this machine (the embedded default)
  rank         one rank of a group: a gRPC service around its shard of the model
  coordinator  the coordinator of one or more groups, with the OpenAI-compatible API
  bench        the load generator and benchmark
"""
NEEDS_TORCH = ("rank", "serve")


def _has_torch() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command in NEEDS_TORCH and not _has_torch():
        print(f"lockstep {command}: runs the model, which needs torch; install it with "
              "pip install 'lockstep[rank]' (the coordinator and the operator run without it)", file=sys.stderr)
        return 2
    if command == "rank":
        from lockstep.rank.main import main as run
    elif command == "coordinator":
        from lockstep.coordinator.main import main as run
    elif command == "serve":
        from lockstep.serve import main as run
    elif command == "bench":
        from lockstep.bench.command import main as run
    else:
        print(f"lockstep: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
