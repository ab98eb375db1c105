"""A served model as a job's preparation sees it (worker/jobs/prepare.py): what its stages need of the loaded
model, handed to them whole, so none of them calls back into its model service.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxq.engine.mlx.constrain import Grammar, Grammars, ResponseFormat, vocab_size

if TYPE_CHECKING:
    from mlxq.engine.core.prompt import PromptEncoder
    from mlxq.engine.mlx.loader import LoadedModel
    from mlxq.engine.mlx.vlm import Vision

    from ..config import ServedModel, WorkerConfig

__all__ = ["Formats", "ModelView"]


class Formats:
    """One model's compiler of response formats (engine/mlx/constrain.py's :class:`Grammars`): built for the first job
    that has a format, off the event loop, and shared by its jobs from then on."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded
        self._grammars: Grammars | None = None
        self._lock = asyncio.Lock()

    async def compile(self, fmt: ResponseFormat) -> Grammar:
        """``fmt`` compiled for this model (one seen before: from the cache, at once; a new one: compiled off the
        event loop); :class:`~mlxq.engine.mlx.constrain.GrammarError` if it cannot be."""
        grammars = self._grammars or await self._build()
        grammar = grammars.cached(fmt)
        if grammar is not None:
            return grammar
        return await asyncio.to_thread(grammars.compile, fmt)

    async def _build(self) -> Grammars:
        async with self._lock:
            grammars = self._grammars
            if grammars is None:
                model = self._loaded
                grammars = self._grammars = await asyncio.to_thread(
                    Grammars, model.tokenizer._tokenizer, vocab_size(model.model, model.tokenizer), model.eos_token_ids)
            return grammars


@dataclass(frozen=True, slots=True)
class ModelView:
    """What preparing a job needs of its model: the names a request may give it, the worker's limits, its tokenizer
    and chat template, its context length, its vision processor (None: text only) and the thread its images are
    prepared on, its format compiler, and each token's text (for log-probabilities)."""

    name: str
    path: str
    config: WorkerConfig
    tokenizer: Any  # mlx_lm TokenizerWrapper
    prompts: PromptEncoder
    context_length: int | None
    vision: Vision | None
    formats: Formats
    token_text: Callable[[int], str]
    images: Executor | None = None  # one thread per model (see worker/jobs/media.py); None: asyncio's default
    embedding_width: int | None = None  # an embedding model's vector width (None: a model that generates)

    @classmethod
    def of(cls, served: ServedModel, config: WorkerConfig, loaded: LoadedModel, images: Executor | None = None
           ) -> ModelView:
        """The view of a model just loaded."""
        tokenizer = loaded.tokenizer
        # One token's text as the tokenizer decodes it alone, memoized: a vocabulary is finite.
        token_text = functools.cache(lambda token: str(tokenizer.decode([token])))
        return cls(served.name, served.path, config, tokenizer, loaded.prompts, loaded.context_length, loaded.vision,
                   Formats(loaded), token_text, images, loaded.embedding_width)

    @property
    def embeds(self) -> bool:
        """Whether it is an embedding model (it takes embedding jobs, and only those)."""
        return self.embedding_width is not None

    @property
    def accepts_images(self) -> bool:
        """Whether requests with images can run on this model."""
        return self.vision is not None
