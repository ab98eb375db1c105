"""``arq mlxq.worker.Settings``: a worker serving ``MLXQ_MODEL`` (or every model of ``MLXQ_MODELS``), configured
from the environment.

One queue per model (``<prefix>:queue:<name>``), a short poll backed by producers' wake-ups, ``max_jobs``
above the models' batch capacity and a health record per worker. Each model of ``MLXQ_MODEL(S)`` loads at
start-up on its own MLX thread; each of ``MLXQ_LOADABLE_MODELS`` when its jobs wait (worker/loading.py).

Exit status: 0 stopped by SIGTERM/SIGINT (after the drain); 1 a shutdown hung past ``MLXQ_SHUTDOWN_GRACE``; 69
Redis unreachable (at start for ``MLXQ_CONNECT_DEADLINE``, or later past redis-py's retries); 70 every model's
engine died; 78 a configuration it cannot run with (a bad ``MLXQ_*`` value, a model that is missing, not a
model, or fails to load). Each failure is one line; ``MLXQ_LOG_LEVEL=DEBUG`` adds its traceback.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any, NoReturn

from mlxq.api.connection import redact
from mlxq.api.errors import ConfigError
from mlxq.api.settings import names, undeclared
from mlxq.engine.mlx.loader import ModelLoadError, locate_model

from . import watchdog
from .arqseam import Host, WorkerSpec, worker_kwargs
from .budget import model_weights
from .config import SETTING_GROUPS, WorkerConfig
from .host import WorkerHost

__all__ = ["CONFIG_ERROR_EXIT", "check_config", "worker_settings"]  # and Settings, built on first use

log = logging.getLogger(__name__)
CONFIG_ERROR_EXIT = 78  # EX_CONFIG: a configuration the worker cannot start with; restarting will not help


def check_config(config: WorkerConfig) -> None:
    """What can be judged before connecting anywhere: a model to serve, and each one's directory (a local path
    that does not exist is never sent to the hub). Raises ConfigError or ModelLoadError."""
    if not config.served:
        raise ConfigError("no model to serve: set MLXQ_MODEL=<model directory or hub id> "
                          "(or MLXQ_MODELS=path[=alias],..., or MLXQ_LOADABLE_MODELS)")
    names = [m.name for m in config.served]
    if len(set(names)) != len(names):
        raise ConfigError(f"MLXQ_MODELS and MLXQ_LOADABLE_MODELS name a model twice: {', '.join(names)}")
    for variable, values in (("MLXQ_KV_BITS", config.kv_bits), ("MLXQ_KV_GROUP_SIZE", config.kv_group_size)):
        unknown = [name for name, _ in values.named if name not in names]
        if unknown:
            raise ConfigError(f"{variable} names {unknown[0]}, a model this worker does not serve (it serves "
                              f"{', '.join(names)})")
    if config.draft_model and config.models:
        raise ConfigError("MLXQ_DRAFT_MODEL is the draft of MLXQ_MODEL; with MLXQ_MODELS name each model's draft "
                          "there (path=alias+draft_path)")
    for served in config.served:
        locate_model(served.path)
        if served.draft:
            try:
                locate_model(served.draft)
            except ModelLoadError as exc:
                raise ModelLoadError(f"draft model of {served.name}: {exc}") from exc
        elif config.speculate == "draft":
            raise ConfigError(f"MLXQ_SPECULATE=draft but {served.name} has no draft model (MLXQ_DRAFT_MODEL, or "
                              "path=alias+draft_path in MLXQ_MODELS)")
    model_weights(config)  # a budget too small for them is a configuration error



def worker_settings(config: WorkerConfig) -> dict[str, Any]:
    """Keyword arguments for ``arq.Worker`` serving ``config.served``."""

    host: WorkerHost | None = None

    async def start() -> Host:
        nonlocal host
        try:
            host = await WorkerHost.start(config)
        except (ConfigError, ModelLoadError) as exc:
            log.error("worker cannot start: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
            raise SystemExit(CONFIG_ERROR_EXIT) from None
        return host

    def on_stop_signal(drain_s: float) -> None:
        # A shutdown still running this long after the drain dumps every thread's stack and exits 1.
        watchdog.arm(drain_s + config.shutdown_grace_s)
        if host is not None:
            host.drain()

    first = config.served[0].name if config.served else ""
    return worker_kwargs(WorkerSpec(
        queue=config.keys.queue(first),
        redis_url=config.redis_url,
        start=start,
        max_jobs=config.arq_max_jobs,
        poll_delay_s=config.poll_delay_s,
        job_timeout_s=config.arq_job_timeout_s,
        drain_s=config.drain_timeout_s,
        # The same on every start on this host, so `arq --check mlxq.worker.Settings` (same environment) finds it.
        health_key=config.keys.arq_health(socket.gethostname(), first),
        on_stop_signal=on_stop_signal,
        on_closed=watchdog.disarm,
        connect_deadline_s=config.connect_deadline_s,
    ))


def _configure_logging(level: str) -> None:
    # arq's CLI configures only the "arq" logger; give ours the same treatment (at MLXQ_LOG_LEVEL) unless the host
    # app did (tests starting a Worker themselves log through pytest).
    for name in ("mlxq",):  # every module of the package logs under it
        logger = logging.getLogger(name)
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
            logger.addHandler(handler)
            logger.setLevel(level)


def _settings_class() -> type:
    """``arq mlxq.worker.Settings``: the worker for ``MLXQ_MODEL`` or ``MLXQ_MODELS``, its attributes read from the
    environment; a bad configuration exits 78 with one line, not a traceback (at ``MLXQ_LOG_LEVEL=DEBUG``, after
    it)."""
    try:
        config = WorkerConfig.from_env()
    except ConfigError as exc:
        _configure_logging("INFO")
        _cannot_start(exc)
    _configure_logging(config.log_level)
    for line in undeclared(os.environ, names(cls for _, cls in SETTING_GROUPS)):
        log.warning(line)
    try:
        check_config(config)
    except (ConfigError, ModelLoadError) as exc:
        _cannot_start(exc)
    if "--check" in sys.argv[1:]:  # arq's health check: say which worker's record it looks for
        first = config.served[0].name if config.served else ""
        print(f"mlxq worker: checking for a worker serving {first!r} on host {socket.gethostname()} under prefix "
              f"{config.keys.prefix!r} at {redact(config.redis_url)} (run the check with the worker's own MLXQ_* "
              "settings: MLXQ_MODEL, MLXQ_MODEL_NAME, MLXQ_PREFIX, MLXQ_REDIS_URL)", file=sys.stderr)
    return type("Settings", (), dict(worker_settings(config)))


def _cannot_start(exc: Exception) -> NoReturn:
    log.debug("worker cannot start", exc_info=exc)
    print(f"mlxq worker: {exc}", file=sys.stderr)
    raise SystemExit(CONFIG_ERROR_EXIT) from None


_settings: type | None = None


def __getattr__(name: str) -> Any:
    # Built when arq asks for it, not at import: importing this module reads no environment.
    global _settings
    if name == "Settings":
        if _settings is None:
            _settings = _settings_class()
        return _settings
    raise AttributeError(name)
