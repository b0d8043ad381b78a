"""How soon a thread that holds the GIL hands it to one that waits, in the gateway and workers.

A token crosses several threads in each process: in a worker, an actor thread takes the request
while the engine thread steps, and the output stream's thread carries its batch out; in the
gateway, the output pump's thread hands it to the event loop, which writes it. A thread woken
by I/O (a Ray reply, a socket) waits for the GIL until the thread running Python gives it up,
which CPython asks for after the switch interval: 5 ms by default, against steps of a few ms on
CPU. At 1 ms each hand-off costs at most a millisecond, and a thread computing in C (torch,
the tokenizer) holds no GIL to give up anyway.
"""

from __future__ import annotations

import sys

SWITCH_INTERVAL_S = 0.001


def hand_off_the_gil_sooner() -> None:
    """This process's threads take turns on the GIL every ``SWITCH_INTERVAL_S``."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
