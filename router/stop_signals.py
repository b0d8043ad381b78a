"""SIGINT and SIGTERM as a server's stop requests: while it starts, either one interrupts the
start as Ctrl-C does; once it serves, the first asks it to drain and stop, a second to end the
drain at once. A last-resort timer ends the process if stopping hangs."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def interrupt_on_stop_signals() -> None:
    """Makes SIGTERM, like SIGINT, raise KeyboardInterrupt in the main thread, so that a stop
    asked for during start-up still runs the clean-up on the way out."""
    for signum in _SIGNALS:
        signal.signal(signum, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


class StopSignals:
    """Counts SIGINT and SIGTERM from ``install()`` on: ``first`` is set by the first of them
    (drain, then stop), ``second`` by any later one (stop now)."""

    def __init__(self) -> None:
        self.first = threading.Event()
        self.second = threading.Event()

    def install(self) -> None:
        for signum in _SIGNALS:
            signal.signal(signum, self._on_signal)

    def wait_first(self) -> None:
        """Blocks until the first stop signal (waking to let signal handlers run)."""
        while not self.first.wait(0.5):
            pass

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.first.is_set():
            self.second.set()
        self.first.set()


def exit_if_stuck(timeout_s: float) -> threading.Timer:
    """Starts a daemon timer that ends the process with status 1 if it is still running
    ``timeout_s`` from now (a stop that hangs); it dies with the process otherwise."""
    timer = threading.Timer(timeout_s, _exit_now, args=(timeout_s,))
    timer.daemon = True
    timer.start()
    return timer


def _exit_now(timeout_s: float) -> None:
    print(f"pdserve: stopping took more than {timeout_s:g} s; exiting now", flush=True)
    sys.stderr.flush()
    os._exit(1)
