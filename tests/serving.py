"""The OpenAI-compatible server as the tests start it: ``torchrun -m tpengine.serve`` on a free port of
127.0.0.1 (:class:`Server`), SmolLM2 in float32 by default (:data:`SETTINGS`)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from conftest import SMOLLM2_DIR
from launch import START_TIMEOUT, command, free_port, popen

SETTINGS = ["--model", str(SMOLLM2_DIR), "--max-model-len", "1024", "--kv-cache-gb", "0.25", "--dtype", "float32"]


#: Seconds the tests' clients keep an idle connection: below uvicorn's keep-alive (5 s), so a client never
#: sends on a connection the server is closing (with the SDK's default 5 s and no retries, a request sent
#: about 5 s after the last one could find it closed: "Server disconnected without sending a response").
KEEPALIVE_S = 2.0


def openai_client(url: str, timeout: float):
    """The ``openai`` client of the server at ``url``: no retries (a test sees every error as it came)
    and idle connections kept :data:`KEEPALIVE_S`."""
    import httpx2
    import openai

    http = openai.DefaultHttpx2Client(limits=httpx2.Limits(max_connections=1000, max_keepalive_connections=100,
                                                            keepalive_expiry=KEEPALIVE_S))
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout, http_client=http)


class Server:
    """``torchrun --nproc_per_node 2 -m tpengine.serve`` on a free port, its stderr collected (``real``:
    :func:`launch.command`'s)."""

    def __init__(self, tmp: Path, tp: int = 2, extra: tuple[str, ...] = (), real: bool = False):
        self.port = free_port()
        self.log = tmp / f"server-{self.port}.log"
        cmd = [*command("tpengine.serve", nproc=tp, torchrun=True, real=real), "--port", str(self.port),
               *SETTINGS, *extra]
        self.proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.3)
        else:
            raise AssertionError("the server did not come up: " + self.log.read_text()[-3000:])
        self.client = openai_client(self.url, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(tpengine:\w+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(3))
        return out

    def rank_pids(self) -> dict[int, int]:
        """rank -> pid of the server's ranks (:func:`test_orphans.rank_pids`)."""
        from test_orphans import rank_pids

        return rank_pids(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
