"""What both front doors share: authentication, admission, the generation of one prompt, the
metrics it records (with its first token's trace: ``record_first_token``), and the registry of
live requests that ``Abort`` reaches.

Admission answers 503 while the cluster cannot serve (no live prefill or decode worker) and 429
once ``max_concurrent_requests`` are in flight through this gateway, both with Retry-After. It
asks the router for each prompt's predicted latencies (router/latency_forecast.py), recorded
beside the observed ones; with ``--admission slo`` a request predicted to miss its SLOs, or of
a key over its fair share of a loaded server, is refused with 429 and the predicted drain time
as Retry-After (router/gateway/slo_admission.py).

Shutting down: ``start_draining`` -> every new request is refused (503, Retry-After) while those
in flight run on -> ``wait_idle`` until they have ended or the drain timeout ->
``cut_off_in_flight`` ends the rest, each front door telling its client why (an error event,
response or status).

Requests are parsed (chat template, tokenizer) on a few threads of their own, off the event loop
that streams every client's tokens: a prompt at the character limit of a long-context model
takes the tokenizer about a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ParamSpec, Protocol, TypeVar

from router.cluster import SlotRestarts, WorkerStatus
from router.gateway.attainment_feedback import AttainmentFeedback
from router.gateway.auth import ApiKeys, Caller
from router.gateway.errors import ApiError, overloaded, unavailable
from router.gateway.first_token_log import FirstTokenLog
from router.gateway.limits import RequestLimits
from router.gateway.metrics import GatewayMetrics, SloTargets
from router.gateway.responses_store import ResponseStore
from router.gateway.served_model import ServedModel
from router.gateway.slo_admission import (
    AdmissionPolicy,
    KeyLoad,
    allowed_workers,
    in_slow_start,
    judge,
    worth_probing,
)
from router.gateway.spec import GenerationSpec
from router.gateway.text_stream import GenerationBackend, TextGeneration
from router.kv_aware import PrefixHitStats
from router.latency_forecast import Forecast
from router.latency_model import StepRatios

logger = logging.getLogger("router.gateway")
P = ParamSpec("P")
T = TypeVar("T")
# Threads that parse requests. A fast tokenizer encodes without the GIL, so two let a short
# prompt through while a long one is tokenized.
_PARSER_THREADS = 2
# A body up to this size is parsed on the event loop: its JSON and a prompt of a few thousand
# characters take well under a millisecond there, less than the hand-off to a parser thread
# and back (measured 2-3 ms on a busy 2-core gateway, in the first-token trace's parse hop).
INLINE_PARSE_MAX_BYTES = 8 << 10
# a 429's error code by admission's reason (the rest: slo_predicted_miss)
_REFUSAL_CODES = {"fair_share": "slo_fair_share", "warming_up": "slo_warming_up"}
_SHUTDOWN_RETRY_AFTER_S = 5  # Retry-After of the 503s a shutting-down server answers


class ClusterBackend(GenerationBackend, Protocol):
    """The cluster as the gateway uses it (``router.cluster.Cluster``)."""

    def worker_statuses(self) -> list[WorkerStatus]: ...

    def local_prefills(self) -> dict[str, int]: ...

    def worker_restarts(self) -> list[SlotRestarts]: ...

    def prefix_hit_stats(self) -> PrefixHitStats | None: ...

    def role_switches(self) -> dict[tuple[str, str], int]: ...

    def step_prediction_ratios(self) -> dict[str, StepRatios]: ...

    def is_ready(self) -> bool: ...

    def queue_is_full(self) -> bool: ...

    def forecast(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Forecast | None: ...

    def hold_placement(
        self, request_id: str, forecast: Forecast, num_prompt_tokens: int, num_sequences: int
    ) -> None: ...

    def observe_latencies(
        self,
        forecast: Forecast,
        ttft_s: float,
        first_gap_s: float | None,
        later_gap_s: float | None,
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class FrontDoorStamps:
    """Wall-clock times (``time.time()``) at which a request passed the front door's hops, for
    its prompts' first-token traces (``engine.messages.FirstTokenTrace``)."""

    arrived_at: float  # the route began, before the body was read
    parsed_at: float  # the body read, parsed and tokenized
    admitted_at: float  # admitted: an in-flight slot held


