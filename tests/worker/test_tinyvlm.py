"""mlxq.worker.tools.tinyvlm: the generated qwen2_vl loads with the real ``mlx_vlm.load`` and generates with images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlx.utils import tree_flatten

from mlxq.worker.tools import tinyvlm
from mlxq.worker.tools.tinyvlm import IMAGE_PAD, VISION_END, VISION_START, ensure_vlm, vlm_dir
from tests.vlm_support import data_url

# Tiers: unit, but for the bench's small model (slow); tests/conftest.py marks each.
mlx_vlm = pytest.importorskip("mlx_vlm", reason="needs the vision extra (mlx-vlm)")

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
         "preprocessor_config.json")


@pytest.fixture(scope="module")
def loaded(tiny_vlm: Path) -> tuple[Any, Any]:
    return mlx_vlm.load(str(tiny_vlm))  # type: ignore[no-any-return]


def test_files_are_deterministic_and_not_rebuilt(tiny_vlm: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert tiny_vlm == vlm_dir(tiny_vlm.parent)
    other = ensure_vlm(tmp_path)
    for name in FILES:
        assert (other / name).read_bytes() == (tiny_vlm / name).read_bytes(), name

    def boom(*_: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tinyvlm, "build_vlm", boom)
    assert ensure_vlm(tmp_path) == other


def test_mlx_vlm_loads_model_and_processor_with_matching_ids(loaded: tuple[Any, Any], tiny_vlm: Path) -> None:
    model, processor = loaded
    config = json.loads((tiny_vlm / "config.json").read_text())
    tok = processor.tokenizer
    assert type(processor).__name__ == "Qwen2VLProcessor"
    assert config["model_type"] == "qwen2_vl" and "vision_config" in config
    assert config["image_token_id"] == tok.convert_tokens_to_ids(IMAGE_PAD) == model.config.image_token_id
    assert config["vision_start_token_id"] == tok.convert_tokens_to_ids(VISION_START)
    assert config["eos_token_id"] == tok.eos_token_id
    assert sum(v.size for _, v in tree_flatten(model.parameters())) < 1_000_000
    part = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]}]
    text = tok.apply_chat_template(part, tokenize=False, add_generation_prompt=True)
    assert text == f"<|im_start|>user\nhi{VISION_START}{IMAGE_PAD}{VISION_END}<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_generation_with_images_is_varied_and_runs_to_max_tokens(loaded: tuple[Any, Any]) -> None:
    model, processor = loaded
    prompt = "<|im_start|>user\nDescribe<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    runs = []
    for url in (data_url(64, 40, 1), data_url(32, 96, 2)):
        last = None
        for last in mlx_vlm.stream_generate(model, processor, prompt, image=[url], max_tokens=16,  # noqa: B007
                                            temperature=0.0):
            pass  # the last result carries every token
        assert last is not None
        assert len(last.token_ids) == 16 and len(set(last.token_ids)) >= 4  # never EOS, not one repeated token
        assert last.prompt_tokens <= 30 + 16  # at most 16 tokens per image (4096 pixels, 8-pixel patches, 2x2)
        runs.append(last.token_ids)
    assert runs[0] != runs[1]  # the image matters


@pytest.mark.slow
def test_the_bench_s_small_qwen2_vl_loads_and_generates_with_an_image(tmp_path: Path) -> None:
    from mlxq.engine.mlx.loader import load_model
    from mlxq.worker.tools.tinyvlm import SMALL_VLM

    path = ensure_vlm(tmp_path, SMALL_VLM)
    loaded = load_model(str(path))
    assert loaded.accepts_images and loaded.context_length == SMALL_VLM.max_position_embeddings
    assert 10_000_000 < sum(v.size for _, v in tree_flatten(loaded.model.parameters())) < 60_000_000
    model, processor = mlx_vlm.load(str(path))
    prompt = "<|im_start|>user\nDescribe<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    out = mlx_vlm.generate(model, processor, prompt, image=[data_url(64, 48, 3)], max_tokens=8, temperature=0.0)
    assert out.generation_tokens == 8
