"""worker/jobs/media.py: every way an image can be refused names the image and the problem; good images decode
(data URLs, and http(s) URLs from a local server when enabled, within byte and time limits); a job's images
reach its model's processor in prompt order, on the executor the worker gives."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

from mlxq.api.schema import GenerateRequest, image_data_url
from mlxq.engine.core.request import ImageInputs
from mlxq.worker.config import WorkerConfig
from mlxq.worker.jobs import media
from mlxq.worker.jobs.media import ImageError, ImageLimits, decode_image
from tests.vlm_support import chat, png

pytestmark = pytest.mark.unit

LIMITS = ImageLimits(max_images=4, max_bytes=64 * 1024, max_pixels=100 * 100)
URLS = ImageLimits(max_images=4, max_bytes=64 * 1024, max_pixels=100 * 100, urls=True, fetch_timeout_s=1.0,
                   private_urls=True)  # the test's server is on loopback
IMG = image_data_url(png(10, 10, 3))


def encoded(fmt: str, size: tuple[int, int] = (20, 10), **save: object) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, format=fmt, **save)
    return buf.getvalue()


def test_data_urls_decode_to_upright_rgb() -> None:
    img = decode_image(image_data_url(png(30, 20, 0)), "image 1", LIMITS)
    assert img.mode == "RGB" and img.size == (30, 20)
    assert decode_image(image_data_url(encoded("JPEG"), "image/jpeg"), "image 2", LIMITS).size == (20, 10)
    gray = io.BytesIO()
    Image.new("L", (8, 8), 7).save(gray, format="PNG")
    assert decode_image(image_data_url(gray.getvalue()), "image 3", LIMITS).mode == "RGB"


@pytest.mark.parametrize(("url", "problem"), [
    ("data:text/plain;base64,aGVsbG8=", "not a base64 image data URL"),
    ("data:image/png,notbase64", "not a base64 image data URL"),
    ("data:image/png;base64", "not a base64 image data URL"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64,", "empty image data"),
    (image_data_url(b"\x00" * 900), "not an image (undecodable data)"),
    (image_data_url(encoded("TIFF"), "image/tiff"), "unsupported image format TIFF; accepted: PNG, JPEG"),
    (image_data_url(png(30, 20, 0)[:60]), "cannot decode it"),
    (image_data_url(encoded("PNG", (101, 100))), "101x100 pixels (10100); the limit is 10000 pixels"),
    (image_data_url(b"\x89PNG" + b"\x00" * (65 * 1024)), "66564 bytes; the limit is 65536 bytes"),
    ("file:///etc/passwd", "unsupported URL scheme 'file'"),
    ("ftp://example.com/a.png", "unsupported URL scheme 'ftp'"),
    ("https://example.com/a.png", "http(s) image URLs are not enabled on this worker (MLXQ_IMAGE_URLS)"),
])
def test_each_bad_image_is_refused_naming_it_and_the_problem(url: str, problem: str) -> None:
    with pytest.raises(ImageError) as err:
        decode_image(url, "image 2 (messages[0].content[3])", LIMITS)
    assert str(err.value).startswith("image 2 (messages[0].content[3]): ")
    assert problem in str(err.value)


class _Images(http.server.BaseHTTPRequestHandler):
    """/ok.png, /big (declared too large), /endless (undeclared, too large), /slow (drips), /404, /to-file."""

    def do_GET(self) -> None:
        body = png(30, 20, 1)
        if self.path == "/ok.png":
            self._send(200, body, len(body))
        elif self.path == "/big":
            self._send(200, b"x" * (70 * 1024), 70 * 1024)
        elif self.path == "/endless":
            self._send(200, b"x" * (70 * 1024), None)
        elif self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):  # each byte well inside the socket timeout; the whole fetch is not
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        elif self.path == "/to-file":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
        else:
            self._send(404, b"no", 2)

    def _send(self, code: int, body: bytes, length: int | None) -> None:
        self.send_response(code)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_http_urls_are_fetched_when_enabled(server: str) -> None:
    assert decode_image(f"{server}/ok.png", "image 1", URLS).size == (30, 20)
    with pytest.raises(ImageError, match="not enabled"):
        decode_image(f"{server}/ok.png", "image 1", LIMITS)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "169.254.169.254", "10.1.2.3"])
def test_urls_of_the_workers_own_network_are_refused_unless_allowed(server: str, host: str) -> None:
    # Refused before any connection is made (nothing is sent to those addresses); the loopback server itself
    # is fetched when allowed, and a redirect to it from a public URL would be refused the same way.
    port = server.rsplit(":", 1)[1]
    public_only = ImageLimits(urls=True, fetch_timeout_s=1.0)
    with pytest.raises(ImageError) as err:
        decode_image(f"http://{host}:{port}/ok.png", "image 1", public_only)
    assert str(err.value).startswith("image 1: fetching it failed: ") and "not a public address" in str(err.value)
    assert "MLXQ_IMAGE_URL_PRIVATE" in str(err.value)
    assert decode_image(f"{server}/ok.png", "image 1", URLS).size == (30, 20)


@pytest.mark.parametrize(("path", "problem"), [
    ("/big", "71680 bytes; the limit is 65536 bytes"),
    ("/endless", "more than 65536 bytes"),
    ("/slow", "fetching it took longer than 1 s"),
    ("/404", "fetching it failed: HTTP 404"),
    ("/to-file", "Redirection to url 'file:///etc/passwd' is not allowed"),
])
def test_http_fetches_stay_within_their_limits(server: str, path: str, problem: str) -> None:
    with pytest.raises(ImageError) as err:
        decode_image(f"{server}{path}", "image 1 (messages[0].content[0])", URLS)
    assert str(err.value).startswith("image 1 (messages[0].content[0]): ") and problem in str(err.value)


def test_a_data_url_at_the_byte_limit_is_read() -> None:
    body = png(50, 50, 3)
    limits = ImageLimits(max_bytes=len(body))
    assert decode_image("data:image/png;base64," + base64.b64encode(body).decode(), "image 1", limits).size == (50, 50)
    with pytest.raises(ImageError, match=f"{len(body)} bytes; the limit is {len(body) - 1} bytes"):
        decode_image(image_data_url(body), "image 1", ImageLimits(max_bytes=len(body) - 1))


class _Processor:
    """What ``media.prepare`` needs of a model's ``Vision``: it records where it ran and what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[int, int]], list[dict[str, Any]]]] = []

    def prepare(self, messages: list[dict[str, Any]], images: list[Any]) -> tuple[list[int], ImageInputs]:
        self.calls.append((threading.current_thread().name, [im.size for im in images], messages))
        return [1, 2, 3], ImageInputs({}, len(images))


