"""A prefill worker's handle on a decode worker in the same process, for tests that run the
workers without Ray.

The Ray launcher gives prefill workers actor handles instead (router/actors.RayDecodePeer); both
answer with futures, so the prefill worker's hand-off code is the same either way.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from decode_worker.worker import DecodeWorker
from engine.messages import HandoffCall

T = TypeVar("T")


class LocalDecodePeer:
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker
        self._executor = ThreadPoolExecutor(8, thread_name_prefix="decode-peer")

    def send(self, call: HandoffCall[T]) -> Future[T]:
        return self._executor.submit(call.run_on, self.worker)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def answered(value: T) -> Future[T]:
    """A future that holds ``value`` already: a peer's answer made up by a test."""
    answer: Future[T] = Future()
    answer.set_result(value)
    return answer
