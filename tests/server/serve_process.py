"""``llamabatch serve`` as a child process on the tiny model: the harness shared by the tests
that drive the real command line (``test_server``, ``test_server_hostile``,
``test_client_priority``)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from llamabatch.gguf.testing import model_path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(port: int, *flags: str) -> list[str]:
    """``python -m llamabatch serve -m <tiny> --port PORT FLAGS...``"""
    return [
        sys.executable,
        "-m",
        "llamabatch",
        "serve",
        "-m",
        str(model_path("tiny")),
        "--port",
        str(port),
        *flags,
    ]


def wait_until_healthy(
    proc: subprocess.Popen, url: str, output: Callable[[], str], timeout: float = 60
) -> None:
    """Until ``url/health`` answers 200; fails with ``output()`` if the process ends first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, output()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "llamabatch serve did not come up"
        time.sleep(0.1)
