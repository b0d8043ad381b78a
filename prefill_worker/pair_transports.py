"""Which transport a prefill worker's channel to each decode worker uses.

The listening (prefill) side picks; the decode side joins whatever the rendezvous names. With
``--kv-transport auto`` the pick is per pair (`kv_transfer.policy.transport_between`): shm or
cuda_ipc when the decode worker shares this worker's host or GPU, gloo or nccl otherwise. A
pair whose local transport could not be set up (a full /dev/shm, say) uses the network one
from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kv_transfer.locality import locality_of
from kv_transfer.policy import Locality, network_transport, transport_between

logger = logging.getLogger(__name__)


class PairTransports:
    """Not thread-safe: the prefill worker calls it under its channel lock."""

    def __init__(self, configured: str, device: torch.device) -> None:
        self.configured = configured
        self._device_type = device.type
        self._here = locality_of(device) if configured == "auto" else None
        self._network = network_transport(device.type)
        self._network_only: set[str] = set()  # decode workers whose local transport failed

    def choose(self, decode_worker_id: str, peer_locality: Callable[[], Locality]) -> str:
        """The transport of a new channel to ``decode_worker_id``; ``peer_locality`` is asked
        only when the pick depends on it."""
        if self._here is None:
            return self.configured
        if decode_worker_id in self._network_only:
            return self._network
        return transport_between(self._device_type, self._here, peer_locality())

    def fall_back(self, decode_worker_id: str, failed: str, error: BaseException) -> str | None:
        """After ``failed`` could not set a channel up: the transport to try instead, or None
        (the transport was not picked here, or it already was the network one)."""
        if self._here is None or failed == self._network:
            return None
        logger.warning(
            "KV channel to %s over %s failed to set up (%s); that pair uses %s from now on",
            decode_worker_id,
            failed,
            error,
            self._network,
        )
        self._network_only.add(decode_worker_id)
        return self._network
