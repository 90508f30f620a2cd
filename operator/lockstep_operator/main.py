"""`lockstep-operator`: run the kopf operator for LockstepDeployments."""

from __future__ import annotations

import argparse
import asyncio

import kopf

from lockstep_operator import handlers as handlers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lockstep-operator",
                                     description="Serve LockstepDeployment resources (a kopf operator).")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[],
                       help="watch this namespace (repeatable); default: all namespaces")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="kopf's liveness endpoint (the chart's probe)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    kopf.configure(verbose=args.verbose)
    asyncio.run(kopf.operator(
        clusterwide=not args.namespace,
        namespaces=args.namespace or None,
        liveness_endpoint=args.liveness,
        standalone=True,
    ))
