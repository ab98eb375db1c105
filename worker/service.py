"""One model a worker serves: its engine on an MLX thread of its own, its claimed jobs, and what only it can
judge of a job: :meth:`ModelService.prepare` turns a claimed job's record into its engine request (validation
against the model's limits, tokenization with its tokenizer, its images, its compiled format) and the parser of
its tool calls, in one call.

Nothing here touches Redis; ``worker/host.py`` runs the jobs and decides each one's fate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from mlxq.api.errors import describe
from mlxq.api.jobrecord import Envelope
from mlxq.api.schema import PRIORITY_MAX, GenerateRequest, ModelState, ModelStatus
from mlxq.engine.constrain import FormatKind, Grammar, GrammarError, Grammars, ResponseFormat, vocab_size
from mlxq.engine.engine import Engine, Sink
from mlxq.engine.loader import EngineOptions, LoadedModel, start_engine
from mlxq.engine.parts import PartMarkers
from mlxq.engine.prompt import EncodedPrompt, encode_prompt_with_boundary
from mlxq.engine.request import EngineRequest, Format, ImageInputs
from mlxq.engine.speculation import SpecKind, Speculation

from . import media
from .config import ServedModel, WorkerConfig
from .jobs.transitions import BelowShare, DueEntry, Outranking
from .toolcalls import CallGrammarError, ToolCalls, call_grammar, template_messages, template_tools
from .translate import to_engine_format, to_engine_request

__all__ = ["BadRequest", "ModelService", "Prepared"]

log = logging.getLogger(__name__)
_INLINE_TOKENIZE_CHARS = 16_384  # longer prompts are tokenized off the event loop
_THINK_TAIL = 32  # prompt tokens looked at for an opened think block


class BadRequest(Exception):
    """The job can never succeed as sent; becomes an ``error(bad_request)`` event."""


# The health record's fields (ModelStatus) read from the engine's counters (EngineStats): record field, stat.
_RECORD_STATS = (
    ("drafted", "spec_drafted"), ("accepted", "spec_accepted"), ("spec_k", "spec_k"), ("kv_bytes", "kv_bytes"),
    ("kv_headroom_bytes", "kv_headroom_bytes"), ("prefix_hits", "prefix_hits"), ("prefix_misses", "prefix_misses"),
    ("prefix_disk_hits", "prefix_disk_hits"), ("prefix_disk_misses", "prefix_disk_misses"),
    ("prefix_disk_errors", "prefix_disk_errors"), ("prefix_disk_writes", "prefix_disk_writes"),
    ("prefix_disk_dropped", "prefix_disk_dropped"), ("prefix_disk_bytes", "prefix_disk_bytes"),
    ("prefix_disk_entries", "prefix_disk_entries"), ("device", "device"),
)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A claimed job ready for its model's engine: the engine's request, the parser of its tool calls (None: the
    request gives no tools, or the model has no tool-call format), and each token's text for its log-probabilities
    (None: it asked for none)."""

    request: EngineRequest
    tools: ToolCalls | None = None
    token_text: Callable[[int], str] | None = None


