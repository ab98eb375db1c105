"""``mlxq demo --gateway``: after the demo's jobs it serves the HTTP gateway and prints a curl line a person can
paste; that line works as printed, and Ctrl-C ends it all cleanly."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def test_demo_serves_the_gateway_and_its_curl_line_works() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "demo", "--gateway", "--port", "0", "--jobs", "2",
                             "--max-tokens", "8"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        line = ""
        for line in proc.stdout:
            if line.startswith("curl -N "):
                break
        else:
            raise AssertionError(f"no curl line; stderr:\n{proc.communicate(timeout=30)[1]}")
        args = shlex.split(line)  # as a shell would read it
        url, body = args[2], json.loads(args[args.index("-d") + 1])
        assert body["stream"] is True
        with httpx.stream("POST", url, json=body, timeout=60) as resp:
            lines = [x for x in resp.iter_lines() if x]
        assert resp.status_code == 200 and lines[-1] == "data: [DONE]"
        chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["model"] == "tiny"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "serving until Ctrl-C" in err and "worker stopped (exit 0)" in err and "Traceback" not in err
