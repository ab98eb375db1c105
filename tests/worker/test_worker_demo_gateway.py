"""``mlxq demo --gateway``: after the demo's jobs it serves the HTTP gateway and prints a curl line a person can
paste; that line works as printed, and Ctrl-C (or SIGTERM) ends it all cleanly: no process of it lives on."""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


def _as_from_a_terminal() -> None:
    # A shell that starts a background job (as `nohup ... &` does) makes it ignore SIGINT, and Python then
    # installs no KeyboardInterrupt handler; a demo started from a terminal has the default, as here.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _as_a_scripts_background_job() -> None:
    # `some-script &` from a non-interactive shell: SIGINT arrives ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(("stop", "started"), [(signal.SIGINT, _as_from_a_terminal),
                                               (signal.SIGTERM, _as_from_a_terminal),
                                               (signal.SIGINT, _as_a_scripts_background_job)],
                         ids=["ctrl-c", "sigterm", "sigint-to-a-background-job"])
def test_demo_serves_the_gateway_and_its_curl_line_works(stop: signal.Signals, started: Any) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "mlxq.api.cli", "demo", "--gateway", "--port", "0", "--jobs", "2",
                             "--max-tokens", "8"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=started)
    children: list[psutil.Process] = []
    try:
        assert proc.stdout is not None
        line = ""
        for line in proc.stdout:
            if line.startswith("curl -N "):
                break
        else:
            raise AssertionError(f"no curl line; stderr:\n{proc.communicate(timeout=30)[1]}")
        children = psutil.Process(proc.pid).children(recursive=True)  # Redis, the worker, the gateway
        assert len(children) >= 3
        args = shlex.split(line)  # as a shell would read it
        url, body = args[2], json.loads(args[args.index("-d") + 1])
        assert body["stream"] is True
        with httpx.stream("POST", url, json=body, timeout=60) as resp:
            lines = [x for x in resp.iter_lines() if x]
        assert resp.status_code == 200 and lines[-1] == "data: [DONE]"
        chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["model"] == "tiny"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        assert "serving until Ctrl-C" in err and "worker stopped (exit 0)" in err and "Traceback" not in err
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left running: {[c.pid for c in alive]}"
    finally:  # a failed test leaves nothing running behind it
        if proc.poll() is None:
            proc.kill()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        proc.wait()
