"""The package as a web backend installs it: a wheel built from this checkout, installed into a fresh virtual
environment, imported by an app that has its own ``api``, ``engine`` and ``worker`` packages (most FastAPI and
Django layouts have an ``api``). The app's packages and the installed ``mlxq.*`` live side by side, and a job
submitted from the app runs on a worker of this checkout."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parent.parent

APP = '''
import asyncio, sys
import api, engine, worker  # the app's own packages
from api.schema import WIDGET  # the app's api.schema, not ours

from mlxq.api.client import Client
import mlxq.api.client

async def main(url: str) -> None:
    async with Client(url) as client:
        result = await client.generate(model="tiny", prompt="Hello", max_tokens=5, timeout=60)
    print(WIDGET, api.NAME, engine.NAME, worker.NAME, result.usage.completion_tokens, result.finish_reason.value)
    print(mlxq.api.client.__file__)
    print(sorted(m for m in sys.modules if m.split(".")[0] in {"arq", "mlx", "mlx_lm"}))

asyncio.run(main(sys.argv[1]))
'''


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh environment holding the wheel, its dependencies those of the running environment (no download).

    The running environment's own site-packages are put on the new one's path (a ``.pth`` file), not the base
    interpreter's (``system_site_packages`` would show those when the tests run in a virtualenv, and whatever
    happens to be installed there); their ``.pth`` files are not read, so this checkout's editable install is
    not seen: ``mlxq`` comes from the wheel alone."""
    tmp = tmp_path_factory.mktemp("install")
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("mlxq-*.whl")
    env = tmp / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    running = dict.fromkeys(sysconfig.get_path(name) for name in ("purelib", "platlib"))
    (Path(own) / "running_environment.pth").write_text("".join(f"{path}\n" for path in running))
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return python


def test_the_environment_sees_the_running_environments_packages_not_the_base_interpreters(installed: Path) -> None:
    import redis

    out = subprocess.run([str(installed), "-c", "import redis; print(redis.__file__)"], check=True,
                         capture_output=True, text=True, timeout=60)
    assert Path(out.stdout.strip()) == Path(redis.__file__)  # this environment's, whether the base has one or not


def test_the_wheel_installs_everything_under_one_name(installed: Path) -> None:
    (wheel,) = (installed.parent.parent.parent / "wheels").glob("mlxq-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"mlxq", "mlxq-0.1.0.dist-info"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "mlxq/__init__.py" in names and not [n for n in names if "_root" in n]  # api/_root/ is mlxq itself


def test_the_wheel_ships_the_redis_scripts(installed: Path) -> None:
    import zipfile

    (wheel,) = (installed.parent.parent.parent / "wheels").glob("mlxq-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".lua")}
    assert shipped == {f"mlxq/api/protocol/lua/{f.name}" for f in (ROOT / "api" / "protocol" / "lua").glob("*.lua")}
    # and the installed package loads them (the app test below runs ENQUEUE and CANCEL's module from the wheel)
    out = subprocess.run([str(installed), "-c", "from mlxq.api.protocol import claim; print(claim.CLAIM.sha)"],
                         check=True, capture_output=True, text=True, timeout=60, cwd=installed.parent)
    from mlxq.api.protocol import claim

    assert out.stdout.strip() == claim.CLAIM.sha


async def test_an_app_with_its_own_api_package_imports_the_client_and_runs_a_job(
        installed: Path, worker: Any, redis_url: str, tmp_path: Path) -> None:
    app = tmp_path / "app"
    for name in ("api", "engine", "worker"):
        (app / name).mkdir(parents=True)
        (app / name / "__init__.py").write_text(f"NAME = 'app-{name}'\n")
    (app / "api" / "schema.py").write_text("WIDGET = 'widget'\n")
    (app / "main.py").write_text(APP)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = await asyncio.create_subprocess_exec(str(installed), "main.py", redis_url, cwd=app, env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, text
    first, where, loaded = text.strip().splitlines()[-3:]
    assert first == "widget app-api app-engine app-worker 5 length"
    assert Path(where).is_relative_to(installed.parent.parent)  # the wheel's copy, not this checkout's
    assert loaded == "[]"  # a producer: no arq, no MLX


PRODUCER = r"""
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
elsewhere = [name for name in ("mlx", "mlx_lm", "arq", "starlette") if importlib.util.find_spec(name)]
import mlxq
from mlxq import *
from mlxq import GenerateRequest
GenerateRequest(model="tiny", prompt="Hello")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {"arq", "mlx", "mlx_lm", "mlx_vlm"}
                or m.startswith(("mlxq.engine", "mlxq.worker")))
print(elsewhere, [name for name in mlxq.__all__ if name not in globals()], loaded, mlxq.__file__, sep="\n")
"""


def _needed(requires: list[str]) -> list[metadata.Distribution]:
    """The distributions ``requires`` needs, transitively (with their extras), as the running environment holds
    them."""
    from packaging.requirements import Requirement

    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(line, "") for line in requires]
    while todo:
        line, extra = todo.pop()
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        dist = found.setdefault(req.name.lower(), metadata.distribution(req.name))
        for wanted in ("", *req.extras):
            if (req.name.lower(), wanted) not in seen:
                seen.add((req.name.lower(), wanted))
                todo.extend((line, wanted) for line in dist.requires or [])
    return list(found.values())


@pytest.fixture(scope="module")
def producer_site(installed: Path) -> Path:
    """One folder holding the wheel and what its dependencies (no extra) need, linked from the running
    environment, and nothing else: run with ``python -I -S`` it is a producer host's environment."""
    site = installed.parent.parent.parent / "producer"
    (wheel,) = (installed.parent.parent.parent / "wheels").glob("mlxq-*.whl")
    zipfile.ZipFile(wheel).extractall(site)
    for dist in _needed(metadata.PathDistribution(site / "mlxq-0.1.0.dist-info").requires or []):
        tops = {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}
        for top in tops:
            if not (site / top).exists():
                (site / top).symlink_to(Path(str(dist.locate_file(top))))
    return site


def test_every_documented_name_imports_where_only_the_producer_dependencies_are_installed(
        producer_site: Path) -> None:
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", PRODUCER, str(producer_site)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    reachable, missing, loaded, where = proc.stdout.strip().splitlines()
    assert reachable == "[]"  # the environment has no MLX, arq or gateway to load
    assert missing == "[]"  # every name of mlxq.__all__ came with the star import
    assert loaded == "[]"
    assert Path(where).is_relative_to(producer_site)
