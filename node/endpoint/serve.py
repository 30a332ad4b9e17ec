"""Start the endpoint: load the engine, open the store, run uvicorn (in this thread, or in the background
for a process that also drives it: tests, the verifiers runner, benches)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from skillswarm.node.endpoint.limits import DEFAULT_HOST, DEFAULT_PORT, StoreLimits
from skillswarm.node.endpoint.server import create_app
from skillswarm.node.endpoint.service import EndpointService
from skillswarm.node.endpoint.store import TrajectoryStore, open_store
from skillswarm.protocol.errors import NetworkError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.node.rl.engines.base import DEFAULT_ENGINE

log = logging.getLogger(__name__)

def build_service(model_dir: Path, store_dir: Path, *, name: str | None = None, skill: str | None = None,
                  engine: str = DEFAULT_ENGINE, device: str | None = None, limits: StoreLimits = StoreLimits(),
                  max_batch: int = 64, model_name: str | None = None, max_new_tokens: int | None = None) -> EndpointService:
    """An endpoint service on the model in `model_dir`, recording into `store_dir` under `name`
    (default: the skill's name, else "default")."""
    from skillswarm.node.rl.engines import check_engine, load_engine
    from skillswarm.skills.registry import get_skill

    check_engine(engine)
    served_skill = get_skill(skill) if skill else None
    label = name or skill or "default"
    directory = open_store(store_dir, weights_hash(Path(model_dir)), label)
    eng = load_engine(engine, model_dir, device=device)
    store = TrajectoryStore(directory, label, limits)
    return EndpointService(eng, store, model_name or Path(model_dir).name, served_skill, max_batch,
                           max_new_tokens=max_new_tokens)


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket on HOST:PORT (0: any free port; read it back from the socket), or a clear NetworkError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise NetworkError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _Sweeper(threading.Thread):
    def __init__(self, service: EndpointService) -> None:
        super().__init__(name="endpoint-sweeper", daemon=True)
        self.service, self.stop = service, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                self.service.sweep()
            except Exception:  # never let one bad write stop expiry
                log.exception("store sweep failed")


def _server(service: EndpointService, sock: socket.socket, api_key: str | None) -> Any:
    import uvicorn

    config = uvicorn.Config(create_app(service, api_key), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve_forever(service: EndpointService, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                  api_key: str | None = None, on_ready: Any = None) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM); open trajectories expire into the store on the way out."""
    sock = listen_socket(host, port)
    sweeper = _Sweeper(service)
    sweeper.start()
    server = _server(service, sock, api_key)
    if on_ready is not None:
        on_ready(f"http://{host}:{sock.getsockname()[1]}/v1")
    try:
        server.run(sockets=[sock])
    finally:
        sweeper.stop.set()
        service.close()
        sock.close()


@contextlib.contextmanager
def running(service: EndpointService, host: str = DEFAULT_HOST, port: int = 0,
            api_key: str | None = None) -> Iterator[str]:
    """Serve in a background thread; yields the base URL (`http://HOST:PORT/v1`); stops and closes on exit."""
    sock = listen_socket(host, port)
    server = _server(service, sock, api_key)
    sweeper = _Sweeper(service)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="endpoint-http", daemon=True)
    thread.start()
    sweeper.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        if not server.started:
            raise NetworkError("the endpoint's HTTP server did not start")
        yield f"http://{host}:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sweeper.stop.set()
        service.close()
        sock.close()
