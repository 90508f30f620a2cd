"""A group that formed without a rank refuses it, and its ranks learn that they must go (group_watch.py)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lockstep.local_group import free_port
from lockstep.parallel import group_watch
from lockstep.parallel.group_watch import FORMED, REJOINED, GroupWatch, mark_formed, wait_for_fresh_store


def master(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=10), wait_for_workers=False)


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(group_watch, "POLL_S", 0.05)


def test_a_fresh_store_is_joined_at_once_and_a_formed_one_is_told_and_waited_out():
    port = free_port()
    store = master(port)
    wait_for_fresh_store("127.0.0.1", port, 1, 5.0)  # nothing formed here yet: the group forms with this rank
    assert store.add(REJOINED, 0) == 0
    mark_formed("127.0.0.1", port)
    assert store.check([FORMED])
    done = threading.Event()
    joiner = threading.Thread(target=lambda: (wait_for_fresh_store("127.0.0.1", port, 1, 20.0), done.set()))
    joiner.start()
    deadline = time.monotonic() + 5
    while store.add(REJOINED, 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.add(REJOINED, 0) == 1 and not done.is_set()  # the old group is told once; the rank waits
    time.sleep(0.3)
    assert store.add(REJOINED, 0) == 1 and not done.is_set()
    del store  # the old rank 0 exits: its store goes
    fresh = master(port)  # the new rank 0's
    joiner.join(10)
    assert done.is_set() and not fresh.check([FORMED])


def test_a_rank_that_finds_no_fresh_store_in_time_says_so():
    port = free_port()
    store = master(port)
    mark_formed("127.0.0.1", port)
    with pytest.raises(TimeoutError, match=f"no fresh rendezvous store at 127.0.0.1:{port}"):
        wait_for_fresh_store("127.0.0.1", port, 2, 0.5)
    del store


def formed_and_watched(port: int) -> tuple[dist.TCPStore, GroupWatch, list[str]]:
    """A formed group's store and one rank's watch of it, with what the watch says."""
    store = master(port)
    mark_formed("127.0.0.1", port)
    heard: list[str] = []
    return store, GroupWatch("127.0.0.1", port, heard.append, poll_s=0.05).start(), heard


def heard_within(watch: GroupWatch, heard: list[str], seconds: float = 10) -> list[str]:
    deadline = time.monotonic() + seconds
    while not heard and time.monotonic() < deadline:
        time.sleep(0.02)
    watch.stop()
    return heard


@pytest.mark.parametrize("how", ["a peer rejoined", "rank 0 exited"])
def test_the_watch_of_a_formed_group_hears_of_a_rejoined_peer_or_a_lost_store(how):
    store, watch, heard = formed_and_watched(free_port())
    time.sleep(0.3)
    assert heard == []  # a group that stands says nothing
    if how == "a peer rejoined":
        store.add(REJOINED, 1)
    else:
        del store
    assert len(heard_within(watch, heard)) == 1
    assert ("started again on its own" if how == "a peer rejoined" else "is gone (rank 0 exited)") in heard[0]


def test_a_store_made_anew_at_the_rendezvous_is_not_the_groups():
    """A new rank 0 (started again on its own) makes a store at the same address: it has no mark yet."""
    port = free_port()
    store, watch, heard = formed_and_watched(port)
    time.sleep(0.2)
    del store
    fresh = master(port)
    assert len(heard_within(watch, heard)) == 1 and "is gone (rank 0 exited)" in heard[0]
    del fresh


def test_a_stopped_watch_says_nothing_when_the_store_goes():
    store, watch, heard = formed_and_watched(free_port())
    time.sleep(0.2)
    watch.stop()
    del store
    time.sleep(0.5)
    assert heard == []


def test_a_store_unreached_for_a_poll_or_two_is_not_gone(monkeypatch):
    """A connection that times out or a name that does not resolve (a busy DNS) may be the network's: the group
    of a rank that cannot reach its store for a poll or two stands; one that cannot for several polls is gone."""
    import socket

    real = socket.create_connection
    fail = {"left": group_watch.UNREACHED - 1}

    def flaky(*args, **kwargs):
        if fail["left"] > 0:
            fail["left"] -= 1
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(*args, **kwargs)

    monkeypatch.setattr(group_watch.socket, "create_connection", flaky)
    store, watch, heard = formed_and_watched(free_port())
    time.sleep(0.6)
    assert heard == [] and fail["left"] == 0  # the first polls failed, then the store answered
    fail["left"] = 1000  # a store that went and a name that no longer resolves: gone, after a few polls
    del store
    assert len(heard_within(watch, heard)) == 1 and "is gone" in heard[0]
