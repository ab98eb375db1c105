"""Image jobs end to end: a real Redis, a real arq worker serving the tiny qwen2_vl, the real client.

Greedy output through the queue equals mlx-vlm's single-request output for image and text jobs in one batch,
including jobs joining while others decode; bad images end their job with ``error(bad_request)`` naming the
image and the problem, and the worker serves on; a text-only model's worker refuses image jobs clearly; the
payload limit makes room for images, and only for them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.api.errors import BadRequest, JobFailed
from mlxq.api.schema import DoneEvent, ErrorCode, ErrorEvent, Event, image_data_url
from mlxq.worker.config import WorkerConfig
from tests.support import RunningWorker, enqueue_raw, start_worker
from tests.vlm_support import Oracle, chat, data_url, png

pytestmark = pytest.mark.e2e

VL = "tiny-vl"
N = 16
IMG_A, IMG_B, IMG_C = data_url(64, 40, 1), data_url(48, 64, 2), data_url(100, 80, 3)
LOOK = chat("What is in this picture?", IMG_A)


@pytest.fixture(scope="module")
def oracle(tiny_vlm: Path) -> Oracle:
    return Oracle(tiny_vlm)


@pytest.fixture
def vlm_config(redis_url: str, tiny_vlm: Path) -> WorkerConfig:
    return WorkerConfig(model=str(tiny_vlm), model_name=VL, redis_url=redis_url, capacity=8, poll_delay_s=0.25,
                        cancel_poll_s=0.1, drain_timeout_s=5.0, max_images=3, max_image_pixels=100 * 100,
                        max_image_bytes=64 * 1024, max_payload_bytes=8192)


@pytest.fixture
async def vlm_worker(vlm_config: WorkerConfig) -> AsyncIterator[RunningWorker]:
    running = await start_worker(vlm_config)
    try:
        yield running
    finally:
        await running.close()


async def events_of(client: Client, rid: str) -> list[Event]:
    return [ev async for ev in client.events(rid, timeout=60)]


def tokens_of(events: list[Event]) -> list[int]:
    return [t for e in events if e.type == "token" for t in e.token_ids]


async def test_image_and_text_jobs_through_the_queue_equal_single_runs(
    vlm_worker: RunningWorker, client: Client, oracle: Oracle
) -> None:
    assert vlm_worker.service.model.accepts_images
    first = chat("What is in this picture?", IMG_A)
    long_rid = await client.submit(model=VL, messages=first, max_tokens=3 * N)
    async for ev in client.events(long_rid, timeout=60):  # it decodes when the others join
        if ev.type == "token":
            break
    jobs: dict[str, dict[str, Any]] = {
        "two-images": {"messages": chat("Compare", IMG_B, IMG_C, text_after=" please.")},
        "one-image": {"messages": chat("And this one?", IMG_C)},
        "chat": {"messages": [{"role": "user", "content": "Tell me about the water and the queue server."}]},
        "parts": {"messages": chat("Tell me about the ", text_after="water and the queue server.")},
        "raw": {"prompt": "Once upon a time the queue"},
    }
    rids = {name: await client.submit(model=VL, max_tokens=N, **fields) for name, fields in jobs.items()}
    results = {name: await client.result(rid, timeout=60) for name, rid in rids.items()}
    long_result = await client.result(long_rid, timeout=60)
    assert long_result.token_ids == oracle.tokens(first, 3 * N)
    assert long_result.text == oracle.text(first, 3 * N)  # mlx-vlm's text for those tokens, not only the ids
    for name in ("two-images", "one-image", "chat", "parts"):
        assert results[name].token_ids == oracle.tokens(jobs[name]["messages"], N), name
        assert results[name].text == oracle.text(jobs[name]["messages"], N), name
    assert results["parts"].text == results["chat"].text  # text parts are the text they join into
    assert results["raw"].token_ids == oracle.tokens_of("Once upon a time the queue", [], N)
    assert results["raw"].text == oracle.text_of("Once upon a time the queue", [], N)
    assert results["one-image"].usage.prompt_tokens > results["raw"].usage.prompt_tokens


async def test_an_image_job_cancelled_right_after_its_submit_ends_cancelled_and_others_run_on(
    vlm_worker: RunningWorker, client: Client, oracle: Oracle
) -> None:
    doomed = await client.submit(model=VL, messages=chat("Long", IMG_B, IMG_C), max_tokens=400)
    other = await client.submit(model=VL, messages=LOOK, max_tokens=N)
    await client.cancel(doomed)
    end = (await events_of(client, doomed))[-1]
    assert isinstance(end, DoneEvent) and end.finish_reason.value == "cancelled"
    assert (await client.result(other, timeout=60)).token_ids == oracle.tokens(LOOK, N)


def _tiff() -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="TIFF")
    return image_data_url(buf.getvalue(), "image/tiff")


BAD = {
    "undecodable": (chat("x", image_data_url(b"\x00" * 64)),
                    "image 1 (messages[0].content[1]): not an image (undecodable data)"),
    "unsupported": (chat("x", IMG_A, _tiff()),
                    "image 2 (messages[0].content[2]): unsupported image format TIFF; accepted: PNG, JPEG"),
    "too many pixels": (chat("x", data_url(101, 100, 4)),
                        "image 1 (messages[0].content[1]): 101x100 pixels (10100); the limit is 10000 pixels"),
    "too many images": (chat("x", IMG_A, IMG_A, IMG_A, IMG_A), "the job has 4 images; the limit is 3"),
    "not base64": (chat("x", "data:image/png;base64,%%%"), "image 1 (messages[0].content[1]): its data is not "
                                                          "valid base64"),
    "urls disabled": (chat("x", "http://127.0.0.1:9/a.png"), "image 1 (messages[0].content[1]): http(s) image URLs "
                                                            "are not enabled on this worker (MLXQ_IMAGE_URLS)"),
}


async def test_bad_images_end_the_job_with_bad_request_naming_the_image(
    vlm_worker: RunningWorker, client: Client, oracle: Oracle
) -> None:
    rids = {name: await client.submit(model=VL, messages=msgs, max_tokens=N) for name, (msgs, _) in BAD.items()}
    good = await client.submit(model=VL, messages=LOOK, max_tokens=N)
    for name, rid in rids.items():
        events = await events_of(client, rid)
        assert [e.type for e in events] == ["error"], name  # refused before it started
        end = events[0]
        assert isinstance(end, ErrorEvent) and end.code is ErrorCode.BAD_REQUEST and not end.retryable
        assert BAD[name][1] in end.message, (name, end.message)
    assert (await client.result(good, timeout=60)).token_ids == oracle.tokens(LOOK, N)


async def test_what_mlx_vlms_batch_cannot_do_is_refused_for_image_and_text_jobs_alike(
    vlm_worker: RunningWorker, client: Client
) -> None:
    asks = {"response_format is": {"response_format": {"type": "json_object"}}, "logprobs are": {"logprobs": 2},
            "tools are": {"tools": [{"type": "function", "function": {"name": "f"}}]}}
    for what, fields in asks.items():
        for messages in (LOOK, [{"role": "user", "content": "no image"}]):
            rid = await client.submit(model=VL, messages=messages, max_tokens=N, **fields)
            (end,) = await events_of(client, rid)
            assert isinstance(end, ErrorEvent) and end.code is ErrorCode.BAD_REQUEST, (what, end)
            assert end.message == f"{what} not supported by the vision-language model {VL!r}"


async def test_the_payload_limit_makes_room_for_images_only(
    vlm_worker: RunningWorker, vlm_config: WorkerConfig, redis_url: str, oracle: Oracle
) -> None:
    big = data_url(90, 90, 5)  # ~32 KB of base64: four times the text payload limit
    msgs = chat("What is in this picture?", big)
    async with Client(redis_url, max_payload_bytes=vlm_config.max_payload_bytes, max_images=vlm_config.max_images,
                      max_image_bytes=vlm_config.max_image_bytes) as client:
        assert len(json.dumps(msgs)) > 3 * vlm_config.max_payload_bytes
        assert (await client.generate(model=VL, messages=msgs, max_tokens=N, timeout=60)).token_ids == \
            oracle.tokens(msgs, N)
        with pytest.raises(BadRequest, match="bytes of JSON; the limit is 8192"):  # no allowance without images
            await client.submit(model=VL, prompt="x" * 9000, max_tokens=N)
        largest = png(8, 8, 0).ljust(vlm_config.max_image_bytes, b"\x00")  # each image within its limit...
        too_big = chat("y" * vlm_config.max_payload_bytes, *[image_data_url(largest)] * 3)  # ...not all with the text
        with pytest.raises(BadRequest, match=f"the limit is {vlm_config.max_job_bytes}"):
            await client.submit(model=VL, messages=too_big, max_tokens=N)
        # A producer without the client's check: the worker reads no more than its own limit.
        payload = {"id": "over-limit-job", "model": VL, "max_tokens": N,
                   "messages": chat("x" * (vlm_config.max_job_bytes + 10))}
        await enqueue_raw(redis_url, payload, "over-limit-job", model=VL)
        (end,) = await events_of(client, "over-limit-job")
        assert isinstance(end, ErrorEvent) and end.code is ErrorCode.BAD_REQUEST
        assert f"; the limit is {vlm_config.max_job_bytes}" in end.message


async def test_a_text_only_worker_refuses_image_jobs_clearly(worker: RunningWorker, client: Client) -> None:
    assert not worker.service.model.accepts_images
    with pytest.raises(JobFailed) as err:
        await client.generate(model="tiny", messages=chat("What is this?", IMG_A), max_tokens=4, timeout=60)
    assert err.value.code is ErrorCode.BAD_REQUEST
    assert "the model 'tiny' does not accept images (a text-only model)" in err.value.event.message
    # Text parts alone are text: the same output as the string they join into.
    parts = await client.generate(model="tiny", messages=chat("Hello ", text_after="there"), max_tokens=8, timeout=60)
    plain = await client.generate(model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8,
                                  timeout=60)
    assert parts.token_ids == plain.token_ids and len(parts.token_ids) == 8



async def test_the_gateways_chat_endpoints_take_the_same_image_parts(vlm_worker: RunningWorker, client: Client,
                                                                     redis_url: str) -> None:
    import anthropic
    import openai

    from mlxq.api.config import ClientConfig
    from mlxq.api.gateway import GatewayConfig, create_app
    from tests.api.gateway_support import ServedGateway

    served = ServedGateway(create_app(GatewayConfig(client=ClientConfig(redis_url=redis_url)))).start()
    try:
        via_client = await client.generate(model=VL, messages=LOOK, max_tokens=N, timeout=60)
        oa = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused")
        chat_reply = await oa.chat.completions.create(model=VL, messages=LOOK, max_tokens=N,  # type: ignore[arg-type]
                                                      temperature=0)
        assert chat_reply.choices[0].message.content == via_client.text
        media, data = IMG_A.removeprefix("data:").split(";base64,")
        an = anthropic.AsyncAnthropic(base_url=served.url, api_key="unused")
        message = await an.messages.create(model=VL, max_tokens=N, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}},
        ]}])  # type: ignore[list-item, misc]
        assert message.content[0].text == via_client.text  # type: ignore[union-attr]
        listed = {m.id: m for m in (await oa.models.list()).data}
        assert listed[VL].model_extra["accepts_images"] is True  # type: ignore[index]
    finally:
        served.stop()
