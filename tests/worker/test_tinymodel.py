"""Tests for worker.tools.tinymodel: generated models load in the real mlx_lm and behave."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import mlx_lm
import pytest
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from mlxq.worker.tools import tinymodel
from mlxq.worker.tools.tinymodel import EOS_TOKEN, SIZES, ensure_model, model_dir

# Tiers: unit, but for the bench's small model and the three processes building one model at once (slow);
# tests/conftest.py marks each.

# (the bench's pair: built by the bench; the embedding model: its own test below)
SIZE_NAMES = sorted(s for s in SIZES if not s.startswith("small-") and not SIZES[s].embedding)
PROMPTS = ["Hello there", "The water is cold.", "Write a poem about the sea", "1 2 3 4"]
Loaded = tuple[Any, Any, dict[str, Any]]  # (model, TokenizerWrapper, config)
ARTIFACTS = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tmp_path_factory.mktemp("cache-a"), tmp_path_factory.mktemp("cache-b")


@pytest.fixture(scope="module", params=[pytest.param(s, marks=pytest.mark.slow) if s == "small" else s
                                        for s in SIZE_NAMES])
def size(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def built(size: str, roots: tuple[Path, Path]) -> Path:
    start = time.perf_counter()
    path = ensure_model(size, roots[0])
    print(f"\n[tinymodel] built {size!r} in {time.perf_counter() - start:.2f}s at {path}")
    return path


@pytest.fixture(scope="module")
def loaded(built: Path) -> Loaded:
    return cast(Loaded, mlx_lm.load(str(built), return_config=True))


def test_model_dir_naming_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert model_dir("tiny", tmp_path) == tmp_path / f"tiny-v{tinymodel.FORMAT_VERSION}"
    assert not model_dir("small", tmp_path).exists()  # model_dir never creates
    monkeypatch.setenv("MLXQ_MODEL_CACHE", str(tmp_path / "env"))
    assert model_dir("small").parent == tmp_path / "env"
    monkeypatch.delenv("MLXQ_MODEL_CACHE")
    assert model_dir().parent == Path("~/.cache/mlxq/models").expanduser()
    with pytest.raises(ValueError, match="unknown model size"):
        model_dir("huge", tmp_path)


def test_ensure_model_writes_artifacts(built: Path, size: str) -> None:
    assert built == model_dir(size, built.parent)
    assert built.stat().st_mode & 0o777 == 0o755  # not mkdtemp's owner-only mode
    for name in ARTIFACTS:
        assert (built / name).is_file(), name
    assert not [p for p in built.parent.iterdir() if p.name.endswith(".tmp")]


def test_load_config_and_eos_agree(loaded: Loaded, size: str) -> None:
    model, tokenizer, config = loaded
    spec = SIZES[size]
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert config["model_type"] == spec.model_type
    assert config["eos_token_id"] == eos_id == tokenizer.eos_token_id
    assert tokenizer.eos_token_ids == {eos_id}
    assert tokenizer.bos_token_id is None
    assert config["vocab_size"] == len(tokenizer) == spec.vocab_size + 2 * (spec.thinking + spec.tools)  # markers
    flat = cast("list[tuple[str, Any]]", tree_flatten(model.parameters()))
    (embed,) = [w for name, w in flat if name.endswith(("embed_tokens.weight", "embeddings.weight"))]  # nemotron_h's
    assert embed.shape == (len(tokenizer), spec.hidden_size)


def test_loaded_tokenizer_matches_tokenizer_json(loaded: Loaded, built: Path) -> None:
    _, tokenizer, _ = loaded
    raw = Tokenizer.from_file(str(built / "tokenizer.json"))
    text = "Hello world, the queue server said 42 times!"
    assert tokenizer.encode(text) == raw.encode(text).ids  # no BOS/EOS added
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_byte_alphabet(loaded: Loaded, size: str) -> None:
    _, tokenizer, _ = loaded
    text = "naïve café 日本"
    roundtrip = tokenizer.decode(tokenizer.encode(text))
    if SIZES[size].ascii_only:
        assert roundtrip.isascii()  # non-ASCII bytes have no token: dropped
    else:
        assert roundtrip == text


def test_chat_template_renders(loaded: Loaded, size: str) -> None:
    _, tokenizer, _ = loaded
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    opened = "<think>\n" if SIZES[size].thinking else ""  # a thinking template opens the think block
    assert text == f"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n{opened}"
    if SIZES[size].thinking:
        assert tokenizer.has_thinking and (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")
        off = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                            enable_thinking=False)
        assert off.endswith("assistant\n<think>\n\n</think>\n\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.convert_tokens_to_ids(EOS_TOKEN) in ids


def test_second_call_does_not_rebuild(built: Path, size: str, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {name: (built / name).stat().st_mtime_ns for name in ARTIFACTS}

    def boom(*_: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tinymodel, "build_model", boom)
    assert ensure_model(size, built.parent) == built
    assert {name: (built / name).stat().st_mtime_ns for name in ARTIFACTS} == before


def test_deterministic_across_roots(built: Path, size: str, roots: tuple[Path, Path]) -> None:
    other = ensure_model(size, roots[1])
    assert other != built
    for name in ARTIFACTS:
        assert (other / name).read_bytes() == (built / name).read_bytes(), name


def test_greedy_generation_is_not_degenerate(loaded: Loaded) -> None:
    model, tokenizer, _ = loaded
    outputs = []
    for prompt in PROMPTS:
        start = time.perf_counter()
        tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=16)]
        elapsed = time.perf_counter() - start
        assert len(tokens) == 16  # EOS is never the greedy choice
        assert len(set(tokens)) >= 4, tokens
        outputs.append(tuple(tokens))
    assert len(set(outputs)) == len(PROMPTS)
    text = mlx_lm.generate(model, tokenizer, PROMPTS[0], max_tokens=16)
    assert isinstance(text, str) and text
    print(f"\n[tinymodel] last 16-token generation took {elapsed * 1000:.0f}ms")


def test_param_counts(loaded: Loaded, size: str) -> None:
    model, _, _ = loaded
    flat = cast("list[tuple[str, Any]]", tree_flatten(model.parameters()))
    n_params = sum(v.size for _, v in flat)
    print(f"\n[tinymodel] {size!r}: {n_params:,} parameters")
    if size == "small":
        assert 20_000_000 <= n_params <= 30_000_000
    else:
        assert n_params < 1_000_000


def test_a_grown_target_starts_with_its_drafts_weights_and_adds_small_layers(tmp_path: Path) -> None:
    target, draft = (mx_load(ensure_model(n, root=tmp_path)) for n in ("tiny-target", "tiny-draft"))
    assert set(draft) < set(target)
    for name, value in draft.items():
        assert (target[name] == value).all().item(), name  # the embeddings, head, norm and first layer
    added = [n for n in target if n not in draft and n.endswith("o_proj.weight")]
    assert added and all(float(abs(target[n]).max()) <= 0.15 * 3.0 / 8 + 1e-6 for n in added)  # growth x bound


def mx_load(path: Path) -> dict[str, Any]:
    import mlx.core as mx

    return dict(mx.load(str(path / "model.safetensors")))


def test_lost_race_uses_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = model_dir("tiny", tmp_path)
    real_build = tinymodel.build_model

    def build_then_get_beaten(spec: tinymodel.ModelSpec, out: Path) -> None:
        real_build(spec, out)
        shutil.copytree(out, final)  # a competing process publishes first
        (final / "winner").touch()

    monkeypatch.setattr(tinymodel, "build_model", build_then_get_beaten)
    assert ensure_model("tiny", tmp_path) == final
    assert (final / "winner").exists()
    assert [p.name for p in tmp_path.iterdir()] == [final.name]  # temp dir discarded


def test_lost_race_with_incomplete_target_raises(tmp_path: Path) -> None:
    final = model_dir("tiny", tmp_path)
    final.mkdir()
    (final / "junk").touch()  # non-empty but incomplete: rename fails, no winner
    with pytest.raises(OSError):
        ensure_model("tiny", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


@pytest.mark.slow  # three processes each importing MLX and building a model
def test_concurrent_processes(tmp_path: Path) -> None:
    code = "import sys; from mlxq.worker.tools.tinymodel import ensure_model; print(ensure_model('tiny', sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(Path(tinymodel.__file__).parents[2])}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, env=env)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].decode().strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert set(outs) == {str(model_dir("tiny", tmp_path))}
    assert [p.name for p in tmp_path.iterdir()] == [model_dir("tiny", tmp_path).name]
    config = json.loads((model_dir("tiny", tmp_path) / "config.json").read_text())
    assert config["model_type"] == "qwen3"


def test_prompt_encoder_calls_rust_directly_and_matches_transformers(tiny_model: Path) -> None:
    from mlxq.engine.core.prompt import PromptEncoder, encode_prompt
    from mlxq.engine.mlx.loader import load_model

    tokenizer = load_model(str(tiny_model)).tokenizer
    encoder = PromptEncoder(tokenizer)
    assert encoder.direct is not None  # a fast tokenizer: the direct call is taken
    for prompt in ["Once upon a time", " spaced  out ", "émoji 🙂 and 漢字", "x" * 1000, "<|endoftext|>hi"]:
        assert encoder.encode(prompt, None) == encode_prompt(tokenizer, prompt, None)
    messages = [{"role": "user", "content": "hi"}]
    assert encoder.encode(None, messages) == encode_prompt(tokenizer, None, messages)


def test_prompt_encoder_falls_back_when_the_rust_call_would_differ(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import models

    from mlxq.engine.core import prompt
    from mlxq.engine.mlx.loader import load_model

    tokenizer = load_model(str(tiny_model)).tokenizer
    rust = tokenizer._tokenizer._tokenizer
    rust.enable_truncation(max_length=4)  # transformers undoes this for each call; the direct call would not
    try:
        assert prompt.PromptEncoder(tokenizer).direct is None
    finally:
        rust.no_truncation()
    other = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))  # encodes every text differently
    monkeypatch.setattr(prompt, "_rust_tokenizer", lambda tok: other)
    encoder = prompt.PromptEncoder(tokenizer)
    assert encoder.direct is None  # the probes caught it
    assert encoder.encode("abc", None) == prompt.encode_prompt(tokenizer, "abc", None)


def test_the_embedding_model_has_last_token_pooling_files_and_a_tokenizer_that_appends_endoftext(
        roots: tuple[Path, Path]) -> None:
    built, other = ensure_model("tiny-embed", roots[0]), ensure_model("tiny-embed", roots[1])
    files = [*ARTIFACTS, "modules.json", "1_Pooling/config.json"]
    for name in files:  # generated deterministically, as the others
        assert (other / name).read_bytes() == (built / name).read_bytes(), name
    modules = json.loads((built / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    pooling = json.loads((built / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_lasttoken"] and not pooling["pooling_mode_mean_tokens"]
    assert pooling["word_embedding_dimension"] == json.loads((built / "config.json").read_text())["hidden_size"]
    _, tokenizer = mlx_lm.load(str(built))[:2]
    text = "Hello world, the queue server said 42 times!"
    ids = tokenizer.encode(text)
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|endoftext|>") and ids == Tokenizer.from_file(
        str(built / "tokenizer.json")).encode(text).ids
    assert tokenizer.decode(ids[:-1]) == text
