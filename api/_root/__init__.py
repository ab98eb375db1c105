"""mlxq: MLX language models served behind a Redis job queue. This is the producer's API, the documented surface::

    from mlxq import Client, MlxqError

    async with Client("redis://127.0.0.1:6379") as client:
        result = await client.generate(model="qwen3-0.6b", prompt="Hello", max_tokens=32)

The client and its results, the requests a producer builds, the events and health records it reads, and the
exception tree (:mod:`mlxq.api.errors`). Each name lives in a module of ``mlxq.api`` and is loaded on first use,
so importing ``mlxq`` (which every ``mlxq.engine`` and ``mlxq.worker`` import does first) loads none of them.
This file is installed as ``mlxq/__init__.py``; the repository keeps it under ``api/`` (pyproject's package-dir),
where the producer side's layering rule holds it: no MLX, no arq, no engine or worker.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxq.api.client import Client
    from mlxq.api.config import ClientConfig
    from mlxq.api.deltas import Delta
    from mlxq.api.embeddings import Embeddings
    from mlxq.api.errors import (
        AccessDenied,
        BadRequest,
        ConfigError,
        DuplicateJob,
        JobFailed,
        JobNotFound,
        MlxqError,
        NotFound,
        NoWorker,
        QueueFull,
        QueueOutOfMemory,
        QueueUnavailable,
        UnexpectedPassword,
        WaitTimeout,
    )
    from mlxq.api.follow import Result
    from mlxq.api.registry import ModelInfo, QueueInfo
    from mlxq.api.schema import (
        ChatMessage,
        DoneEvent,
        ErrorCode,
        ErrorEvent,
        Event,
        FinishReason,
        FunctionCall,
        FunctionDef,
        GenerateRequest,
        GrammarFormat,
        ImagePart,
        ImageURL,
        JSONObjectFormat,
        JSONSchemaFormat,
        JSONSchemaSpec,
        ModelState,
        ModelStatus,
        NamedToolChoice,
        RegexFormat,
        ResetEvent,
        StartEvent,
        TextFormat,
        TextPart,
        Timings,
        TokenEvent,
        TokenLogprob,
        Tool,
        ToolCall,
        TopLogprob,
        Usage,
        WorkerStatus,
        image_data_url,
        new_request_id,
    )
    from mlxq.api.tenants import Policy, TenantUse

__all__ = [  # grouped by module in _HOMES below
    "AccessDenied", "BadRequest", "ChatMessage", "Client", "ClientConfig", "ConfigError", "Delta", "DoneEvent",
    "DuplicateJob", "Embeddings", "ErrorCode", "ErrorEvent", "Event", "FinishReason", "FunctionCall", "FunctionDef",
    "GenerateRequest", "GrammarFormat", "ImagePart", "ImageURL", "JSONObjectFormat", "JSONSchemaFormat",
    "JSONSchemaSpec", "JobFailed", "JobNotFound", "MlxqError", "ModelInfo", "ModelState", "ModelStatus",
    "NamedToolChoice", "NoWorker", "NotFound", "Policy", "QueueFull", "QueueInfo", "QueueOutOfMemory",
    "QueueUnavailable", "RegexFormat", "ResetEvent", "Result", "StartEvent", "TenantUse", "TextFormat", "TextPart",
    "Timings", "TokenEvent",
    "TokenLogprob", "Tool", "ToolCall", "TopLogprob", "UnexpectedPassword", "Usage", "WaitTimeout", "WorkerStatus",
    "image_data_url", "new_request_id",
]

# Where each name lives (the modules the TYPE_CHECKING imports above name; a test holds the two the same).
_HOMES = {
    "mlxq.api.client": ("Client",),
    "mlxq.api.config": ("ClientConfig",),
    "mlxq.api.deltas": ("Delta",),
    "mlxq.api.embeddings": ("Embeddings",),
    "mlxq.api.errors": ("AccessDenied", "BadRequest", "ConfigError", "DuplicateJob", "JobFailed", "JobNotFound",
                        "MlxqError", "NoWorker", "NotFound", "QueueFull", "QueueOutOfMemory", "QueueUnavailable",
                        "UnexpectedPassword", "WaitTimeout"),
    "mlxq.api.follow": ("Result",),
    "mlxq.api.registry": ("ModelInfo", "QueueInfo"),
    "mlxq.api.schema": ("ChatMessage", "DoneEvent", "ErrorCode", "ErrorEvent", "Event", "FinishReason",
                        "FunctionCall", "FunctionDef", "GenerateRequest", "GrammarFormat", "ImagePart", "ImageURL",
                        "JSONObjectFormat", "JSONSchemaFormat", "JSONSchemaSpec", "ModelState", "ModelStatus",
                        "NamedToolChoice", "RegexFormat", "ResetEvent", "StartEvent", "TextFormat", "TextPart",
                        "Timings", "TokenEvent", "TokenLogprob", "Tool", "ToolCall", "TopLogprob", "Usage",
                        "WorkerStatus", "image_data_url", "new_request_id"),
    "mlxq.api.tenants": ("Policy", "TenantUse"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    # PEP 562: a documented name is imported from its module on first use, then kept here.
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
