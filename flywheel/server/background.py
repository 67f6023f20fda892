"""Run the HTTP API in a background thread (for LocalBackend and tests), on a real loopback socket.

Servers still running when the interpreter exits are stopped by an ``atexit`` hook, after the engines they serve
are closed (see ``_stop_running_servers``).
"""

from __future__ import annotations

import atexit
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from flywheel.inference.engine import close_open_engines

GRACE_SECONDS = 3  # requests still running when a server stops get this long to finish, then are cancelled


class BackgroundServer:
    """uvicorn on its own thread and event loop; ``port=0`` picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", timeout_keep_alive=30, timeout_graceful_shutdown=GRACE_SECONDS
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="flywheel-http", daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        _running.add(self)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"The HTTP server on {self.host}:{self.port} did not start.")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
        _running.discard(self)


_running: set[BackgroundServer] = set()  # started, not stopped yet


@atexit.register
def _stop_running_servers() -> None:
    """At interpreter exit, stop the servers a script left running (ART's examples never close their backend), so
    that their threads end before Python finalizes (a daemon thread still inside native code then can abort the
    process). The engines close first, whichever of the two hooks runs first: a request still decoding then ends
    at once with a 503 (``EngineClosedError``) instead of holding the server's shutdown for its grace period."""
    close_open_engines()
    for server in list(_running):
        server.stop()