async def test_a_jobs_images_reach_the_processor_in_order_on_the_executor_given(server: str) -> None:
    processor = _Processor()
    config = WorkerConfig(image_urls=True, image_fetch_timeout_s=1.0, max_image_pixels=100 * 100,
                          image_url_private=True)  # the test server is on loopback
    fetched_then_inline = chat("Compare", f"{server}/ok.png", image_data_url(png(40, 30, 2)), text_after=".")
    with ThreadPoolExecutor(1, thread_name_prefix="mlxq-images-test") as pool:
        model: Any = SimpleNamespace(vision=processor, context_length=None, config=config, images=pool)
        prompt = await media.prepare(GenerateRequest(model="m", messages=fetched_then_inline), model)
        with pytest.raises(ImageError) as err:  # a fetch that fails names its image, as a decode does
            await media.prepare(GenerateRequest(model="m", messages=chat("x", IMG, f"{server}/404")), model)
    assert prompt is not None and prompt.tokens == [1, 2, 3] and prompt.images is not None and prompt.images.count == 2
    [(thread, sizes, messages)] = processor.calls
    assert thread.startswith("mlxq-images-test") and sizes == [(30, 20), (40, 30)]
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                                     {"type": "image"}, {"type": "text", "text": "."}]}]
    assert str(err.value).startswith("image 2 (messages[0].content[2]): fetching it failed: HTTP 404")
