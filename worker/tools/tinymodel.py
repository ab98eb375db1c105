"""Tiny random-weight language models in the real mlx-lm on-disk format.

Why this exists: tests and perf anchors need a *real* model directory that
``mlx_lm.load(path)`` accepts (config.json + model.safetensors + a Hugging
Face tokenizer with a chat template), but there is no network model hub and
nothing may download weights. This module generates such models locally from
a fixed seed (rebuilds are byte-identical) and caches them on disk. The
weights are random: output is gibberish, but greedy decoding is varied and
deterministic, and the shapes and code paths are the real ones.

Bump ``FORMAT_VERSION`` whenever anything that changes the generated files
(specs, corpus, tokenizer settings, init) changes, so stale caches are ignored.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxq.api.config import ToolConfig

if TYPE_CHECKING:
    import mlx.nn as nn
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "FAMILIES",
    "FORMAT_VERSION",
    "SIZES",
    "SPECIAL_TOKENS",
    "ModelSpec",
    "build_model",
    "build_tokenizer",
    "ensure_model",
    "model_config",
    "model_dir",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3
DEFAULT_CACHE_ROOT = Path("~/.cache/mlxq/models")  # unless MLXQ_MODEL_CACHE (api.config.ToolConfig) names one

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
EOS_TOKEN = IM_END
PAD_TOKEN = ENDOFTEXT

# Qwen-style ChatML (no default system prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# ChatML with thinking, as Qwen3's thinking models render it: the generation prompt opens a think block
# (the output starts inside reasoning), or with enable_thinking false holds an empty one.
THINK_START, THINK_END = "<think>", "</think>"
THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)

# ChatML with tools, in the Hermes format mlx-lm parses as ``json_tools``: the tools' JSON signatures in the
# system turn; each call a JSON object {"name", "arguments"} between <tool_call> markers; each result a
# <tool_response> in a user turn.
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nFunction signatures within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall a function with a JSON object {\\\"name\\\": ..., \\\"arguments\\\": ...}"
    " between <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + tool_call.name + '\\\", \\\"arguments\\\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Init scales, chosen empirically: with mlx's defaults (embedding std
# 1/sqrt(d), matrix bound 1/sqrt(fan_in)) greedy decoding of a random model
# collapses into one repeated token; these keep it varied.
_EMBED_STD = 1.0
_MATRIX_GAIN = 3.0

_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "nemotron_h": "NemotronHForCausalLM",
                  "qwen3_next": "Qwen3NextForCausalLM", "gpt_oss": "GptOssForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM"}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a generated model; ``vocab_size`` is the BPE target size."""

    name: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    ascii_only: bool = False  # BPE base alphabet: the 128 ASCII bytes, else all 256
    # Untied: with tied random embeddings greedy decoding echoes the last token.
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    seed: int = 0
    thinking: bool = False  # think markers in the vocabulary and a template that opens a think block
    tools: bool = False  # tool-call markers in the vocabulary and a template that renders tools and calls
    # A target for speculative decoding: the weights of the model ``grows`` names (same tokenizer) as its first
    # layers, then more layers whose output projections are scaled by ``growth``, so the two mostly agree.
    grows: str | None = None
    growth: float = 0.0
    # The architecture's own config.json keys, beside the common ones (``FAMILIES``' layer stacks, experts,
    # windows, latent attention); none for the qwen3 and llama models.
    arch: tuple[tuple[str, Any], ...] = ()
    # An embedding model of the Qwen3-Embedding kind: sentence-transformers' files (last-token pooling, then
    # normalisation) beside the qwen3 checkpoint, and a tokenizer that appends <|endoftext|> to every input.
    embedding: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


SIZES: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny",
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    "small": ModelSpec(
        name="small",
        model_type="llama",
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1536,
        vocab_size=1024,
        max_position_embeddings=4096,  # room for the bench's 2,000-token system prompt and long jobs beside it
        ascii_only=True,
    ),
}


SIZES["tiny-think"] = dataclasses.replace(SIZES["tiny"], name="tiny-think", thinking=True)  # a reasoning model's
SIZES["tiny-tools"] = dataclasses.replace(SIZES["tiny"], name="tiny-tools", tools=True,  # a tool-calling model's
                                         max_position_embeddings=4096)  # tools take room in the prompt
# Heads of 64 values, grouped queries: a KV cache quantized in groups of 64 (engine/mlx/quantized_cache.py).
SIZES["tiny-kvq"] = dataclasses.replace(SIZES["tiny"], name="tiny-kvq", hidden_size=128, num_attention_heads=2,
                                        num_key_value_heads=1)
# Draft/target pairs for speculative decoding (the target grows the draft: see ModelSpec.grows).
SIZES["tiny-draft"] = dataclasses.replace(SIZES["tiny"], name="tiny-draft", num_hidden_layers=1)
SIZES["tiny-target"] = dataclasses.replace(SIZES["tiny"], name="tiny-target", num_hidden_layers=3,
                                           grows="tiny-draft", growth=0.15)
