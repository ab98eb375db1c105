"""``mlxq demo --gateway``: after the demo's jobs it serves the HTTP gateway and prints a curl line a person can
paste; that line works as printed, and Ctrl-C (or SIGTERM) ends it all cleanly: no process of it lives on."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
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


def test_the_tiny_tools_demo_prints_a_tools_curl_line_that_gets_calls(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "mlxq.api.cli", "demo", "--size", "tiny-tools", "--gateway",
                             "--port", "0", "--jobs", "2", "--max-tokens", "8"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_as_from_a_terminal)
    try:
        assert proc.stdout is not None
        curls = []
        for line in proc.stdout:
            curls += [line] if line.startswith("curl ") else []
            if '"tools"' in line:
                break
        else:
            raise AssertionError(f"no tools curl line; stderr:\n{proc.communicate(timeout=30)[1]}")
        args = shlex.split(curls[-1])
        resp = httpx.post(args[1], json=json.loads(args[args.index("-d") + 1]), timeout=60)
        assert resp.status_code == 200, resp.text
        (choice,) = resp.json()["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert {c["function"]["name"] for c in choice["message"]["tool_calls"]} == {"get_weather"}
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_with_its_port_taken_the_demo_says_so_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**{k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}, "TMPDIR": str(tmp_path)}
        done = subprocess.run([sys.executable, "-m", "mlxq.api.cli", "demo", "--gateway", "--port", str(port)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"mlxq: port {port} is in use; pick another with `mlxq demo --gateway --port N` "
                           "(--port 0: any free one)\n")
    assert list(tmp_path.iterdir()) == []  # no log folder left behind
