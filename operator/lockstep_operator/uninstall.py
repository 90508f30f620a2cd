"""`python -m lockstep_operator.uninstall NAME`: delete a LockstepDeployment and wait until it is gone.

The chart runs it as a pre-delete hook. Helm deletes the kinds it does not know (a LockstepDeployment) after the
ones it does, so on `helm uninstall` the operator, its RBAC and its ServiceAccount went first, and the
deployment then waited for ever on the operator's finalizer (Terminating, its GPU pods still running, its
namespace undeletable). Deleted first, while the operator runs, it drains and goes as `kubectl delete` does.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from lockstep_operator.crd import KIND
from lockstep_operator.kube import Kube, default_api_client


def delete_and_wait(kube: Kube, namespace: str, name: str, timeout_s: float, poll_s: float = 1.0,
                    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Ask for the deletion (one already gone is done) and wait until the API server no longer has it: True, or
    False after `timeout_s` (the operator is not running, or its drain takes longer)."""
    kube.delete(KIND, namespace, name)
    deadline = clock() + timeout_s
    while kube.get(KIND, namespace, name) is not None:
        if clock() >= deadline:
            return False
        sleep(poll_s)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="the LockstepDeployment")
    p.add_argument("--namespace", "-n", required=True)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for it to go")
    args = p.parse_args(argv)
    if delete_and_wait(Kube(default_api_client()), args.namespace, args.name, args.timeout):
        print(f"LockstepDeployment {args.namespace}/{args.name} is gone")
        return 0
    print(f"LockstepDeployment {args.namespace}/{args.name} is still there after {args.timeout:g} s: is the "
          "operator running? (`kubectl get lsd -n NAMESPACE NAME -o yaml` shows its finalizers)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
