"""The coordinator's event-loop watchdog, in real processes: a stalled loop ends the process with its stacks."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lockstep.coordinator.config import CoordinatorConfig, parse_config
from lockstep.coordinator.loop_watchdog import LoopWatchdog

SCRIPT = """
import asyncio, logging, sys, time
from lockstep.coordinator.loop_watchdog import LoopWatchdog

logging.basicConfig(level=logging.INFO, stream=sys.stdout)

def stuck_in_a_blocking_call(seconds):
    time.sleep(seconds)

async def main():
    dog = LoopWatchdog({timeout}, tick_s=0.1, lag_warning_s=0.5)
    dog.start(asyncio.get_running_loop())
    await asyncio.sleep(1.5)  # a loop that turns is never ended, however long it runs
    print("alive", flush=True)
    stuck_in_a_blocking_call({block})
    await asyncio.sleep(0.3)
    {after}
    print("survived", flush=True)

asyncio.run(main())
"""


def run_script(timeout: float, block: float, after: str = "pass") -> tuple[subprocess.CompletedProcess, float]:
    code = textwrap.dedent(SCRIPT).format(timeout=timeout, block=block, after=after)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - t0


def test_a_loop_stalled_past_the_timeout_ends_the_process_with_the_stack_that_holds_it():
    proc, took = run_script(timeout=2.0, block=30)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "alive" in proc.stdout and "survived" not in proc.stdout
    assert took < 20  # ended by the watchdog, not by the 30 s call returning
    assert "the event loop has not turned for 2 s" in proc.stdout
    assert "stuck_in_a_blocking_call" in proc.stderr  # where the loop's thread was held


def test_a_shorter_stall_is_logged_and_the_process_goes_on():
    proc, _ = run_script(timeout=3.0, block=1.5)
    assert proc.returncode == 0, proc.stderr
    assert "survived" in proc.stdout
    assert "the event loop stalled for 1." in proc.stdout


def test_a_pause_of_the_whole_process_is_not_a_stall():
    """Ctrl-Z on `lockstep serve` and `fg` later (SIGSTOP, SIGCONT): the watching thread was stopped too."""
    code = textwrap.dedent(SCRIPT).format(timeout=1.5, block=0.0, after="await asyncio.sleep(1.0)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("INFO:lockstep.coordinator.loop_watchdog:event-loop watchdog")
        proc.send_signal(signal.SIGSTOP)
        time.sleep(4.0)
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "survived" in out


STUCK_IN_LOGGING = """
import asyncio, logging, sys, time
from lockstep.coordinator.loop_watchdog import LoopWatchdog

class PipeNobodyReads(logging.StreamHandler):
    def emit(self, record):
        if record.getMessage() == "stuck":  # the loop's thread stalls here, holding the handler's lock
            time.sleep(600)
        super().emit(record)

logging.basicConfig(level=logging.INFO, handlers=[PipeNobodyReads(sys.stdout)])

async def main():
    LoopWatchdog(1.5, tick_s=0.1, lag_warning_s=0.5).start(asyncio.get_running_loop())
    await asyncio.sleep(0.5)
    print("alive", flush=True)
    logging.getLogger("x").info("stuck")

asyncio.run(main())
"""


def test_a_loop_stalled_inside_a_logging_handler_still_ends_with_its_stacks():
    """The watchdog's own CRITICAL line needs the handler's lock that the stalled loop holds (stdout a full pipe):
    it must not wait for it for ever."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(STUCK_IN_LOGGING)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert time.monotonic() - t0 < 30
    assert "logging blocks: ending the coordinator" in proc.stderr
    assert "in emit" in proc.stderr  # the stack that holds the loop


class _Loop:
    def call_later(self, delay, callback, *args):
        return None


@pytest.mark.parametrize("watcher_ran", [True, False])
def test_a_late_tick_is_a_stall_only_if_the_watching_thread_ran_meanwhile(caplog, watcher_ran):
    """After SIGCONT the loop's tick may run before the watching thread: a pause is then no stall to warn of."""
    dog = LoopWatchdog(3.0)
    now = time.monotonic()
    dog._stamp = now - 30.0
    dog._seen = now if watcher_ran else now - 30.0
    with caplog.at_level("INFO", logger="lockstep.coordinator.loop_watchdog"):
        dog._tick(_Loop())
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert bool(warned) == watcher_ran, caplog.text
    assert watcher_ran or "did not run for 30" in caplog.text


def test_a_stopped_watchdog_ends_nothing():
    proc, _ = run_script(timeout=1.0, block=0.0, after="dog.stop(); stuck_in_a_blocking_call(2.5)")
    assert proc.returncode == 0, proc.stderr
    assert "survived" in proc.stdout


def test_the_timeout_is_a_setting_of_the_coordinator_and_zero_turns_it_off():
    base = {"LOCKSTEP_GROUPS": "g0=a:1"}
    assert parse_config([], base).watchdog_timeout == 120.0
    assert parse_config(["--watchdog-timeout", "30"], base).watchdog_timeout == 30.0
    assert parse_config([], {**base, "LOCKSTEP_WATCHDOG_TIMEOUT_SECONDS": "0"}).watchdog_timeout == 0.0
    for bad in ("-1", "0.5", "nan"):
        with pytest.raises(SystemExit):
            parse_config(["--watchdog-timeout", bad], base)
    with pytest.raises(ValueError, match="watchdog_timeout"):
        CoordinatorConfig(groups={"g0": ("a:1",)}, watchdog_timeout=1.0)
    with pytest.raises(ValueError, match="longer than its tick"):
        LoopWatchdog(0.5)


def test_a_coordinator_arms_it_once_it_serves(tiny_llama, tmp_path):
    """The real `lockstep coordinator` (its ranks never come: it serves HTTP and gRPC while it waits for them)."""
    from lockstep.local_group import free_port

    log = tmp_path / "coordinator.log"
    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "lockstep.cli", "coordinator", "--group", f"g0=127.0.0.1:{free_port()}",
           "--model", str(tiny_llama), "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port",
           str(grpc_port), "--watchdog-timeout", "7"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "event-loop watchdog" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert "if its event loop stalls for 7 s" in log.read_text()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()