SIZES["small-draft"] = dataclasses.replace(SIZES["small"], name="small-draft", num_hidden_layers=1)
SIZES["small-target"] = dataclasses.replace(SIZES["small"], name="small-target", num_hidden_layers=12,
                                            grows="small-draft", growth=0.03)

# Embedding models of the Qwen3-Embedding kind (ModelSpec.embedding): a tiny one for the tests, a small one for
# the embeddings benchmark (tests/perf/embeddings.py). Tied embeddings, as Qwen3-Embedding's (no head is used).
SIZES["tiny-embed"] = dataclasses.replace(SIZES["tiny"], name="tiny-embed", embedding=True, tie_word_embeddings=True)
SIZES["small-embed"] = dataclasses.replace(SIZES["small"], name="small-embed", model_type="qwen3", embedding=True,
                                           tie_word_embeddings=True, max_position_embeddings=1024)

# One tiny model of each architecture family people serve (the tiny model's shape and tokenizer, the family's own
# layers): the engine's architecture matrix (tests/engine/test_engine_families.py).
def _family(model_type: str, layers: int = 2, **arch: Any) -> ModelSpec:
    return dataclasses.replace(SIZES["tiny"], name=f"tiny-{model_type}", model_type=model_type,
                               num_hidden_layers=layers, arch=tuple(arch.items()))


_EXPERTS: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
FAMILIES: dict[str, ModelSpec] = {spec.model_type: spec for spec in (
    # hybrid SSM: Mamba-2 and attention layers (NVIDIA Nemotron-H)
    _family("nemotron_h", layers=4, hybrid_override_pattern=["M", "*", "M", "-"], mamba_num_heads=8,
            mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=2, mlp_bias=False,
            layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True),
    # hybrid linear attention: gated delta-net and attention layers, with experts (Qwen3-Next)
    _family("qwen3_next", linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, decoder_sparse_step=1,
            shared_expert_intermediate_size=64, mlp_only_layers=[], partial_rotary_factor=0.25,
            full_attention_interval=2, **_EXPERTS),
    # sliding-window attention with sinks, its window short enough for the tests' sequences to pass it (gpt-oss)
    _family("gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"]),
    # multi-head latent attention and shared experts (DeepSeek-V3, whose architecture Kimi K2 has)
    _family("deepseek_v3", kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, **_EXPERTS),
    _family("qwen3_moe", num_experts=4, decoder_sparse_step=1, mlp_only_layers=[], **_EXPERTS),
    _family("mixtral", num_local_experts=4, num_experts_per_tok=2),
)}
SIZES.update({spec.name: spec for spec in FAMILIES.values()})


def model_dir(size: str = "tiny", root: Path | None = None) -> Path:
    """Where the model of ``size`` lives (or would live); does not create it."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; expected one of {sorted(SIZES)}")
    return _cache_root(root) / f"{size}-v{FORMAT_VERSION}"


def ensure_model(size: str = "tiny", root: Path | None = None) -> Path:
    """Return the model directory for ``size``, building it first if missing.

    Safe against concurrent builders: each builds into a private temp dir
    beside the target and renames it into place; a loser of the rename race
    discards its copy and uses the winner's.
    """
    final = model_dir(size, root)
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        start = time.perf_counter()
        build_model(SIZES[size], tmp)
        logger.info("built %s model in %.2fs", size, time.perf_counter() - start)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_model(spec: ModelSpec, out: Path) -> None:
    """Write config, tokenizer and random weights for ``spec`` into ``out``."""
    tokenizer = build_tokenizer(spec)
    tokenizer.save_pretrained(str(out))
    config = model_config(spec, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special_ids = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS]
    model = _init_model(config, spec.seed, special_ids=special_ids)
    weights = dict(tree_flatten(model.parameters()))
    if spec.grows is not None:
        weights = _grown(weights, SIZES[spec.grows], spec, len(tokenizer), tokenizer.eos_token_id, special_ids)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    if spec.embedding:
        _write_sentence_transformers(out, config["hidden_size"])


def _write_sentence_transformers(out: Path, dims: int) -> None:
    """sentence-transformers' files of a Qwen3-Embedding checkpoint: its modules (Transformer, Pooling,
    Normalize) and a pooling config that pools the last token (what makes mlxq serve it as an embedding model)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    pooling = {"word_embedding_dimension": dims, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True}
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    (out / "2_Normalize").mkdir()


def model_config(spec: ModelSpec, vocab_size: int, eos_token_id: int) -> dict[str, Any]:
    """The config.json contents (a Hugging Face style config mlx_lm accepts)."""
    return {
        "architectures": [_ARCHITECTURES[spec.model_type]],
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
        "mlxq": {"format_version": FORMAT_VERSION, "size": spec.name, "seed": spec.seed},
        **dict(spec.arch),
    }


