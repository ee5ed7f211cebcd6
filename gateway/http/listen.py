"""The gateway's listening socket, bound before anything else is started.

uvicorn binds only after the app's startup: with the port taken, `rlproxy serve` loaded its
model, launched a managed vLLM or a trainer (minutes on a GPU) and only then failed with
uvicorn's "[Errno 98] ... address already in use". Bound first, the cause is one line at once.
"""

from __future__ import annotations

import errno
import socket

from gateway.errors import ConfigError


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) for uvicorn to serve on (as uvicorn binds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port {port} on {host} is already in use (another rlproxy serve?): "
                "stop that process or pass another --port"
            ) from exc
        raise ConfigError(f"cannot listen on --host {host} --port {port}: {exc.strerror or exc}") from exc
    return sock


def base_url(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket: the port the OS chose for --port 0 included."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
