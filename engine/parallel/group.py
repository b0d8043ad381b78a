"""The collectives a tensor-parallel worker's ranks run together, behind one small interface.

Lifecycle of a group of N ranks: rank 0 hosts a TCPStore on (host, port) → every rank joins
(``ProcessGroupRanks.join``: a torch process group built from that store, without a global
world) → one all-reduce proves every rank is in (and makes NCCL build its communicator) →
collectives, each waited on with the group's deadline → ``close`` aborts the group.

gloo runs on CPU (what CI runs), NCCL on CUDA; both take the same code path, only the backend
and the tensors' device differ. A wait that outlives the deadline raises ``TimeoutError``
naming the operation; a peer that is gone raises ``ConnectionError``. No collective waits
forever. On NCCL a wait with a deadline holds the CPU until the collective is done (the
price of the bound: no overlap of the host with a collective). An NCCL rank sets its CUDA
device before it joins. ``SingleRank`` is the group of one: every operation returns its input, and no
torch.distributed object exists.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import time
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
# NCCL's watchdog would take the whole process down on an error it sees (a dead peer, a comm
# aborted by a timed-out wait); 0 leaves the error to the wait that carries the deadline.
NCCL_ERROR_HANDLING_ENV = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
_STORE_PREFIX = "tensor-parallel"
_MIN_WAIT = timedelta(milliseconds=1)  # torch reads a wait of 0 ms as a wait without a timeout


class TensorParallelGroup(Protocol):
    """The ranks of one tensor-parallel worker; every rank calls each operation in the same order."""

    rank: int  # this process's rank, 0 .. size - 1; rank 0 schedules
    size: int  # number of ranks

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks in place and returns it."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's ``tensor`` along its last dim, in rank order."""
        ...

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrites ``tensor`` in place with rank 0's and returns it."""
        ...

    def broadcast_object(self, obj: object | None) -> object:
        """Returns rank 0's ``obj`` (pickled) on every rank; the others pass None."""
        ...

    def min_int(self, value: int) -> int:
        """The least ``value`` over the ranks."""
        ...

    def close(self) -> None: ...


class SingleRank:
    """The group of one rank: every collective is the identity."""

    def __init__(self) -> None:
        self.rank = 0
        self.size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: object | None) -> object:
        return obj

    def min_int(self, value: int) -> int:
        return value

    def close(self) -> None:
        pass


class ProcessGroupRanks:
    """N ranks over a torch process group of their own (gloo on CPU, NCCL on CUDA).

    Tensors passed in must live on ``device`` (the CPU for gloo, this process's current CUDA
    device for NCCL).
    """

    def __init__(
        self,
        group: Any,
        store: dist.Store,
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self._group = group
        self._store = store  # rank 0's store serves the others as long as the group lives
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout_s = timeout_s  # the bound on each wait

    @classmethod
    def join(
        cls, backend: str, host: str, port: int, rank: int, size: int, timeout_s: float
    ) -> ProcessGroupRanks:
        """Joins the group whose store rank 0 hosts on (host, port), within ``timeout_s``."""
        _check_membership(backend, rank, size, timeout_s)
        timeout = timedelta(seconds=timeout_s)
        what = f"rank {rank} of {size} joining the tensor-parallel group at {host}:{port}"
        started = time.monotonic()
        try:
            store = dist.TCPStore(
                host, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
            )
            prefixed = dist.PrefixStore(_STORE_PREFIX, store)
            group, device = _make_group(backend, prefixed, rank, size, host, timeout)
        except RuntimeError as exc:
            raise _wait_error(what, exc, time.monotonic() - started >= timeout_s) from exc
        ranks = cls(group, store, rank, size, device, timeout_s)
        ranks._all_reduce_op(torch.zeros(1, device=device), dist.ReduceOp.SUM, what)
        return ranks

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce_op(tensor, dist.ReduceOp.SUM, "all_reduce")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(self._live().allgather([parts], [tensor]), "all_gather")
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        self._wait(self._live().broadcast([tensor], options), "broadcast")
        return tensor

    def broadcast_object(self, obj: object | None) -> object:
        payload = pickle.dumps(obj) if self.rank == 0 else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.broadcast(length)
        if self.rank == 0:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(data)
        return pickle.loads(data.cpu().numpy().tobytes())

    def min_int(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self._all_reduce_op(tensor, dist.ReduceOp.MIN, "min_int").item())

    def close(self) -> None:
        """Aborts the group; this rank's collectives fail from now on. Idempotent."""
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(RuntimeError):
                group.abort()

    def _all_reduce_op(self, tensor: torch.Tensor, op: Any, what: str) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._wait(self._live().allreduce([tensor], options), what)
        return tensor

    def _live(self) -> Any:
        if self._group is None:
            raise ConnectionError(f"rank {self.rank}'s tensor-parallel group is closed")
        return self._group

    def _wait(self, work: Any, what: str) -> None:
        started = time.monotonic()
        try:
            work.wait(max(timedelta(seconds=self.timeout_s), _MIN_WAIT))
        except RuntimeError as exc:
            expired = time.monotonic() - started >= self.timeout_s
            raise _wait_error(f"rank {self.rank} of {self.size}: {what}", exc, expired) from exc


def free_port(host: str) -> int:
    """A port on ``host`` that nothing listens on now, for rank 0's store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _check_membership(backend: str, rank: int, size: int, timeout_s: float) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"tensor-parallel backend {backend!r} is not one of {BACKENDS}")
    if size < 1:
        raise ValueError(f"tensor_parallel_size {size} must be at least 1")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} must be in 0 .. {size - 1} (tensor_parallel_size {size})")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s {timeout_s} must be positive")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise RuntimeError("the nccl backend needs CUDA and a torch build with NCCL")


def _make_group(
    backend: str, store: dist.Store, rank: int, size: int, host: str, timeout: timedelta
) -> tuple[Any, torch.device]:
    """The process group and the device its tensors live on; gloo listens on ``host``."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, size, options), torch.device("cpu")
    nccl = dist.ProcessGroupNCCL
    nccl_options = nccl.Options()
    nccl_options._timeout = timeout
    os.environ.setdefault(*NCCL_ERROR_HANDLING_ENV)  # read by each group as it is built
    device = torch.device("cuda", torch.cuda.current_device())
    return nccl(store, rank, size, nccl_options), device


def _wait_error(what: str, exc: RuntimeError, expired: bool) -> OSError:
    """TimeoutError when the deadline passed, ConnectionError when a peer is gone."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if expired or "timed out" in message.lower() or "timeout" in message.lower():
        return TimeoutError(f"{what}: {message}")
    return ConnectionError(f"{what}: {message}")
