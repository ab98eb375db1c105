"""The README's examples run as written (its client script against a real worker, its set-up commands are CI's);
the READMEs' links lead somewhere and the variables they document are ones the code reads."""

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


DOCS = [ROOT / "README.md", ROOT / "api" / "README.md", ROOT / "deploy" / "README.md",
        ROOT / "tests" / "perf" / "README.md"]


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_a_front_door() -> None:
    assert len(README.splitlines()) <= 300  # issue #42: the references live in the READMEs it links to


def test_every_relative_link_of_the_readmes_leads_to_a_file_and_heading() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists() or (anchor and anchor not in _anchors(file.read_text())):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_readmes_document_only_variables_the_code_reads() -> None:
    code = "".join(p.read_text() for d in ("api", "engine", "worker") for p in (ROOT / d).rglob("*.py"))
    read = set(re.findall(r"MLXQ_[A-Z_]*[A-Z]", code))
    documented = {v for doc in DOCS for v in re.findall(r"MLXQ_[A-Z_]*[A-Z]", doc.read_text())}
    assert documented - read == set()


def test_the_settings_table_is_where_the_generator_writes_it() -> None:
    deploy = (ROOT / "deploy" / "README.md").read_text()
    section = deploy[deploy.index("## Settings\n"):]
    table = section[section.index("<!-- settings:begin -->"):section.index("<!-- settings:end -->")]
    assert "MLXQ_MODEL" in table and "MLXQ_REDIS_URL" in table


def test_the_readmes_speak_to_a_reader_of_the_repository() -> None:
    # No machine's paths, tracker numbers or bare commit ids: a reader has the repository, not our machines.
    found = {str(doc.relative_to(ROOT)): re.findall(r"\s(/(?:work|tmp|home)/\S*|[Ii]ssue #?\d+|[0-9a-f]{7,40}\^)",
                                                    doc.read_text()) for doc in DOCS}
    assert {doc: hits for doc, hits in found.items() if hits} == {}
