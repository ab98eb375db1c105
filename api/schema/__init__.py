"""The wire schema, shared by producer and worker: every record that crosses Redis is one of these pydantic
models serialized as JSON (never pickle).

- :mod:`.requests`: one generation job as submitted (:class:`GenerateRequest`) and the bounds on it;
- :mod:`.events`: what a job emits (one discriminated union on ``type``, parsed by :data:`EVENTS`);
- :mod:`.health`: the health record each worker keeps of itself and its models (:class:`WorkerStatus`).

Everything is importable from here, the one wire-schema namespace.
"""

from __future__ import annotations

from . import events, health, requests
from .events import *  # noqa: F403
from .health import *  # noqa: F403
from .requests import *  # noqa: F403

__all__ = [*events.__all__, *health.__all__, *requests.__all__]
