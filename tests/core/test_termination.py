"""A daemon's main thread waiting for SIGTERM stops on it even when the kernel hands the signal to
another thread (grpc's, the pool's): Python's handler is then only pending, and a main thread
blocked on a lock without a timeout would never run it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_WAITER = textwrap.dedent(
    """
    import signal, threading, time
    from shardrouter.core.termination import TerminationSignals

    signals = TerminationSignals(starting=False)

    def deliver_to_this_thread() -> None:
        time.sleep(0.3)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    threading.Thread(target=deliver_to_this_thread).start()
    {wait}
    print("stopped", flush=True)
    """
)


def _run(wait: str) -> subprocess.CompletedProcess[str] | None:
    try:
        command = [sys.executable, "-c", _WAITER.format(wait=wait)]
        return subprocess.run(command, check=False, capture_output=True, text=True, timeout=3)
    except subprocess.TimeoutExpired:
        return None


def test_a_sigterm_delivered_to_another_thread_stops_the_waiting_main_thread() -> None:
    done = _run("signals.wait()")
    assert done is not None and done.returncode == 0 and done.stdout == "stopped\n", done


def test_an_untimed_wait_on_the_event_alone_misses_it() -> None:
    """What `wait` is for: the same signal, and the main thread blocked on the event never returns."""
    assert _run("signals.stop.wait()") is None
