"""A tiny random-weight vision-language model (qwen2_vl) in the real mlx-vlm on-disk format.

The image counterpart of ``tinymodel.py``: ``mlx_vlm.load(path)`` loads it (model and processor) with no
network and no PyTorch, and it generates with images on CPU, single and batched. Files: ``config.json``,
``model.safetensors`` (a seeded random init of mlx-vlm's own qwen2_vl class, so the names already pass its
``sanitize``), a byte-level BPE tokenizer with Qwen's vision tokens, ``chat_template.jinja`` (an image part
renders as ``<|vision_start|><|image_pad|><|vision_end|>``) and ``preprocessor_config.json`` (8-pixel
patches merged 2x2, at most 4096 pixels: an image becomes at most 16 tokens).

Rebuilds are byte-identical; bump ``FORMAT_VERSION`` when anything that changes the files changes.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .tinymodel import _byte_alphabet, _cache_root, _publish, corpus

if TYPE_CHECKING:
    import mlx.nn as nn
    from transformers import PreTrainedTokenizerFast

__all__ = ["FORMAT_VERSION", "VISION_TOKENS", "VLMSpec", "build_vlm", "ensure_vlm", "vlm_dir"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, *VISION_TOKENS)

# Qwen2-VL's template without its default system prompt: content is a string or a list of parts.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_EMBED_STD = 1.0  # as tinymodel: larger than mlx's defaults, so greedy decoding of random weights stays varied
_MATRIX_GAIN = 3.0
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                   "chat_template.jinja", "preprocessor_config.json")


@dataclass(frozen=True, slots=True)
class VLMSpec:
    """Shape of the generated qwen2_vl model (text tower at the top level of config.json, as Qwen's)."""

    name: str = "tiny-vl"
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 384  # the BPE target size
    max_position_embeddings: int = 2048
    vision_depth: int = 2
    vision_embed_dim: int = 32
    vision_heads: int = 2
    patch_size: int = 8
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 256
    max_pixels: int = 4096
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


TINY_VLM = VLMSpec()
# The text tower of tinymodel's "small" (steps of tens of ms on a CPU, as real models take on a Mac): for the bench.
SMALL_VLM = VLMSpec(name="small-vl", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, intermediate_size=1536, vocab_size=1024, vision_depth=4,
                    vision_embed_dim=128, vision_heads=4)


def vlm_dir(root: Path | None = None, spec: VLMSpec = TINY_VLM) -> Path:
    """Where the model lives (or would live); does not create it."""
    return _cache_root(root) / f"{spec.name}-v{FORMAT_VERSION}"


def ensure_vlm(root: Path | None = None, spec: VLMSpec = TINY_VLM) -> Path:
    """The model's directory, built first if missing (concurrent builders: as ``tinymodel.ensure_model``)."""
    final = vlm_dir(root, spec)
    if all((final / name).is_file() for name in _REQUIRED_FILES):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        start = time.perf_counter()
        build_vlm(spec, tmp)
        logger.info("built %s in %.2fs", spec.name, time.perf_counter() - start)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_vlm(spec: VLMSpec, out: Path) -> None:
    """Write tokenizer, chat template, configs and random weights for ``spec`` into ``out``."""
    tokenizer = _build_tokenizer(spec)
    tokenizer.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    ids: dict[str, int] = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}  # type: ignore[misc]
    config = _config(spec, len(tokenizer), ids)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(spec), indent=2) + "\n")
    model = _init_model(config, spec.seed, special_ids=list(ids.values()))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))


def _build_tokenizer(spec: VLMSpec) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=_byte_alphabet(False), show_progress=False)
    tok.train_from_iterator(corpus(spec.seed), trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                      additional_special_tokens=[IM_START, *VISION_TOKENS])
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _config(spec: VLMSpec, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    half = spec.head_dim // 2  # mrope sections (temporal, height, width) cover half the head dim
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": section},
        "tie_word_embeddings": False,
        "eos_token_id": ids[IM_END],
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
        "torch_dtype": "float32",
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_embed_dim,
            "num_heads": spec.vision_heads,
            "mlp_ratio": 2,  # an int: transformers 5 validates config types strictly
            "patch_size": spec.patch_size,
            "spatial_patch_size": spec.patch_size,
            "spatial_merge_size": spec.merge_size,
            "temporal_patch_size": spec.temporal_patch_size,
            "in_channels": 3,
            "hidden_size": spec.hidden_size,
        },
        "mlxq": {"format_version": FORMAT_VERSION, "size": spec.name, "seed": spec.seed},
    }


def _preprocessor_config(spec: VLMSpec) -> dict[str, Any]:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "patch_size": spec.patch_size,
        "merge_size": spec.merge_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "min_pixels": spec.min_pixels,
        "max_pixels": spec.max_pixels,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }


def _init_model(config: dict[str, Any], seed: int, special_ids: list[int]) -> nn.Module:
    """mlx-vlm's own qwen2_vl class with seeded random weights (biases zero, norms one); the lm_head rows
    of special tokens are zeroed so greedy decoding never emits EOS or a vision token."""
    from mlx_vlm.models import qwen2_vl
    from mlx_vlm.utils import update_module_configs

    raw = json.loads(json.dumps(config))  # from_dict edits its argument
    cfg = update_module_configs(qwen2_vl.ModelConfig.from_dict(raw), qwen2_vl, raw, ["text", "vision"])
    model: nn.Module = qwen2_vl.Model(cfg)
    flat = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), len(flat))
    model.update(tree_unflatten([(name, _init_param(name, p, keys[i])) for i, (name, p) in enumerate(flat)]))
    lm = model.language_model  # type: ignore[attr-defined]
    head = lm.lm_head.weight
    head[mx.array(special_ids)] = 0.0
    lm.lm_head.weight = head
    mx.eval(model.parameters())
    return model


def _init_param(name: str, param: mx.array, key: mx.array) -> mx.array:
    if name.endswith("bias"):
        return mx.zeros(param.shape, dtype=mx.float32)
    if param.ndim == 1:  # norm weights
        return mx.ones(param.shape, dtype=mx.float32)
    if name.endswith("embed_tokens.weight"):
        return mx.random.normal(param.shape, scale=_EMBED_STD, key=key)
    fan_in = math.prod(param.shape[1:])
    bound = _MATRIX_GAIN / math.sqrt(fan_in)
    return mx.random.uniform(-bound, bound, param.shape, key=key)