def build_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=_byte_alphabet(spec.ascii_only),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(spec.seed), trainer)
    if spec.embedding:  # as Qwen3-Embedding's tokenizer.json: every input ends with <|endoftext|>, the pooled token
        eot = tok.token_to_id(ENDOFTEXT)
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A:0 {ENDOFTEXT}:0", pair=f"$A:0 {ENDOFTEXT}:0 $B:1 {ENDOFTEXT}:1",
            special_tokens=[(ENDOFTEXT, eot)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    if spec.thinking:
        wrapped.add_tokens([THINK_START, THINK_END])  # added, not special: decoded as text, as Qwen3's are
        wrapped.chat_template = THINK_TEMPLATE
    if spec.tools:
        wrapped.add_tokens([TOOL_START, TOOL_END])  # added, not special, as Qwen's are
        wrapped.chat_template = TOOLS_TEMPLATE
    return wrapped


def corpus(seed: int = 0, n_lines: int = 4000) -> list[str]:
    """A deterministic English-ish training corpus (real + pseudo words)."""
    rng = random.Random(seed)
    words = _COMMON_WORDS.split() + [_pseudo_word(rng) for _ in range(600)]
    weights = [1.0 / (rank + 1) for rank in range(len(words))]  # Zipf-like
    lines = []
    for _ in range(n_lines):
        sentence = " ".join(rng.choices(words, weights, k=rng.randint(3, 14)))
        tail = f" {rng.randint(0, 9999)}" if rng.random() < 0.15 else ""
        lines.append(sentence.capitalize() + rng.choice(".,;:!?") + tail)
    return lines


def _pseudo_word(rng: random.Random) -> str:
    onsets, vowels = _ONSETS.split(), _VOWELS.split()
    return "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(1, 3)))


def _byte_alphabet(ascii_only: bool) -> list[str]:
    from tokenizers import pre_tokenizers

    if not ascii_only:
        return list(pre_tokenizers.ByteLevel.alphabet())
    # Map bytes 0..127 through the byte-level pre-tokenizer to get their symbols.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    ((mapped, _),) = byte_level.pre_tokenize_str(bytes(range(128)).decode("ascii"))
    return list(mapped)


def _init_model(config: dict[str, Any], seed: int, special_ids: list[Any]) -> nn.Module:
    """Instantiate the real mlx_lm model class with seeded random weights.

    Norm weights are ones; embeddings and matrices are drawn from keys derived
    from ``seed`` (the global mx.random state does not affect the values).
    The lm_head rows of special tokens are zeroed so greedy decoding never
    emits EOS and always runs to ``max_tokens``.
    """
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model: nn.Module = arch.Model(arch.ModelArgs.from_dict(config))
    flat = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), len(flat))
    params = [(name, _init_param(name, p, keys[i])) for i, (name, p) in enumerate(flat)]
    model.update(tree_unflatten(params))
    if not config["tie_word_embeddings"]:
        head = model.lm_head.weight
        head[mx.array(special_ids)] = 0.0
        model.lm_head.weight = head
    mx.eval(model.parameters())
    return model


def _grown(weights: dict[str, mx.array], base: ModelSpec, spec: ModelSpec, vocab_size: int, eos_token_id: int,
           special_ids: list[Any]) -> dict[str, mx.array]:
    """``weights`` (of ``spec``) with ``base``'s weights for its embeddings, head, norm and first layers, and the
    output projections of its other layers scaled by ``spec.growth``."""
    config = model_config(base, vocab_size=vocab_size, eos_token_id=eos_token_id)
    own = dict(tree_flatten(_init_model(config, base.seed, special_ids=special_ids).parameters()))
    out = dict(weights)
    for name, value in weights.items():
        if name in own:
            out[name] = own[name]
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = value * spec.growth
    return out


def _init_param(name: str, param: mx.array, key: mx.array) -> mx.array:
    if param.ndim == 1:  # RMSNorm weights (the models have no biases)
        return mx.ones(param.shape, dtype=mx.float32)
    if name.endswith("embed_tokens.weight"):
        return mx.random.normal(param.shape, scale=_EMBED_STD, key=key)
    bound = _MATRIX_GAIN / math.sqrt(param.shape[-1])
    return mx.random.uniform(-bound, bound, param.shape, key=key)


def _cache_root(root: Path | None) -> Path:
    if root is not None:
        return Path(root)
    named = ToolConfig.from_env().model_cache
    return Path(named).expanduser() if named else DEFAULT_CACHE_ROOT.expanduser()


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move ``tmp`` to ``final``; accept a concurrent winner."""
    tmp.chmod(0o755)  # mkdtemp makes it owner-only
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_complete(final):
            raise
        logger.info("another process built %s first; using it", final)


# Word lists for the built-in corpus (whitespace separated).
_COMMON_WORDS = """
    the of and to a in is it you that he was for on are with as I his they be at one
    have this from or had by word but what some we can out other were all there when up
    use your how said an each she which do their time if will way about many then them
    write would like so these her long make thing see him two has look more day could
    go come did number sound no most people my over know water than call first who may
    down side been now find any new work part take get place made live where after back
    little only round man year came show every good me give our under name very through
    just form sentence great think say help low line differ turn cause much mean before
    move right boy old too same tell does set three want air well also play small end
    put home read hand port large spell add even land here must big high such follow
    act why ask men change went light kind off need house picture try us again animal
    point mother world near build self earth father model queue server token
"""
_ONSETS = "b c d f g h k l m n p r s t v w z ch sh th st tr pl gr br"
_VOWELS = "a e i o u ai ea ou ee oo"
