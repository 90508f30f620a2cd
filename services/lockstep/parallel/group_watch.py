"""Whether a rank's group still stands while nothing drives it, seen through rank 0's rendezvous store.

A torch.distributed group cannot take a new member. A rank started again on its own (systemd, a container's
restart policy; the operator and `lockstep serve` recreate whole groups) reached the store of the group it had
left, where only the old rank 0 answered, and waited there for ever; its old peers, idle with no coordinator to
drive them into a collective that would fail, served on in a group that had lost a member. So:

- once formed, the group marks its store (`FORMED`); a rank that finds the mark on joining knows the store
  belongs to a group that formed without it, says so (`REJOINED`) and waits for a fresh store;
- every rank of a formed group polls the store: a rejoined peer, or a store that is gone (rank 0 exited), means
  the group is broken, and the rank exits to have it made anew, as a failed collective would make it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("lockstep.comm")
FORMED = "lockstep/formed"
REJOINED = "lockstep/rejoined"
POLL_S = 1.0
CONNECT_S = 5.0
UNREACHED = 3  # polls in a row that reach no store (a timeout, a name not resolved) before it counts as gone


def _client(host: str, port: int, timeout_s: float = CONNECT_S) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def wait_for_fresh_store(host: str, port: int, rank: int, timeout_s: float) -> None:
    """Return once a store answers at host:port that belongs to no formed group (until then, keep looking: rank 0
    may not be up yet). A formed one is told that a member started again, so that its ranks exit and rank 0,
    started again, makes a fresh store. Past `timeout_s`, TimeoutError."""
    deadline = time.monotonic() + timeout_s
    told = False
    while True:
        try:
            store = _client(host, port, max(0.1, min(CONNECT_S, deadline - time.monotonic())))
            if not store.check([FORMED]):
                return
            if not told:
                store.add(REJOINED, 1)
                told = True
                log.warning("rank %d: the rendezvous store at %s:%d belongs to a group that formed without this rank "
                            "(it started again on its own); that group was told to stop, waiting for a fresh one",
                            rank, host, port)
        except dist.DistError:
            pass  # no store up yet, or the old one just went: look again
        if time.monotonic() >= deadline:
            raise TimeoutError(f"rank {rank}: no fresh rendezvous store at {host}:{port} within {timeout_s:g} s")
        time.sleep(POLL_S)


def mark_formed(host: str, port: int) -> None:
    _client(host, port).set(FORMED, "1")


def _log_broken(why: str) -> None:
    log.error("this rank's group is broken: %s", why)


_on_broken: list[Callable[[str], None]] = [_log_broken]  # the process's one group: `lockstep rank` exits on it


def on_group_broken(handler: Callable[[str], None]) -> None:
    """What the process does once its group is found broken (`lockstep rank`: exit, to have the group made anew)."""
    _on_broken[0] = handler


def watch_group(host: str, port: int) -> GroupWatch:
    """Start watching the group just formed on the store at host:port."""
    return GroupWatch(host, port, lambda why: _on_broken[0](why)).start()


class GroupWatch:
    """Polls the store of a formed group and calls `on_broken(why)` once, when a peer rejoined or the store went."""

    def __init__(self, host: str, port: int, on_broken: Callable[[str], None], poll_s: float = POLL_S) -> None:
        self.host, self.port, self.on_broken, self.poll_s = host, port, on_broken, poll_s
        self._stop = threading.Event()

    def start(self) -> GroupWatch:
        threading.Thread(target=self._run, name="group-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        where = f"{self.host}:{self.port}"
        store: dist.TCPStore | None = None
        unreached = 0
        while not self._stop.wait(self.poll_s):
            try:
                store = store or self._reconnect()
                rejoined = store.add(REJOINED, 0)
            except _Replaced as exc:  # refused, or another store answers: the group's store is gone for sure
                why = f"the group's rendezvous store at {where} is gone (rank 0 exited): {exc}"
                break
            except (dist.DistError, OSError) as exc:
                # a timeout or a name that did not resolve may be the network's or DNS's (a busy cluster): a
                # healthy group must not exit on one, so only a store unreached for several polls in a row is gone
                store = None
                unreached += 1
                if unreached >= UNREACHED:
                    why = f"the group's rendezvous store at {where} is gone ({unreached} polls reached it not): {exc}"
                    break
                log.warning("the group's rendezvous store at %s did not answer (%s); trying again", where, exc)
                continue
            unreached = 0
            if rejoined:
                why = f"a rank of this group started again on its own and reached its store at {where}"
                break
        else:
            return
        if not self._stop.is_set():
            self.on_broken(why)

    def _reconnect(self) -> dist.TCPStore:
        """The store again, if it is still this group's (a fresh one, of a new rank 0, has no mark yet). A port
        nobody listens on is refused at once (the store's client would retry it for several seconds): that is
        final; a connection that times out or a name that does not resolve may not be."""
        try:
            socket.create_connection((self.host, self.port), timeout=CONNECT_S).close()
        except ConnectionRefusedError as exc:
            raise _Replaced(f"nothing listens there: {exc}") from exc
        store = _client(self.host, self.port)
        if not store.check([FORMED]):
            raise _Replaced("another store answers there now")
        return store


class _Replaced(Exception):
    """The store at the rendezvous is not the one this group formed on."""
