"""A TCP relay in a process of its own: a second address for one real server, which a test can SIGKILL.

``python tests/tcpproxy.py LISTEN_PORT UPSTREAM_PORT`` relays every connection to
127.0.0.1:LISTEN_PORT byte for byte to 127.0.0.1:UPSTREAM_PORT. Killing the relay's process
is, to a client, what killing a server is: its open connections are reset mid-reply and new
ones are refused. Tests that need a server to die use one in front of the session's vLLM
server instead of starting another vLLM (about 35 s each on a 2-core CPU).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve(listen_port: int, upstream_port: int) -> None:
    server = socket.create_server(("127.0.0.1", listen_port))
    while True:
        client, _ = server.accept()
        try:
            upstream = socket.create_connection(("127.0.0.1", upstream_port))
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


class Relay:
    """The relay process in front of ``upstream_url`` (``http://127.0.0.1:PORT``); ``url`` is its own address."""

    def __init__(self, upstream_url: str, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        upstream_port = int(upstream_url.rsplit(":", 1)[1])
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), str(port), str(upstream_port)],
                                     start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the relay exited ({self.proc.returncode})")
                time.sleep(0.05)
        self.kill()
        raise RuntimeError("the relay did not start listening in 30 s")

    def kill(self) -> None:
        """SIGKILL the relay: its connections drop as a dead server's do."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
