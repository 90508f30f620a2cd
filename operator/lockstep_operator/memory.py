"""What the operator remembers between handler calls, kept in kopf's `memo` instead of module globals.

One `OperatorMemory` per running operator, put in the operator's memo (`memo.lockstep`) by the startup
handler. kopf hands every resource object a shallow copy of that memo, so the LockstepDeployment
handlers and the rank pod watcher share this one object; a second operator in the same process (tests
start one per test) starts with a memory of its own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from lockstep_operator.kube import Kube
from lockstep_operator.observe import GroupKey

MEMO_KEY = "lockstep"
# The memo key a caller sets to give the operator its Kubernetes client (tests point it at KMock):
# `kopf.operator(memo=kopf.Memo(kube=Kube(...)))`. Without it, the in-cluster / kubeconfig client.
MEMO_KUBE = "kube"


@dataclass
class OperatorMemory:
    """The client, one lock per deployment, the pods deleted on purpose and the recreates that wait."""

    kube: Kube
    # Pods this operator deleted itself (by uid): their deletion is not a rank failure.
    deleted_by_us: set[str] = field(default_factory=set)
    # Groups to recreate once none of their pods is Pending: (namespace, deployment, group) -> reason.
    pending_recreates: dict[GroupKey, str] = field(default_factory=dict)
    _locks: dict[tuple[str, str], threading.RLock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def lock(self, namespace: str, name: str) -> threading.RLock:
        """One lock per deployment: the resource handlers and the pod watcher never act on it at once."""
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.RLock())

    def pending_for(self, namespace: str, name: str) -> dict[str, str]:
        """The recreates that wait for a Pending pod in one deployment: group name -> reason."""
        return {g: reason for (ns, n, g), reason in self.pending_recreates.items() if (ns, n) == (namespace, name)}

    def forget(self, namespace: str, name: str, group: str | None = None) -> None:
        """Drop the waiting recreates of one group (or of every group of the deployment)."""
        for key in [k for k in self.pending_recreates if k[:2] == (namespace, name) and group in (None, k[2])]:
            self.pending_recreates.pop(key, None)
