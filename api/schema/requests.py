"""The wire schema's requests: one generation job as a producer submits it (:class:`GenerateRequest`), its
messages, content parts, tools and response formats, and the hard bounds no deployment accepts past.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DEFAULT_TENANT",
    "MAX_CACHE_KEY_CHARS",
    "MAX_CONTENT_PARTS",
    "MAX_EMBED_INPUTS",
    "MAX_EXPIRY_S",
    "MAX_FORMAT_CHARS",
    "MAX_IMAGES",
    "MAX_IMAGE_URL_CHARS",
    "MAX_KEEP_RESULT_S",
    "MAX_MESSAGES",
    "MAX_METADATA_ITEMS",
    "MAX_PROMPT_CHARS",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TOKENS_CEILING",
    "MAX_TOOLS",
    "MAX_TOOLS_CHARS",
    "MAX_TOOL_CALLS",
    "MAX_TOP_LOGPROBS",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "REQUEST_ID_PATTERN",
    "TENANT_PATTERN",
    "TOOL_NAME_PATTERN",
    "ChatMessage",
    "ContentPart",
    "FunctionCall",
    "FunctionDef",
    "GenerateRequest",
    "GrammarFormat",
    "ImagePart",
    "ImageURL",
    "JSONObjectFormat",
    "JSONSchemaFormat",
    "JSONSchemaSpec",
    "NamedToolChoice",
    "RegexFormat",
    "ResponseFormat",
    "TextFormat",
    "TextPart",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "as_bulk",
    "image_data_url",
    "job_bytes_limit",
    "new_request_id",
]

# Hard schema bounds: what no deployment accepts. Worker config applies tighter, model-aware limits.
MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1_000
MAX_TOKENS_CEILING = 1_000_000
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_METADATA_ITEMS = 32
PRIORITY_MIN, PRIORITY_MAX = -100, 100
# What a model's bulk band queues under: its name with this appended (api.protocol.keys.band_model); no model's
# name ends so.
BULK_MARK = "~bulk"
MAX_EXPIRY_S = 86_400.0  # a job record lives a day; it cannot wait longer than that
MAX_KEEP_RESULT_S = 30 * 86_400  # a request keeps its result at most 30 days (as OpenAI keeps responses)
MAX_CONTENT_PARTS = 256  # per message
MAX_IMAGES = 64  # per request
MAX_IMAGE_URL_CHARS = 48 << 20  # a data URL of a ~36 MiB image
REQUEST_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
TENANT_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"  # no ':': a tenant's queue name holds it (api.protocol.keys.Keys.queue)
DEFAULT_TENANT = "default"
MAX_FORMAT_CHARS = 64 << 10  # a response format's schema (as JSON), regex or grammar
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs bound)
MAX_TOOLS = 128  # OpenAI's bound
MAX_TOOLS_CHARS = 256 << 10  # the tools' definitions as JSON
MAX_TOOL_CALLS = 64  # in one assistant message
MAX_CACHE_KEY_CHARS = 256  # a prompt_cache_key (a routing hint: hashed, never stored whole)
MAX_EMBED_INPUTS = 2048  # inputs of one embedding job (OpenAI's bound)
MAX_TOKEN_ID = 2**31 - 1
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


def new_request_id() -> str:
    """A fresh request id (uuid4 hex); it is also the arq job id. Never reuse one."""
    return uuid.uuid4().hex



class TextPart(BaseModel):
    """Text in a message's content list (OpenAI's shape)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class ImageURL(BaseModel):
    """Where an image is: a ``data:image/...;base64,...`` URL, or an http(s) URL where a deployment enables
    them. ``detail`` is accepted for OpenAI compatibility and ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(min_length=1, max_length=MAX_IMAGE_URL_CHARS)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    """An image in a user message's content list (OpenAI's shape); only models that accept images take it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]  # noqa: UP007


class FunctionCall(BaseModel):
    """A call of a function: its name and its arguments as JSON text (OpenAI's shape)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(default="{}", max_length=MAX_PROMPT_CHARS)


class ToolCall(BaseModel):
    """One tool call a model made (an assistant message's, a done event's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat turn, rendered with the model's own chat template: a string, or a list of text and image
    parts in order (images in user turns only). An assistant turn may carry the ``tool_calls`` it made; a
    ``tool`` turn is one call's result (``tool_call_id`` names the call)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[
        list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)
    ] = ""
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(default=None, max_length=256)
    name: str | None = Field(default=None, max_length=256)  # a tool turn's function (some templates show it)

    @property
    def text(self) -> str:
        """The message's text: the string, or its text parts joined (as mlx-lm's server joins them)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def images(self) -> list[ImagePart]:
        """The message's image parts, in order."""
        return [] if isinstance(self.content, str) else [p for p in self.content if isinstance(p, ImagePart)]

    @model_validator(mode="after")
    def _bounded_parts(self) -> ChatMessage:
        if isinstance(self.content, list):
            if self.role != "user" and self.images:
                raise ValueError("images are allowed in user messages only")
            if sum(len(p.text) for p in self.content if isinstance(p, TextPart)) > MAX_PROMPT_CHARS:
                raise ValueError(f"at most {MAX_PROMPT_CHARS} characters of text in a message")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls are allowed in assistant messages only")
        return self