class ModelService:
    """One served model: load it, prepare its jobs, run them through its engine."""

    def __init__(self, served: ServedModel, config: WorkerConfig) -> None:
        self.served = served
        self.name = served.name
        self.queue = config.keys.queue(served.name)
        self.config = config
        self.engine: Engine | None = None
        self.model: LoadedModel | None = None
        self.active: set[tuple[str, int]] = set()  # its jobs in this worker, claimed and not ended: (id, try)
        self.error: str | None = None  # why its engine died
        self.on_dead: Callable[[ModelService], None] = lambda service: None  # called on the event loop
        # Its jobs' images are prepared one at a time, in arrival order (see worker/media.py); started with
        # the first image job.
        self._images = ThreadPoolExecutor(1, thread_name_prefix=f"mlxq-images-{served.name}")
        self._grammars: Grammars | None = None  # built for the first job with a response format
        self._grammars_lock = asyncio.Lock()
        self._token_texts: dict[int, str] = {}
        self.weights: dict[str, float] = {}  # tenant -> weight, as the host last read the policies

    async def load(self, sink: Sink) -> None:
        """Load the model on a new MLX thread of its own and start its engine."""
        cfg = self.config
        share = 1 / max(1, len(cfg.served))  # the machine's memory is split evenly between the models
        opts = EngineOptions(cfg.capacity, cfg.prefill_batch_size, cfg.prefill_step_size,
                             stream_interval_s=cfg.stream_interval_ms / 1000, stream_rate=cfg.stream_rate,
                             kv_headroom_bytes=_bytes(cfg.kv_headroom_gb, share),
                             prefix_cache_bytes=_bytes(cfg.prefix_cache_gb, 1.0), aging_s=cfg.priority_aging_s,
                             memory_share=share, speculation=_speculation(cfg, self.served),
                             kv_disk_bytes=int(cfg.kv_disk_gb * (1 << 30)), kv_dir=cfg.kv_dir)
        self.engine, self.model = await start_engine(self.served.path, sink, opts)
        loop = asyncio.get_running_loop()

        def on_dead() -> None:  # runs on the MLX thread
            loop.call_soon_threadsafe(self._died)

        self.engine.on_dead = on_dead

    def _died(self) -> None:
        self.error = "its engine failed and could not be rebuilt"
        log.critical("model %s: %s; its jobs fail with engine_error", self.name, self.error)
        self.on_dead(self)

    async def aclose(self) -> None:
        """Stop the engine, joining its MLX thread (returns once no MLX call runs)."""
        self._images.shutdown(wait=False)  # what is queued still ends (quickly), as its jobs expect
        if self.engine is not None:
            await self.engine.aclose()

    # --- state -------------------------------------------------------------------------------------
    @property
    def state(self) -> ModelState:
        if self.engine is None:
            return ModelState.LOADING
        return ModelState.DEAD if self.engine.dead else ModelState.SERVING

    def room(self) -> int:
        """How many more jobs it takes now: what its engine can start soon (free slots, within its KV headroom,
        not promised to jobs already claimed), so other workers take what it has no room for."""
        if self.state is not ModelState.SERVING or self.engine is None:
            return 0
        return max(0, min(self.engine.claim_capacity(), self.config.jobs_per_model - self._unpaused()))

    def outranking(self) -> Outranking | None:
        """What queued jobs need for this model's full engine to take them now (each starts at once, preempting a
        running sequence of lower priority), and how many it takes; None when the engine has room, or no such
        job could start now. Preempted jobs waiting to resume do not count against the model's job cap."""
        engine = self.engine
        if self.state is not ModelState.SERVING or engine is None or self._unpaused() >= self.config.jobs_per_model:
            return None
        lowest, count = engine.outranked_priority(), engine.outranking_room()
        if lowest is None or lowest >= PRIORITY_MAX or count == 0:
            return None
        return Outranking(lowest + 1, int(self.config.priority_aging_s * 1000), count)

    def below_share(self) -> BelowShare | None:
        """What a queued job's tenant must be for this model's full engine to take it now: below its share of the
        batch, so it starts at once in the place of a running job of a tenant above it (engine/shares.py); None
        when the engine has room, or no such job could start now. Each tenant's jobs count its running ones and
        those on their way or waiting unstarted, so a claim takes no more than the share has room for."""
        engine = self.engine
        if self.state is not ModelState.SERVING or engine is None or self._unpaused() >= self.config.jobs_per_model:
            return None
        groups = engine.groups_open()
        if not groups:
            return None
        return BelowShare(max(g.spare for g in groups), {g.group: g.taken for g in groups})

    def _unpaused(self) -> int:
        """Its jobs in this worker less those preempted and waiting to resume."""
        return len(self.active) - (self.engine.paused() if self.engine is not None else 0)

    def status(self, tokens_per_s: float) -> ModelStatus:
        """Its part of the worker's health record."""
        running = self.engine.scheduler.num_running if self.engine is not None else 0
        stats = self.engine.counters() if self.engine is not None else None
        counters = {f: getattr(stats, name) for f, name in _RECORD_STATS} if stats is not None else {}
        model = self.model
        return ModelStatus(name=self.name, state=self.state, capacity=self.config.capacity, running=running,
                           waiting=max(0, len(self.active) - running), tokens_per_s=round(tokens_per_s, 1),
                           accepts_images=model is not None and model.accepts_images,
                           context_length=model.context_length if model is not None else None, error=self.error,
                           speculation=self.config.speculation(self.served), **counters)

    # --- jobs ----------------------------------------------------------------------------------------
    def claimed(self, entries: Sequence[DueEntry]) -> None:
        """Jobs just claimed for this model: they count against its room until released, and its idle engine
        waits for all of them (up to ``admit_wait_ms``) before its first step."""
        self.active.update((entry.rid, entry.attempt) for entry in entries)
        if entries and self.engine is not None:
            tenants = [self.config.keys.queue_of(entry.queue)[1] for entry in entries]  # their requests' groups
            self.engine.expect(len(entries), self.config.admit_wait_ms / 1000, tenants)

    def release(self, entry: DueEntry) -> None:
        """A claimed job left this worker (ended, handed back, fenced, or failed)."""
        self.active.discard((entry.rid, entry.attempt))

    def add(self, request: EngineRequest) -> None:
        """A prepared job's request enters the engine (its run is in the run table first)."""
        assert self.engine is not None
        self.engine.add(request)

    def abort(self, rid: str) -> None:
        """Drop a job between steps (thread-safe; unknown ids are ignored)."""
        if self.engine is not None:
            self.engine.abort(rid)

    def validate(self, payload: Any, job_id: str) -> GenerateRequest:
        """The request a job carries, if this model can ever serve it; else :class:`BadRequest`."""
        try:
            req = GenerateRequest.model_validate(payload)
        except ValidationError as exc:
            raise BadRequest("invalid request: " + describe(exc)) from None
        cfg = self.config
        if len(req.stop) > cfg.max_stop_strings or any(len(s) > cfg.max_stop_chars for s in req.stop):
            raise BadRequest(f"at most {cfg.max_stop_strings} stop strings of at most {cfg.max_stop_chars} chars")
        if req.id != job_id:
            raise BadRequest(f"request id {req.id!r} does not match job id {job_id!r}")
        if req.model not in (self.served.name, self.served.path):
            raise BadRequest(f"unknown model {req.model!r}: this queue serves {self.name!r}")
        if req.max_tokens > cfg.max_tokens_limit and not req.fit_max_tokens:
            raise BadRequest(f"max_tokens {req.max_tokens} exceeds this worker's limit {cfg.max_tokens_limit}")
        return req

    async def prepare(self, envelope: Envelope, job_id: str) -> Prepared:
        """A claimed job made ready for this model's engine: its request validated against the model's limits,
        its prompt tokenized (or its images read, checked and processed), its output format compiled, the long
        parts of that off the event loop, which keeps serving events; :class:`BadRequest` if the job can never
        run as sent."""
        if envelope.problem:
            raise BadRequest(envelope.problem)
        req = self.validate(envelope.payload, job_id)
        chars = self._check_prompt(req)
        if media.has_images(req):  # worker/media.py, on the model's image thread
            request = await self._image_request(req, envelope.enqueue_ms)
        else:
            request = await self._text_request(req, chars, envelope.enqueue_ms)
        return Prepared(request, self._tool_calls(req), self._token_text if req.logprobs is not None else None)

    def _check_prompt(self, req: GenerateRequest) -> int:
        """The prompt's characters (within the limit, before anything tokenizes them); a vision-language model
        refuses what its batch cannot do."""
        chars = len(req.prompt or "") + sum(len(m.text) for m in req.messages or [])
        if chars > self.config.max_payload_bytes:
            raise BadRequest(f"the prompt has {chars} characters; the limit is {self.config.max_payload_bytes}")
        if self.model is not None and self.model.accepts_images:  # mlx-vlm's batch takes none of these
            formatted = req.response_format is not None and req.response_format.type != "text"
            for asked, what in ((req.logprobs is not None, "logprobs are"), (req.calls_tools, "tools are"),
                                (formatted, "response_format is")):
                if asked:
                    raise BadRequest(f"{what} not supported by the vision-language model {self.name!r}")
        return chars

    async def _image_request(self, req: GenerateRequest, enqueue_ms: int) -> EngineRequest:
        assert self.model is not None and self.engine is not None
        try:
            prompt = await media.prepare(req, self.model, self.config, self._images)
        except media.ImageError as exc:
            raise BadRequest(str(exc)) from None
        # Images take a few ms to prepare: an idle engine waits on for the rest of their claimed burst.
        self.engine.expect(0, self.config.admit_wait_ms / 1000)
        return self._request(req, prompt.tokens, enqueue_ms, images=prompt.images)

    async def _text_request(self, req: GenerateRequest, chars: int, enqueue_ms: int) -> EngineRequest:
        if chars < _INLINE_TOKENIZE_CHARS:
            encoded = self.encode(req, inline=True)
        else:
            encoded = await asyncio.to_thread(self.encode, req, False)
        parts = self._part_markers(req, encoded.tokens)
        fmt = to_engine_format(req) if req.response_format is not None else self._call_format(req)
        grammar = await self._compile_format(fmt) if fmt is not None else None
        return self._request(req, encoded.tokens, enqueue_ms, cache_boundary=encoded.cache_boundary, format=grammar,
                             parts=parts)

    def _request(self, req: GenerateRequest, tokens: list[int], enqueue_ms: int, *, cache_boundary: int = 0,
                 images: ImageInputs | None = None, format: Format | None = None, parts: PartMarkers | None = None
                 ) -> EngineRequest:
        """The engine's request, its deadline ``job_timeout_s`` from now."""
        req = self._fitted(req, len(tokens))
        deadline = time.monotonic() + self.config.job_timeout_s
        return to_engine_request(req, tokens, deadline, cache_boundary=cache_boundary, images=images, format=format,
                                 parts=parts, enqueue_ms=enqueue_ms, weight=self.weights.get(req.tenant, 1.0))

    def _token_text(self, token: int) -> str:
        """One token's text, as the tokenizer decodes it alone (memoized: a vocabulary is finite)."""
        text = self._token_texts.get(token)
        if text is None:
            assert self.model is not None
            text = self._token_texts[token] = str(self.model.tokenizer.decode([token]))
        return text

    def _part_markers(self, req: GenerateRequest, tokens: list[int]) -> PartMarkers | None:
        """The markers the request's text is split by (None: one text): the model's think markers when the request
        wants reasoning apart, and whether its prompt leaves the output inside reasoning (a template that opens
        it); its tool-call markers when the request gives tools and the model has a tool-call format."""
        tokenizer = self.model.tokenizer if self.model is not None else None
        if tokenizer is None:
            return None
        think: tuple[str, str] | None = None
        inside = False
        if req.reasoning == "split" and getattr(tokenizer, "has_thinking", False):
            think = (tokenizer.think_start, tokenizer.think_end)
            tail = len(tokens) - _THINK_TAIL  # a template that opens reasoning does so in its generation prompt
            opened = tokenizer.rfind_think_start(tokens, start=tail)
            inside = opened >= 0 and opened > tokenizer.rfind_think_end(tokens, start=tail)
        tool = self._tool_markers(req)
        cut = tool is not None and req.tool_choice != "auto"  # constrained to calls: a cut one's markup is no text
        return PartMarkers(think, tool, inside, cut) if think is not None or tool is not None else None

    def _tool_calls(self, req: GenerateRequest) -> ToolCalls | None:
        """The parser of a job's tool calls (None: the request gives no tools, or the model has no tool-call
        format, so what it writes is all answer)."""
        markers = self._tool_markers(req)
        if markers is None:
            return None
        assert self.model is not None
        return ToolCalls(req.id, self.model.tokenizer.tool_parser, template_tools(req), markers)

    def _tool_markers(self, req: GenerateRequest) -> tuple[str, str] | None:
        """The model's tool-call markers, for a request whose tools it is shown (None: no tools, or no format
        with both markers)."""
        tokenizer = self.model.tokenizer if self.model is not None else None
        if not req.calls_tools or tokenizer is None or not getattr(tokenizer, "has_tool_calling", False):
            return None
        return (tokenizer.tool_call_start, tokenizer.tool_call_end) if tokenizer.tool_call_end else None

    def _call_format(self, req: GenerateRequest) -> ResponseFormat | None:
        """The grammar a job's tool_choice (required, or a named function) constrains its output to."""
        assert self.model is not None
        try:
            grammar = call_grammar(req, self.model.tokenizer)
        except CallGrammarError as exc:
            raise BadRequest(f"model {self.name!r}: {exc}") from None
        return ResponseFormat(FormatKind.LARK, grammar) if grammar is not None else None

    async def _compile_format(self, fmt: ResponseFormat) -> Grammar:
        """A response format compiled for this model (a format seen before: from the cache, at once; a new one:
        compiled off the event loop); :class:`BadRequest` if it cannot be."""
        grammars = self._grammars or await self._build_grammars()
        grammar = grammars.cached(fmt)
        if grammar is not None:
            return grammar
        try:
            return await asyncio.to_thread(grammars.compile, fmt)
        except GrammarError as exc:
            raise BadRequest(str(exc)) from None

    async def _build_grammars(self) -> Grammars:
        async with self._grammars_lock:
            grammars = self._grammars
            if grammars is None:
                model = self.model
                assert model is not None
                grammars = self._grammars = await asyncio.to_thread(
                    Grammars, model.tokenizer._tokenizer, vocab_size(model.model, model.tokenizer), model.eos_token_ids)
            return grammars

    def encode(self, req: GenerateRequest, inline: bool) -> EncodedPrompt:
        """The prompt's tokens and its system-prompt boundary (where the engine caches a prefix). Inline:
        without releasing the GIL (see ``PromptEncoder``); else through transformers, which releases it while
        a long prompt encodes."""
        assert self.model is not None
        messages = template_messages(req) if req.messages is not None else None
        template: dict[str, Any] = {} if req.enable_thinking is None else {"enable_thinking": req.enable_thinking}
        if req.calls_tools:
            template["tools"] = template_tools(req)
        try:
            if inline:
                encoded = self.model.prompts.encode_with_boundary(req.prompt, messages, **template)
            else:
                encoded = encode_prompt_with_boundary(self.model.tokenizer, req.prompt, messages, **template)
        except Exception as exc:  # a template or tokenizer error is the request's fault
            raise BadRequest(f"could not tokenize the prompt: {exc}") from None
        tokens = encoded.tokens
        ctx = self.model.context_length
        limit = min(self.config.max_prompt_tokens, ctx or self.config.max_prompt_tokens)
        if not tokens:
            raise BadRequest("the prompt is empty after tokenization")
        if len(tokens) > limit:
            raise BadRequest(f"prompt has {len(tokens)} tokens; the limit is {limit} (by {len(tokens) - limit})")
        wanted = 1 if req.fit_max_tokens else req.max_tokens  # fitted: at least one token (see _fitted)
        if ctx is not None and len(tokens) + wanted > ctx:
            over = len(tokens) + wanted - ctx
            raise BadRequest(f"prompt ({len(tokens)} tokens) + max_tokens ({wanted}) exceeds the context "
                             f"({ctx}) by {over} tokens")
        return encoded

    def _fitted(self, req: GenerateRequest, prompt_tokens: int) -> GenerateRequest:
        """``req`` with its max_tokens lowered to what fits, where it asks for that (``fit_max_tokens``): this
        worker's MLXQ_MAX_TOKENS and the model's context after the prompt's ``prompt_tokens``."""
        if not req.fit_max_tokens:
            return req
        most = min(req.max_tokens, self.config.max_tokens_limit)
        ctx = self.model.context_length if self.model is not None else None
        if ctx is not None:
            most = min(most, ctx - prompt_tokens)
        return req if most == req.max_tokens else req.model_copy(update={"max_tokens": most})


def _speculation(cfg: WorkerConfig, served: ServedModel) -> Speculation | None:
    mode = cfg.speculation(served)
    if not mode:
        return None
    return Speculation(SpecKind(mode), served.draft or None, cfg.speculate_k)


def _bytes(gigabytes: float | None, share: float) -> int | None:
    return None if gigabytes is None else int(gigabytes * share * (1 << 30))
