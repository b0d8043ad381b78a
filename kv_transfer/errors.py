"""Errors raised by kv_transfer.

A failed transfer raises `TransferError` (or its `TransferTimeoutError`); either leaves the
channel broken, and the caller builds a new one. `LayoutMismatchError` is raised at the
handshake, before any channel exists, and is a `ValueError`: the two caches cannot be paired.
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer failed: peer gone, protocol violated, ticket refused or checksum wrong."""


class TransferTimeoutError(TransferError):
    """A transfer (or the channel set-up) did not finish before its deadline."""


class LayoutMismatchError(ValueError):
    """The two ends of a channel hold KV caches of different layouts."""


class ProtocolError(TransferError):
    """The peer sent something this side did not expect (bad frame, wrong message, wrong ids)."""
