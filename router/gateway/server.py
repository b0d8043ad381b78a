"""The front doors' servers: HTTP (uvicorn) and gRPC (grpc.aio) on one event loop.

``GatewayServer`` runs both on a background thread so that ``pdserve serve`` and tests drive
it alike: ``start()`` returns once both listen (ports resolved when 0 was asked for),
``drain()`` refuses new requests and lets those in flight end (cutting off the rest after its
timeout), ``stop()`` closes them. Binding follows the security model: without API keys only a
loopback address is allowed unless the operator says ``--allow-unauthenticated``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import uvicorn

from router.gateway.http_app import build_http_app
from router.gateway.service import Gateway
from router.local_ray import is_loopback

# after a drain cuts requests off: how long their clients have to be sent why
_CUT_OFF_FLUSH_S = 2.0


@dataclass(frozen=True, slots=True)
class DrainOutcome:
    num_in_flight: int  # requests in flight when the drain began
    num_cut_off: int  # of those, still running when it ended: ended with an error
    cut_short: bool  # ended before its timeout because told to stop at once


def check_bind_address(host: str, has_api_keys: bool, allow_unauthenticated: bool) -> None:
    """Refuse to expose a server without API keys beyond this machine, unless told to."""
    if has_api_keys or allow_unauthenticated or is_loopback(host):
        return
    raise ValueError(
        f"refusing to listen on {host} without an API key: pass --api-key / --api-key-file, "
        "or --allow-unauthenticated to serve anyone who can reach this address"
    )


class GatewayServer:
    def __init__(self, gateway: Gateway, host: str, http_port: int, grpc_port: int | None) -> None:
        self.gateway = gateway
        self.host = host
        self.http_port = http_port  # the bound port once started
        self.grpc_port = grpc_port  # None: no gRPC server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gateway", daemon=True)
        self._uvicorn: uvicorn.Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self._grpc: object | None = None

    @property
    def http_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.grpc_port}"

    def start(self) -> None:
        self._thread.start()
        started: Future[None] = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        started.result(timeout=60)

    def drain(self, timeout_s: float, stop_now: threading.Event) -> DrainOutcome:
        """Refuses new requests (503) and waits up to ``timeout_s`` for those in flight to end,
        less if ``stop_now`` is set meanwhile; then ends the rest, each client told why."""
        if not self._thread.is_alive():  # never started: nothing to drain
            return DrainOutcome(0, 0, cut_short=False)
        hurry = asyncio.Event()  # stop_now, on the server's loop
        drained = asyncio.run_coroutine_threadsafe(self._drain(timeout_s, hurry), self._loop)
        while True:
            try:
                return drained.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if stop_now.is_set():
                    self._loop.call_soon_threadsafe(hurry.set)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self.gateway.close()

    async def _start(self) -> None:
        if self.grpc_port is not None:
            from router.gateway.grpc_service import build_grpc_server

            grpc_server, self.grpc_port = build_grpc_server(
                self.gateway, f"{self.grpc_target.rsplit(':', 1)[0]}:{self.grpc_port}"
            )
            await grpc_server.start()
            self._grpc = grpc_server
        sock = _bound_socket(self.host, self.http_port)
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(
            build_http_app(self.gateway),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._uvicorn = uvicorn.Server(config)
        self._serving = self._loop.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._serving.done():  # failed to start: raise its error
                self._serving.result()
            await asyncio.sleep(0.01)

    async def _drain(self, timeout_s: float, hurry: asyncio.Event) -> DrainOutcome:
        gateway = self.gateway
        gateway.start_draining()
        num_in_flight = gateway.num_in_flight
        idle = asyncio.ensure_future(gateway.wait_idle(timeout_s))
        hurried = asyncio.ensure_future(hurry.wait())
        await asyncio.wait({idle, hurried}, return_when=asyncio.FIRST_COMPLETED)
        cut_short = not idle.done()
        idle.cancel()
        hurried.cancel()
        if cut_short:
            reason = "the server is shutting down and was told to stop at once"
        else:
            reason = f"the server is shutting down and its drain timeout of {timeout_s:g} s ran out"
        num_cut_off = gateway.cut_off_in_flight(reason)
        if num_cut_off:
            await gateway.wait_idle(_CUT_OFF_FLUSH_S)
        return DrainOutcome(num_in_flight, num_cut_off, cut_short)

    async def _stop(self) -> None:
        if self._uvicorn is not None and self._serving is not None:
            self._uvicorn.should_exit = True
            await self._serving
        if self._grpc is not None:
            await self._grpc.stop(grace=2)  # type: ignore[attr-defined]


def _bound_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it. asyncio sets TCP_NODELAY itself only on sockets made
    # with proto=IPPROTO_TCP, which this one is not; without it, Nagle's algorithm holds each
    # stream's small writes for the client's delayed ACK (the first token of a request on a
    # reused keep-alive connection waits for it).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