class FunctionDef(BaseModel):
    """A function the model may call: its name, what it does, and its arguments as a JSON schema."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_FORMAT_CHARS)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # accepted; a call the output is constrained to always follows the schema

    @model_validator(mode="after")
    def _object_schema(self) -> FunctionDef:
        kind = self.parameters.get("type", "object")
        if kind != "object":
            raise ValueError(f"function {self.name!r}: parameters must be a JSON schema of an object, "
                             f"not of type {kind!r}")
        if not isinstance(self.parameters.get("properties", {}), dict):
            raise ValueError(f"function {self.name!r}: parameters' properties must be an object")
        return self


class Tool(BaseModel):
    """A tool the model may call (OpenAI's shape; functions only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)


class NamedToolChoice(BaseModel):
    """Call this function (OpenAI's ``{"type": "function", "function": {"name": ...}}``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


# auto: the model chooses; none: no call (the tools are not shown to it); required: one call or more;
# named: a call of that function.
ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class TextFormat(BaseModel):
    """Free text (the default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    """Any JSON object (OpenAI's JSON mode)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["json_object"]


class JSONSchemaSpec(BaseModel):
    """A JSON schema the output must validate against (OpenAI's ``json_schema`` object). The output is always
    constrained to the schema, whatever ``strict`` says."""

    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True, validate_by_name=True)

    name: str = Field(default="response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=4096)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JSONSchemaFormat(BaseModel):
    """Output that validates against ``json_schema.schema``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec

    @model_validator(mode="after")
    def _bounded(self) -> JSONSchemaFormat:
        if len(self.schema_text) > MAX_FORMAT_CHARS:
            raise ValueError(f"the JSON schema is {len(self.schema_text)} characters as JSON; at most "
                             f"{MAX_FORMAT_CHARS}")
        return self

    @property
    def schema_text(self) -> str:
        """The schema as compact JSON with sorted keys: one text per schema, whatever the order it came in."""
        return json.dumps(self.json_schema.schema_, sort_keys=True, separators=(",", ":"))


class RegexFormat(BaseModel):
    """Output that matches a regular expression (whole)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["regex"]
    regex: str = Field(min_length=1, max_length=MAX_FORMAT_CHARS)


class GrammarFormat(BaseModel):
    """Output that a grammar accepts: Lark syntax (llguidance's dialect, which may embed ``%json`` schemas)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["grammar"]
    grammar: str = Field(min_length=1, max_length=MAX_FORMAT_CHARS)
    syntax: Literal["lark"] = "lark"


ResponseFormat = Annotated[
    Union[TextFormat, JSONObjectFormat, JSONSchemaFormat, RegexFormat, GrammarFormat],  # noqa: UP007
    Field(discriminator="type"),
]


EmbedText = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
EmbedTokens = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1)]


class GenerateRequest(BaseModel):
    """A job as enqueued: a generation job gives exactly one of ``prompt`` or ``messages``; an embedding job
    gives ``input`` instead (for an embedding model: one vector per input, in the done event's ``embeddings``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(default_factory=new_request_id, pattern=REQUEST_ID_PATTERN)
    model: str = Field(min_length=1, max_length=512)
    prompt: str | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS_CEILING)
    # True: max_tokens is a ceiling the worker lowers to what fits (the model's context after the prompt, and its
    # MLXQ_MAX_TOKENS), as OpenAI's API serves a request that names none; False: one that does not fit is refused.
    fit_max_tokens: bool = False
    temperature: float = Field(default=0.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0, le=1_000_000)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)  # OpenAI's ranges
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    # Higher runs first; within a level, first come first served. Each level is worth the deployment's
    # MLXQ_PRIORITY_AGING seconds of waiting, so a job waits at most that long per level behind later ones.
    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    # Whose job it is: tenants share the fleet by their weights (``mlxq tenants``); priority orders a tenant's
    # own jobs. A name without a policy entry gets the default policy.
    tenant: str = Field(default=DEFAULT_TENANT, pattern=TENANT_PATTERN)
    # Seconds the job may wait queued before it ends with error(expired); None: the client's default
    # (MLXQ_JOB_EXPIRY), 0: no expiry (it waits as long as its record lives, a day).
    expires_in: float | None = Field(default=None, ge=0.0, le=MAX_EXPIRY_S, allow_inf_nan=False)
    # Seconds the job's result (text, reasoning, its end) is kept after its end, for Client.result and `mlxq job`
    # by id long after its events expired; None: the workers' MLXQ_KEEP_RESULT, 0: not kept.
    keep_result_s: int | None = Field(default=None, ge=0, le=MAX_KEEP_RESULT_S)
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict, max_length=MAX_METADATA_ITEMS
    )
    # What the output must match (None or text: free text); a worker compiles it, or ends the job with
    # error(bad_request) saying why it cannot.
    response_format: ResponseFormat | None = None
    # "split": a reasoning model's thinking goes out as token events' ``reasoning``, apart from the answer's
    # ``text``; "inline": one text, think markers included (what a client of an earlier release reads).
    reasoning: Literal["inline", "split"] = "inline"
    # The chat template's enable_thinking (None: the model's default); only a model that thinks uses it.
    enable_thinking: bool | None = None
    # Each token's log-probability in its token event, with this many most likely alternatives (None: none).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Tools the model may call (chat messages only), rendered by its chat template; its calls come parsed in
    # the token and done events' ``tool_calls``. ``required`` or a named function constrains the output to
    # valid calls (at most one unless ``parallel_tool_calls``).
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    # OpenAI's routing hint: jobs sharing it (a conversation's turns) prefer the worker whose prefix cache holds
    # their prompt's start (api/affinity.py); unset, the producer derives one from the system turn and tools.
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_KEY_CHARS)
    # An embedding job's inputs: texts (each tokenized as the model's tokenizer does, its special tokens added) or
    # token-id lists (embedded as given); an embedding model answers with one vector per input.
    input: list[EmbedText] | list[EmbedTokens] | None = Field(default=None, min_length=1,
                                                                  max_length=MAX_EMBED_INPUTS)
    # An embedding job's vectors cut to their first ``dimensions`` values, normalised again (None: whole).
    dimensions: int | None = Field(default=None, ge=1)

    # The bulk band (a batch's lines, :func:`as_bulk`): it runs only on capacity no interactive job wants, below
    # every priority (its ``priority`` orders it among bulk jobs only), and gives way at once to an interactive
    # job that finds its engine full (preempted, it resumes later).
    bulk: bool = False

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if sum(x is not None for x in (self.prompt, self.messages, self.input)) != 1:
            raise ValueError("give exactly one of 'prompt', 'messages' or 'input'")
        if self.dimensions is not None and self.input is None:
            raise ValueError("dimensions are for an embedding job (input)")
        if self.model.endswith(BULK_MARK):
            raise ValueError(f"a model's name does not end with {BULK_MARK!r} (its bulk band's queues do)")
        if len(self.image_parts) > MAX_IMAGES:
            raise ValueError(f"at most {MAX_IMAGES} images in a request")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        choice = self.tool_choice
        if self.tools is None:
            if choice == "required" or isinstance(choice, NamedToolChoice):
                raise ValueError("tool_choice requires tools")
            return
        if self.messages is None:
            raise ValueError("tools need chat messages (the chat template renders them), not a prompt")
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is none of the tools")
        if len(self.tools_json) > MAX_TOOLS_CHARS:
            raise ValueError(f"the tools are {len(self.tools_json)} characters as JSON; at most {MAX_TOOLS_CHARS}")
        if self.response_format is not None and self.response_format.type != "text" and choice not in ("auto", "none"):
            raise ValueError("a response_format and a tool_choice that constrains the calls cannot both hold")

    @property
    def embeds(self) -> bool:
        """Whether it is an embedding job (``input``), not a generation job."""
        return self.input is not None

    @property
    def tools_json(self) -> str:
        """The tools as compact JSON with sorted keys (one text per set of tools)."""
        return json.dumps([t.model_dump(exclude_none=True) for t in self.tools or []], sort_keys=True,
                          separators=(",", ":"))

    @property
    def calls_tools(self) -> bool:
        """Whether the model is shown tools and its calls are parsed (tools given, tool_choice not none)."""
        return self.tools is not None and self.tool_choice != "none"

    @property
    def image_parts(self) -> list[ImagePart]:
        """Every image of the request, in the order the chat template renders them."""
        return [p for m in self.messages or [] for p in m.images]


def image_data_url(data: bytes, mime: str = "image/png") -> str:
    """An image file's bytes as the ``data:`` URL an :class:`ImagePart` carries."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def job_bytes_limit(max_payload_bytes: int, max_images: int, max_image_bytes: int) -> int:
    """The largest job (JSON bytes) a worker reads: ``max_payload_bytes`` for the text and parameters, plus the
    data URL of its largest accepted image (base64: 4 bytes per 3, and a header) for each image it may carry.
    So an image job fits, and no job can hold more than this of Redis."""
    return max_payload_bytes + max_images * (4 * -(-max_image_bytes // 3) + 64)


def as_bulk(req: GenerateRequest) -> GenerateRequest:
    """``req`` in the bulk band (what a batch's feeder submits: idle capacity only, ``GenerateRequest.bulk``)."""
    return req.model_copy(update={"bulk": True})
