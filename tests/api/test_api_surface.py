"""The documented surface: ``from mlxq import Client, MlxqError, ...``, exactly these names, each the object of
its ``mlxq.api`` module, loaded on first use (importing ``mlxq`` alone loads no module of the API)."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import mlxq
from mlxq.api import errors

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent.parent

# The contract: adding a name to mlxq.__all__, or dropping one, is an API change and changes this list.
DOCUMENTED = {
    # the client, its configuration and what it returns
    "Client", "ClientConfig", "Delta", "Embeddings", "Result",
    # requests
    "ChatMessage", "FunctionDef", "GenerateRequest", "GrammarFormat", "ImagePart", "ImageURL", "JSONObjectFormat",
    "JSONSchemaFormat", "JSONSchemaSpec", "NamedToolChoice", "RegexFormat", "TextFormat", "TextPart", "Tool",
    "image_data_url", "new_request_id",
    # events and what they carry
    "DoneEvent", "ErrorCode", "ErrorEvent", "Event", "FinishReason", "FunctionCall", "ResetEvent", "StartEvent",
    "Timings", "TokenEvent", "TokenLogprob", "ToolCall", "TopLogprob", "Usage",
    # the deployment
    "ModelInfo", "ModelState", "ModelStatus", "Policy", "QueueInfo", "TenantUse", "WorkerStatus",
    # the exception tree
    "AccessDenied", "BadRequest", "ConfigError", "DuplicateJob", "JobFailed", "JobNotFound", "MlxqError", "NoWorker",
    "NotFound", "QueueFull", "QueueOutOfMemory", "QueueUnavailable", "UnexpectedPassword", "WaitTimeout",
}


def test_all_is_the_documented_list_without_repeats() -> None:
    assert len(mlxq.__all__) == len(set(mlxq.__all__))
    assert set(mlxq.__all__) == DOCUMENTED
    assert set(mlxq._HOME_OF) == DOCUMENTED  # and the lazy loader knows no other name


def test_every_name_resolves_to_the_object_its_api_module_defines() -> None:
    for name in mlxq.__all__:
        value = getattr(mlxq, name)
        module = sys.modules[mlxq._HOME_OF[name]]
        assert module.__name__.startswith("mlxq.api.")
        assert value is getattr(module, name), name


def test_the_type_checkers_imports_name_the_same_homes_as_the_lazy_loader() -> None:
    # The TYPE_CHECKING block is what mypy and editors see; __getattr__ loads from _HOMES: the two must agree.
    tree = ast.parse(Path(inspect.getfile(mlxq)).read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    seen = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}
    assert seen == mlxq._HOME_OF


def test_the_whole_exception_tree_is_exported() -> None:
    tree = {name for name, value in vars(errors).items()
            if isinstance(value, type) and issubclass(value, errors.MlxqError)}
    assert tree <= set(mlxq.__all__)
    assert "MlxqError" in tree and len(tree) > 1


def test_an_unknown_name_is_an_attribute_error_and_dir_lists_the_surface() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        mlxq.Nope  # noqa: B018
    assert set(mlxq.__all__) <= set(dir(mlxq))


def test_importing_mlxq_loads_none_of_the_api_and_the_surface_loads_no_mlx_arq_engine_or_worker() -> None:
    # Every ``import mlxq.engine...`` and ``mlxq.worker...`` runs mlxq/__init__ first: it must stay bare.
    code = (
        "import sys, mlxq; bare = sorted(m for m in sys.modules if m.startswith('mlxq')); "
        "from mlxq import *; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'mlx', 'mlx_lm', 'mlx_vlm', 'arq'} "
        "or m.startswith(('mlxq.engine', 'mlxq.worker'))); "
        "print(bare, bad, 'Client' in globals())"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["['mlxq']", "[]", "True"]
