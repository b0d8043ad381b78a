"""Every message that crosses a process boundary, defined once. Torch-free: the router, both
workers and the engine import it.

  requests    -- router -> worker: ``GenerateRequest``; worker -> gateway: ``TokenEvent``s in
                 one ``OutputBatch`` per step, ``RequestFailure``s
  first_token -- worker -> gateway, on a request's first ``TokenEvent``: its
                 ``FirstTokenTrace``, the times it passed each hop (router and gateway add theirs)
  load        -- worker -> router: ``WorkerLoad`` with its ``WorkerCounters`` and the
                 ``StepTiming``s and ``TransferTiming``s since its last report
  kv_events   -- worker -> router: ``KVEventsReply`` to the router's ``KVCursor``, the blocks its
                 prefix cache stored and removed (``KVEventBatch``es of ``KVBlocksEvent``s) or
                 a ``KVCacheSnapshot`` of them
  handoff     -- prefill worker -> decode worker, directly: the hand-off calls
                 (``ReserveBlocks`` ... ``ReceiveKV``, carrying the ``PrefillResult``) and their
                 answers (``Reservation``)
The KV transfer's own messages (``TransferTicket``, ``ChannelRendezvous``) live in
``kv_transfer.messages``, which depends on nothing of the engine; the hand-off carries them.
"""

from engine.messages.first_token import FirstTokenTrace
from engine.messages.handoff import (
    AdmitWithoutKV,
    CancelReservation,
    DecodePeer,
    GetLocality,
    HandoffCall,
    HandoffReceiver,
    JoinChannel,
    LendPrefix,
    OpenLendChannel,
    PinChannel,
    PrefillResult,
    ReceiveKV,
    Reservation,
    ReserveBlocks,
    ReturnLent,
    SampleStart,
    SendLentBlocks,
)
from engine.messages.kv_events import (
    KVBlocksEvent,
    KVCacheSnapshot,
    KVCursor,
    KVEventBatch,
    KVEventsReply,
)
from engine.messages.load import (
    BlockWait,
    StepTiming,
    TransferTiming,
    WorkerCounters,
    WorkerLoad,
)
from engine.messages.requests import GenerateRequest, OutputBatch, RequestFailure, TokenEvent

__all__ = [
    "AdmitWithoutKV",
    "BlockWait",
    "CancelReservation",
    "DecodePeer",
    "FirstTokenTrace",
    "GenerateRequest",
    "GetLocality",
    "HandoffCall",
    "HandoffReceiver",
    "JoinChannel",
    "KVBlocksEvent",
    "KVCacheSnapshot",
    "KVCursor",
    "KVEventBatch",
    "KVEventsReply",
    "LendPrefix",
    "OpenLendChannel",
    "OutputBatch",
    "PinChannel",
    "PrefillResult",
    "ReceiveKV",
    "RequestFailure",
    "Reservation",
    "ReserveBlocks",
    "ReturnLent",
    "SampleStart",
    "SendLentBlocks",
    "StepTiming",
    "TokenEvent",
    "TransferTiming",
    "WorkerCounters",
    "WorkerLoad",
]
