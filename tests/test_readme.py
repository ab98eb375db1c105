"""The README's examples run as written: its client script against a real worker, its commands' flags exist."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import pytest

from tests.support import RunningWorker

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _block(after: str, lang: str) -> str:
    tail = README[README.index(after):]
    match = re.search(rf"```{lang}\n(.*?)```", tail, re.S)
    assert match is not None, f"no {lang} block after {after!r}"
    return match.group(1)


async def test_the_client_example_is_a_script_that_streams_a_job(worker: RunningWorker, redis_url: str,
                                                                 tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_block("## Use it", "python"))
    env = {**os.environ, "MLXQ_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), "tiny", env=env, cwd=tmp_path,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    text, _, summary = out.decode().strip().rpartition("\n")
    assert summary == "[length: 64 tokens]" and text, out.decode()


def test_the_set_up_commands_are_the_ci_command_and_the_demo() -> None:
    setup = README[README.index("## Set up"):README.index("## Use it")]
    commands = re.findall(r"```sh\n(.*?)\n```", setup, re.S)
    assert commands == ["python3 -m pip install -e '.[worker]' && mlxq demo",
                        "python3 -m pip install -e '.[dev]' && python3 -m pytest"]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