@dataclass(slots=True)
class LiveRequest:
    tenant_salt: str | None  # only the same tenant may abort it
    # each prompt's latencies as predicted at admission (None: no prediction), in prompt order
    forecasts: list[Forecast | None] = field(default_factory=list)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)  # set: end it now
    # why the server ended it unfinished (it was in flight when the drain at shutdown ran
    # out): the error its client is sent; None: it ends by itself or by an Abort call
    cut_off: ApiError | None = None
    # admitted as admission's probe (predicted to miss: slo_admission.worth_probing)
    probe: bool = False
    # admitted in a slow start (slo_admission.in_slow_start)
    slow_start: bool = False


def _steers(live: LiveRequest) -> bool:
    """Whether a request's outcome tells admission something: it was admitted by its
    forecasts, not in a slow start (whose requests were admitted by their count, on a model
    still holding the quiet start-up profile), not as the probe."""
    forecasts = live.forecasts
    return (
        bool(forecasts)
        and all(f is not None for f in forecasts)
        and not live.slow_start
        and not live.probe
    )


class Gateway:
    def __init__(
        self,
        backend: ClusterBackend,
        model: ServedModel,
        limits: RequestLimits,
        keys: ApiKeys,
        slo: SloTargets | None = None,
        first_token_log: FirstTokenLog | None = None,
        admission: AdmissionPolicy | None = None,
        responses: ResponseStore | None = None,
    ) -> None:
        """``first_token_log``: where each prompt's first-token trace is written as a JSON line
        (None: traces go to the metrics only); ``admission``: refusals by predicted latency
        (default: none); ``responses``: the /v1/responses kept (default: none)."""
        self.backend = backend
        self.slo = slo or SloTargets()
        self.admission = admission or AdmissionPolicy()
        # what admitted requests made of their SLOs, steering admission's limits
        self.feedback = AttainmentFeedback(self.admission.attainment)
        self.model = model
        self.limits = limits
        self.responses = responses if responses is not None else ResponseStore()
        self.keys = keys
        self.metrics = GatewayMetrics(
            backend.worker_statuses,
            backend.local_prefills,
            backend.worker_restarts,
            self.slo,
            {
                "model_name": model.name,
                "quantization": model.quantization or "none",
                "kv_cache_dtype": model.kv_cache_dtype,
            },
            prefix_hit_stats=backend.prefix_hit_stats,
            role_switches=backend.role_switches,
            step_prediction_ratios=backend.step_prediction_ratios,
        )
        self.metrics.admission_scale.set_function(lambda: self.feedback.scale)
        self.num_in_flight = 0
        # requests finished since none was in flight (a slow start's cap grows by them)
        self._finished_since_idle = 0
        self._in_flight_by_key: Counter[str | None] = Counter()  # by the key's tenant salt
        self._probe: str | None = None  # the request in flight as admission's probe
        self.draining = False  # shutting down: new requests are refused
        self._live: dict[str, LiveRequest] = {}
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._parsers = ThreadPoolExecutor(_PARSER_THREADS, thread_name_prefix="gateway-parse")
        self._first_token_log = first_token_log

    async def parse(
        self, body_bytes: int | None, parse: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """``parse(*args, **kwargs)`` for a body of ``body_bytes`` (None: unknown): a small one
        at once, a larger one on a parser thread, so the event loop streams on meanwhile."""
        if body_bytes is not None and body_bytes <= INLINE_PARSE_MAX_BYTES:
            return parse(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._parsers, functools.partial(parse, *args, **kwargs))

    def close(self) -> None:
        self._parsers.shutdown(wait=False, cancel_futures=True)
        if self._first_token_log is not None:
            self._first_token_log.close()

    def authenticate(self, authorization: str | None, *, counted: bool = True) -> Caller:
        """The caller the key names. A refusal is counted in ``pdserve:requests_total`` unless
        ``counted`` is False: that counts generation requests, not /metrics or model polls."""
        try:
            return self.keys.authenticate(authorization)
        except ApiError:
            if counted:
                self.metrics.requests.labels(status="unauthorized").inc()
            raise

    def count_invalid(self) -> None:
        self.metrics.requests.labels(status="invalid").inc()

    @contextlib.contextmanager
    def admitted(
        self,
        request_id: str,
        caller: Caller,
        specs: Sequence[GenerationSpec] = (),
        prompt_ids: Sequence[str] | None = None,
    ) -> Iterator[LiveRequest]:
        """Hold one of the gateway's in-flight slots while a request of prompts ``specs`` runs;
        its prompts' predicted latencies go with it. ``prompt_ids``: the ids the prompts will
        be generated under (default ``<request_id>-<index>``)."""
        self.check_admission()
        if prompt_ids is None:
            prompt_ids = [f"{request_id}-{i}" for i in range(len(specs))]
        forecasts, probe, slow_start = self._admit_by_forecast(caller, specs, prompt_ids)
        if probe:
            self._probe = request_id
        key = caller.tenant_salt
        self.num_in_flight += 1
        self._in_flight_by_key[key] += 1
        self._idle.clear()
        live = self._live[request_id] = LiveRequest(
            key, forecasts, probe=probe, slow_start=slow_start
        )
        try:
            yield live
        finally:
            self.num_in_flight -= 1
            self._in_flight_by_key[key] -= 1
            if not self._in_flight_by_key[key]:
                del self._in_flight_by_key[key]
            del self._live[request_id]
            if self._probe == request_id:
                self._probe = None
            if not self.num_in_flight:
                self._idle.set()
                self._finished_since_idle = 0

    def _admit_by_forecast(
        self, caller: Caller, specs: Sequence[GenerationSpec], prompt_ids: Sequence[str]
    ) -> tuple[list[Forecast | None], bool, bool]:
        """Each prompt's predicted latencies, whether the request goes in as the probe (one at
        a time: slo_admission.worth_probing) and whether in a slow start; ApiError(429) when
        ``--admission slo`` refuses the request by them (counted by reason). Admitted, each
        prompt counts towards its best placement at once (``hold_placement``), so the next
        prompts admitted before it is routed are predicted behind it: a burst parsed in one
        turn of the event loop is not all admitted on the same empty queue."""
        forecasts = [self._forecast(spec) for spec in specs]
        keys = KeyLoad(
            self._in_flight_by_key[caller.tenant_salt],
            self.num_in_flight,
            len(self._in_flight_by_key) + (caller.tenant_salt not in self._in_flight_by_key),
            self._finished_since_idle,
        )
        max_tokens = max((self._max_tokens(spec) for spec in specs), default=1)
        refusal = judge(
            forecasts,
            max_tokens,
            self.slo.ttft_s,
            self.slo.tpot_s,
            self.admission,
            keys,
            self.feedback.scale,
        )
        probe = (
            refusal is not None
            and refusal.reason in ("ttft", "tpot")
            and self._probe is None
            and worth_probing(forecasts, self.slo.ttft_s, self.slo.tpot_s, self.admission)
        )
        if probe:
            refusal = None
            self.metrics.admission_probes.inc()
        if refusal is not None:
            self.metrics.requests.labels(status="rejected").inc()
            self.metrics.admission_refusals.labels(reason=refusal.reason).inc()
            raise ApiError(
                429,
                refusal.message,
                "rate_limit_error",
                code=_REFUSAL_CODES.get(refusal.reason, "slo_predicted_miss"),
                retry_after_s=refusal.retry_after_s,
            )
        for prompt_id, spec, forecast in zip(prompt_ids, specs, forecasts, strict=True):
            if forecast is not None:
                self.metrics.predicted(forecast)
                if self.admission.mode == "slo":
                    self.backend.hold_placement(
                        prompt_id, forecast, len(spec.prompt_token_ids), spec.params.n
                    )
        return forecasts, probe, in_slow_start(forecasts, keys.finished_since_idle)

    def check_admission(self) -> None:
        """ApiError(503) while the server shuts down or the cluster cannot serve, ApiError(429)
        when the gateway is full."""
        if self.draining:
            self.metrics.requests.labels(status="rejected").inc()
            raise _shutting_down(
                "the server is shutting down and takes no new requests; retry on another "
                "replica or once it is back"
            )
        if not self.backend.is_ready():
            self.metrics.requests.labels(status="rejected").inc()
            raise unavailable("no live prefill or decode worker can take the request now")
        if self.backend.queue_is_full():
            self.metrics.requests.labels(status="rejected").inc()
            raise unavailable(
                "every worker of a pool is slow to answer and the router's queue of requests "
                "waiting for one is full; retry later"
            )
        if self.num_in_flight >= self.limits.max_concurrent_requests:
            self.metrics.requests.labels(status="rejected").inc()
            raise overloaded(
                f"the server is at its limit of {self.limits.max_concurrent_requests} "
                "concurrent requests; retry later"
            )

    def _forecast(self, spec: GenerationSpec) -> Forecast | None:
        """A prompt's predicted latencies; None if the prediction failed (a bug: logged, and
        the request is admitted as without a forecast)."""
        try:
            return self.backend.forecast(
                spec.prompt_token_ids,
                self._max_tokens(spec),
                cache_salt=spec.cache_salt,
                priority=spec.priority,
            )
        except Exception:
            logger.exception("forecasting a prompt's latencies failed")
            return None

    def _max_tokens(self, spec: GenerationSpec) -> int:
        """The most tokens a prompt may generate: its max_tokens, else the context left."""
        if spec.params.max_tokens is not None:
            return spec.params.max_tokens
        return max(1, self.model.max_model_len - len(spec.prompt_token_ids))

    def start_draining(self) -> None:
        """Refuses every new request from now on; those in flight run on. /health says 503."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no request is in flight: True then, False if ``timeout_s`` passed first."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def cut_off_in_flight(self, reason: str) -> int:
        """Ends every request in flight now, each client told ``reason`` in a 503 error (as a
        stream's last event, the response, or the call's status); returns how many."""
        for live in self._live.values():
            live.cut_off = _shutting_down(reason)
            live.aborted.set()
        return len(self._live)

    def abort(self, request_id: str, caller: Caller) -> bool:
        """Abort a live request of the caller's tenant; False when there is none."""
        live = self._live.get(request_id)
        if live is None or live.tenant_salt != caller.tenant_salt:
            return False
        live.aborted.set()
        return True

    def generation(
        self,
        spec: GenerationSpec,
        request_id: str,
        arrived_at: float,
        forecast: Forecast | None = None,
    ) -> TextGeneration:
        """One prompt of an admitted request that reached the front door at ``arrived_at``
        (``time.monotonic()``, taken before its body was read and parsed), with its latencies
        as predicted at admission; under ``--admission slo`` it is placed among the workers
        predicted to make its SLOs (router/gateway/slo_admission.py)."""
        self.metrics.prompts.inc()
        return TextGeneration(
            self.backend,
            self.model.tokenizer,
            spec,
            request_id,
            timing=self.metrics,
            arrived_at=arrived_at,
            forecast=forecast,
            allowed=allowed_workers(forecast, self.slo.ttft_s, self.slo.tpot_s, self.admission),
        )

    def record_ended(self, generations: Sequence[TextGeneration], live: LiveRequest) -> None:
        """A request that ended without an error: counted "aborted" if an Abort call cut it
        short, else "ok" with each prompt's latencies and goodput; admitted by its forecasts
        (not as the probe), whether it met its SLOs steers admission (``feedback``)."""
        if live.aborted.is_set():
            self.record_outcome("aborted")
            return
        self._finished_since_idle += 1
        finished = [generation.finished() for generation in generations]
        met = self.metrics.finished(finished)
        if self.admission.mode == "slo" and _steers(live) and met is not None:
            self.feedback.observe(met)
        for prompt in finished:  # what the forecast missed, for its path corrections
            ttft = prompt.time_to_first_token
            if prompt.forecast is not None and ttft is not None:
                self.backend.observe_latencies(
                    prompt.forecast, ttft, prompt.first_gap_s, prompt.later_gap_s
                )
        self.record_outcome("ok")

    def record_first_token(
        self, generation: TextGeneration, front: FrontDoorStamps, written_at: float | None
    ) -> bool:
        """Record a prompt's first-token trace, completed with the front door's stamps and
        ``written_at`` (when the first chunk after the token was written; None: a whole
        response), in the metrics and the trace log. False while its first token has not
        come (or came untraced), and nothing is recorded."""
        trace = generation.first_token_trace
        if trace is None:
            return False
        trace = dataclasses.replace(
            trace,
            arrived_at=front.arrived_at,
            parsed_at=front.parsed_at,
            admitted_at=front.admitted_at,
            written_at=written_at,
        )
        self.metrics.first_token_traced(trace)
        if self._first_token_log is not None:
            self._first_token_log.write(generation.request_id, trace, generation.forecast)
        return True

    def record_outcome(self, status: str) -> None:
        self.metrics.requests.labels(status=status).inc()


def _shutting_down(message: str) -> ApiError:
    return ApiError(
        503,
        message,
        "service_unavailable",
        code="shutting_down",
        retry_after_s=_SHUTDOWN_RETRY_AFTER_S,
    )


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
