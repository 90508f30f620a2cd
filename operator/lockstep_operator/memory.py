"""What the operator remembers between handler calls, kept in kopf's `memo` instead of module globals.

One `OperatorMemory` per running operator, put in the operator's memo (`memo.lockstep`) by the startup
handler. kopf hands every resource object a shallow copy of that memo, so the LockstepDeployment
handlers and the rank pod watcher share this one object; a second operator in the same process (tests
start one per test) starts with a memory of its own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from lockstep_operator.drain import Drain
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
    # Drains asked of the coordinator before a roll, recreate or removal (see `drain.py`).
    drains: dict[GroupKey, Drain] = field(default_factory=dict)
    # Groups drained and then rolled or recreated: resumed at the coordinator once they serve again.
    resumes: dict[GroupKey, str] = field(default_factory=dict)  # -> the coordinator's group name
    # When to look again whether drained groups serve (to resume them), per deployment: clock seconds.
    next_resume_check: dict[tuple[str, str], float] = field(default_factory=dict)
    # The outcome of the last drain of each deployment (reason, message), for the Draining condition.
    drain_outcomes: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    # lockstep_agreements_stalled per coordinator group (None: /metrics unreadable), per deployment.
    stalled: dict[tuple[str, str], dict[str, float] | None] = field(default_factory=dict)
    # The coordinator's /health body (None: unreadable), per deployment: the Degraded condition reads it.
    health: dict[tuple[str, str], dict[str, Any] | None] = field(default_factory=dict)
    # Deployments whose drains were taken back from the coordinator's /health since this operator started.
    adopted: set[tuple[str, str]] = field(default_factory=set)
    # When to try that again, per deployment, while the coordinator cannot be read: clock seconds.
    next_adopt_check: dict[tuple[str, str], float] = field(default_factory=dict)
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
        """Drop the waiting recreates of one group (or everything remembered of the deployment)."""
        for key in [k for k in self.pending_recreates if k[:2] == (namespace, name) and group in (None, k[2])]:
            self.pending_recreates.pop(key, None)
        if group is None:
            for book in (self.drains, self.resumes):
                for key in [k for k in book if k[:2] == (namespace, name)]:
                    book.pop(key, None)
            for book in (self.drain_outcomes, self.stalled, self.health, self.next_resume_check,
                         self.next_adopt_check):
                book.pop((namespace, name), None)
            self.adopted.discard((namespace, name))

    def adoption_tried(self, namespace: str, name: str) -> bool:
        """Whether the coordinator's /health was asked for this deployment's drains since the operator started
        (and answered, or could not be read): until then no drain is started, as it may be running already."""
        return (namespace, name) in self.adopted or (namespace, name) in self.next_adopt_check

    def drains_for(self, namespace: str, name: str) -> dict[str, Drain]:
        """The drains asked for one deployment: group name -> record (a copy)."""
        with self._guard:
            return {g: d for (ns, n, g), d in self.drains.items() if (ns, n) == (namespace, name)}

    def resumes_for(self, namespace: str, name: str) -> dict[str, str]:
        """The groups of one deployment to resume once they serve: group name -> coordinator group (a copy)."""
        with self._guard:
            return {g: c for (ns, n, g), c in self.resumes.items() if (ns, n) == (namespace, name)}

    def update_drain(self, key: GroupKey, before: Drain, after: Drain) -> bool:
        """Store what a drain request came back with, unless the record changed (or went) meanwhile."""
        with self._guard:
            if self.drains.get(key) is not before:
                return False
            self.drains[key] = after
            return True

    def end_drain(self, key: GroupKey, resume: bool) -> None:
        """The group was rolled, recreated or removed (or needs no drain any more); resume it at the
        coordinator once it serves again if a drain was asked."""
        with self._guard:
            record = self.drains.pop(key, None)
            if resume and record is not None:
                self.resumes[key] = record.group
