"""The MegaScope UI server: static page + one WebSocket per tab (FastAPI on uvicorn).

Safety: binds 127.0.0.1 unless told otherwise; any other address needs an access token,
checked (constant time) on the page and on every WebSocket. On a loopback bind the Host
header must be a loopback name (no DNS rebinding); a WebSocket whose Origin is not this
server's is refused. Client frames are parsed by protocol.py only: nothing from a client is
evaluated, executed or unpickled.

Tabs: the first tab drives (generate, perturb, train controls), later ones watch; when the
driver leaves, the oldest watcher drives. Each tab says which layer it shows (`view`); only
the driver's view reruns the model (a refill), a watcher's layer waits for the next generation.

Errors: a refused request gets its ProtocolError code and message; any other exception is
logged here with its traceback and the tab gets code "internal" only (exception text can
name paths and internals the page has no business seeing).

Outbound: the model's thread only posts small records (outbox.py) with one
call_soon_threadsafe per step; each tab has its own backlog, which its sender task takes
whole whenever the socket is ready, coalesces (outbox.coalesce: tokens all kept and batched,
view updates merged or dropped when stale) and encodes. So a slow tab gets fewer, larger
frames and never slows the model; one whose backlog still passes MAX_PENDING is dropped.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import logging
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import HTMLResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from starlette.websockets import WebSocketDisconnect

from megatronapp.scope.capture import CaptureLimitError
from megatronapp.scope_ui import protocol as P
from megatronapp.scope_ui.outbox import coalesce, encode

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
INTERNAL_ERROR = P.Error(code="internal", message="internal server error; see the server log")
log = logging.getLogger(__name__)
MAX_PENDING = 20000  # records waiting for one tab, after coalescing, before it is dropped


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_token(host: str, token: str | None) -> str | None:
    """The token a server on `host` requires: None on loopback unless given; generated when a
    non-loopback bind has none."""
    if token is not None and not token:
        raise ValueError("--token must not be empty")
    if is_loopback(host):
        return token
    return token or secrets.token_urlsafe(24)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    token: str | None = None
    limits: P.Limits = field(default_factory=P.Limits)

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and not self.token:
            raise ValueError(f"binding {self.host} (not loopback) needs an access token")


class _Client:
    def __init__(self, ws, limits: P.Limits):
        self.ws, self.pending, self.wake = ws, [], asyncio.Event()
        self.layer, self.head = 0, 0  # what the tab shows (`view`)
        self.frames_sent = 0
        self.limiter = P.RateLimiter(limits.max_messages_per_s, limits.burst, time.monotonic())


class ClientSink:
    """Posts records to one tab only (a refill's frames)."""

    def __init__(self, hub: Hub, client: _Client):
        self.hub, self.client = hub, client

    def post(self, items: list) -> None:
        self.hub.post(items, self.client)


class Hub:
    """Connected tabs, the driver, and the one worker thread that touches the model."""

    def __init__(self, backend, limits: P.Limits):
        self.backend, self.limits = backend, limits
        self.clients: list[_Client] = []
        self.driver: _Client | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scope-model")
        self.busy = False
        decode = getattr(backend, "decode_token", str)
        self.decode = functools.lru_cache(maxsize=1 << 16)(decode)  # token texts, on the loop thread

    # -- outbound (thread-safe) ------------------------------------------------------------
    def broadcast(self, msg) -> None:
        self.post([msg])

    def send(self, client: _Client, msg) -> None:
        self.post([msg], client)

    def post(self, items: list, client: _Client | None = None) -> None:
        """Queue records (outbox.py) or messages for one tab or all; callable from any thread."""
        if self.loop is None or not items:
            return
        try:
            self.loop.call_soon_threadsafe(self._enqueue, client, items)
        except RuntimeError:  # loop closed: server shutting down
            pass

    def layers_shown(self) -> list[int]:
        """The layers the connected tabs show (what a generation captures)."""
        return sorted({c.layer for c in list(self.clients)}) or [0]

    def _enqueue(self, client, items: list) -> None:
        for c in [client] if client is not None else list(self.clients):
            c.pending.extend(items)
            if len(c.pending) > MAX_PENDING:
                c.pending = coalesce(c.pending, c.layer)
            if len(c.pending) > MAX_PENDING:
                self.leave(c)
                asyncio.ensure_future(c.ws.close(code=1013))
            c.wake.set()

    # -- membership ------------------------------------------------------------------------
    def join(self, ws) -> _Client:
        client = _Client(ws, self.limits)
        self.clients.append(client)
        if self.driver is None:
            self.driver = client
        return client

    def leave(self, client: _Client) -> None:
        if client in self.clients:
            self.clients.remove(client)
        if self.driver is client:
            self.driver = self.clients[0] if self.clients else None
            if self.driver is not None:
                self.send(self.driver, P.Role(role="driver"))

    def role(self, client: _Client) -> str:
        return "driver" if client is self.driver else "watcher"

    def welcome(self, client: _Client) -> P.Welcome:
        return P.Welcome(
            mode=self.backend.mode,
            role=self.role(client),
            limits=self.limits.__dict__,
            perturbations=self.backend.perturbations.as_dicts(),
            **self.backend.welcome_fields(),
        )

    # -- inbound ---------------------------------------------------------------------------
    def handle(self, client: _Client, msg) -> None:
        """Act on one parsed message; ProtocolError when refused (nothing changed)."""
        if isinstance(msg, P.Hello):
            return self.send(client, self.welcome(client))
        if isinstance(msg, P.View):
            return self._view(client, msg)
        if isinstance(msg, P.TakeDrive):
            if self.driver is not None and self.driver is not client:
                raise P.ProtocolError("not_driver", "another tab drives")
            self.driver = client
            return self.send(client, P.Role(role="driver"))
        if client is not self.driver:
            raise P.ProtocolError("not_driver", "this tab watches; only the driving tab can change things")
        if isinstance(msg, P.Perturb):
            self.backend.perturbations.add(msg.spec)
            return self.broadcast(P.Perturbations(active=self.backend.perturbations.as_dicts()))
        if isinstance(msg, P.ClearPerturbations):
            self.backend.perturbations.clear()
            return self.broadcast(P.Perturbations(active=[]))
        if isinstance(msg, P.TrainControl):
            if self.backend.mode != "train":
                raise P.ProtocolError("wrong_mode", "train_control needs a training run (train --scope)")
            return self.backend.control(msg.action)
        if isinstance(msg, P.Generate):
            if self.backend.mode != "generate":
                raise P.ProtocolError("wrong_mode", "generate needs `megatronapp scope serve`")
            self.backend.check(msg)
            if self.busy:
                raise P.ProtocolError("busy", "a generation is running")
            self.busy = True
            self.worker.submit(self._generate, client, msg)

    def _view(self, client: _Client, msg: P.View) -> None:
        info = self.backend.info
        if msg.layer >= info["num_layers"] or msg.head >= info["num_heads"]:
            raise P.ProtocolError("refused", f"view: layer must be < {info['num_layers']}, head < {info['num_heads']}")
        client.layer, client.head = msg.layer, msg.head
        if client is not self.driver:  # reruns are the driver's to ask for; layers_shown() has this one
            return
        # a generation running now captures the layers shown when it began: check after it
        if self.backend.mode == "generate" and (self.busy or self.backend.needs_refill(msg.layer)):
            self.worker.submit(self._refill, client, msg.layer)

    def _refill(self, client: _Client, layer: int) -> None:
        if client not in self.clients or client.layer != layer or not self.backend.needs_refill(layer):
            return  # the tab left or moved on, or a generation since captured this layer
        self._run_guarded(client, lambda: self.backend.refill(layer, ClientSink(self, client)))

    def _generate(self, client: _Client, msg: P.Generate) -> None:
        try:
            self._run_guarded(client, lambda: self.backend.run(msg, self, self.layers_shown()))
        finally:
            self.busy = False

    def _run_guarded(self, client: _Client, work) -> None:
        try:
            work()
        except P.ProtocolError as e:
            self.send(client, e.error)
        except CaptureLimitError as e:  # the request asked for more than Limits.max_capture_bytes
            self.send(client, P.Error(code="too_large", message=str(e)[:300]))
        except Exception:  # a model-side failure ends this request only
            log.exception("MegaScope UI: a model-side request failed")
            self.send(client, INTERNAL_ERROR)


def build_app(hub: Hub, cfg: ServerConfig):
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    static_dir = resources.files("megatronapp.scope_ui") / "static"

    def host_ok(host_header: str | None) -> bool:
        if not is_loopback(cfg.host):
            return True
        name = (host_header or "").rsplit(":", 1)[0]
        return name in LOOPBACK_NAMES

    def token_ok(given: str | None) -> bool:
        return cfg.token is None or (given is not None and hmac.compare_digest(given.encode(), cfg.token.encode()))

    @app.get("/")
    async def index(request: Request):
        if not host_ok(request.headers.get("host")) or not token_ok(request.query_params.get("token")):
            return PlainTextResponse("forbidden: wrong host or token", status_code=403)
        return HTMLResponse((static_dir / "index.html").read_text())

    @app.get("/favicon.ico")
    async def favicon():
        return PlainTextResponse("", status_code=204)

    app.mount("/static", StaticFiles(directory=str(static_dir)), name="static")

    @app.websocket("/ws")
    async def ws_endpoint(ws: WebSocket):
        origin, host = ws.headers.get("origin"), ws.headers.get("host")
        if (
            not host_ok(host)
            or not token_ok(ws.query_params.get("token"))
            or (origin is not None and origin != f"http://{host}")
        ):
            await ws.close(code=1008)
            return
        await ws.accept()
        hub.loop = asyncio.get_running_loop()
        client = hub.join(ws)
        sender = asyncio.create_task(_send_loop(client, hub.decode))
        hub.send(client, hub.welcome(client))
        for msg in hub.backend.backlog():  # e.g. the training curve so far
            hub.send(client, msg)
        try:
            while True:
                frame = await ws.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                _receive_one(hub, client, frame)
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            hub.leave(client)
            sender.cancel()

    return app


def _receive_one(hub: Hub, client: _Client, frame: dict) -> None:
    try:
        if not client.limiter.allow(time.monotonic()):
            raise P.ProtocolError("rate_limited", f"over {hub.limits.max_messages_per_s:g} messages/s")
        if frame.get("bytes") is not None:
            raise P.ProtocolError("binary_not_accepted", "clients send JSON text frames only")
        hub.handle(client, P.parse_client_text(frame.get("text") or "", hub.limits))
    except P.ProtocolError as e:
        hub.send(client, e.error)
    except Exception:  # a bug must not end the connection or the server
        log.exception("MegaScope UI: handling a client message failed")
        hub.send(client, INTERNAL_ERROR)


async def _send_loop(client: _Client, decode) -> None:
    """Whenever the socket is ready: the tab's whole backlog, coalesced, encoded, sent."""
    try:
        while True:
            await client.wake.wait()
            client.wake.clear()
            backlog, client.pending = client.pending, []
            for item in coalesce(backlog, client.layer):
                frame = encode(item, decode)
                if isinstance(frame, bytes):
                    await client.ws.send_bytes(frame)
                else:
                    await client.ws.send_text(frame)
                client.frames_sent += 1
    except Exception:  # the tab went away; leave() is run by the receive side
        pass


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(128)  # the printed URL accepts connections at once (they queue until uvicorn runs)
    return sock


class RunningServer:
    """uvicorn serving `hub` on an already bound socket, in this thread (`run`) or a daemon
    thread (`start`); `url` includes the token."""

    def __init__(self, hub: Hub, cfg: ServerConfig):
        import uvicorn

        self.sock = bind_socket(cfg.host, cfg.port)
        self.port = self.sock.getsockname()[1]
        shown = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
        self.url = f"http://{shown}:{self.port}/" + (f"?token={cfg.token}" if cfg.token else "")
        config = uvicorn.Config(
            build_app(hub, cfg),
            log_level="warning",
            ws_max_size=4 * cfg.limits.max_message_bytes,
            ws_ping_interval=None,
            lifespan="off",
        )
        self.server, self.hub = uvicorn.Server(config), hub
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self) -> RunningServer:
        self.thread = threading.Thread(target=self.run, name="scope-ui", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.hub.worker.shutdown(wait=False, cancel_futures=True)
