"""A job's images: read, checked against the worker's limits and prepared for its model, off the event loop.

Images are ``data:`` URLs or, where ``MLXQ_IMAGE_URLS`` enables them, http(s) URLs fetched with byte and time
limits from public addresses only (``MLXQ_IMAGE_URL_PRIVATE`` allows the rest). A size is read from the header
before any decode; only :data:`FORMATS` are parsed. Every refusal is an :class:`ImageError` naming the image
(1-based, with its place in the request); the job ends ``error(bad_request)``.

Fetching runs in asyncio's default thread pool. Decoding and the model's preprocessing run on the model's image
thread (``ModelView.images``), one per model: that work holds the GIL, so more threads would only slow each other
and the engine, and one thread hands a burst's images over in arrival order, for the engine to embed each meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import http.client
import io
import ipaddress
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image, ImageOps, UnidentifiedImageError

from mlxq.api.schema import GenerateRequest, ImagePart, TextPart
from mlxq.engine.core.request import ImageInputs

if TYPE_CHECKING:
    from ..config import WorkerConfig
    from .model import ModelView

__all__ = ["FORMATS", "ImageError", "ImageLimits", "ImagePrompt", "decode_image", "prepare"]

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # the parsers PIL may run on a job's bytes
_CHUNK = 64 * 1024


class ImageError(Exception):
    """A job's image the worker will not run, or a model that takes none: the message says which and why."""


@dataclass(frozen=True, slots=True)
class ImagePrompt:
    """A prompt with images, as the model's processor made it: its tokens (each image's placeholder tokens in
    place) and the images' inputs the engine embeds."""

    tokens: list[int]
    images: ImageInputs


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one job's images may be (from ``MLXQ_MAX_IMAGES``, ``MLXQ_MAX_IMAGE_BYTES``, ...)."""

    max_images: int = 4
    max_bytes: int = 4 << 20
    max_pixels: int = 4096 * 4096
    urls: bool = False
    fetch_timeout_s: float = 10.0
    private_urls: bool = False  # fetch from loopback, private and link-local addresses too

    @classmethod
    def of(cls, config: WorkerConfig) -> ImageLimits:
        return cls(config.max_images, config.max_image_bytes, config.max_image_pixels, config.image_urls,
                   config.image_fetch_timeout_s, config.image_url_private)


async def prepare(req: GenerateRequest, model: ModelView) -> ImagePrompt | None:
    """The prompt of a request with images (None: it has none): its images read and checked, then prepared by the
    model's processor on its image thread; its length checked as a text prompt's. Raises :class:`ImageError`."""
    n = len(req.image_parts)
    if not n:
        return None
    if model.vision is None:
        raise ImageError(f"the model {req.model!r} does not accept images (a text-only model): send the job "
                         f"without image parts, or to a vision-language model")
    config = model.config
    limits = ImageLimits.of(config)
    if n > limits.max_images:
        raise ImageError(f"the job has {n} images; the limit is {limits.max_images}")
    fetched = await asyncio.to_thread(_fetch_all, req, limits) if limits.urls and _has_urls(req) else {}
    loop = asyncio.get_running_loop()
    tokens, images = await loop.run_in_executor(model.images, _prepare, req, model, limits, fetched)
    ctx = model.context_length
    limit = min(config.max_prompt_tokens, ctx or config.max_prompt_tokens)
    if len(tokens) > limit:
        raise ImageError(f"the prompt has {len(tokens)} tokens with its images; the limit is {limit}")
    wanted = 1 if req.fit_max_tokens else req.max_tokens  # fitted to the context next (worker/jobs/prompt.py)
    if ctx is not None and len(tokens) + wanted > ctx:
        raise ImageError(f"prompt ({len(tokens)} tokens with its images) + max_tokens ({wanted}) exceeds "
                         f"the context ({ctx})")
    return ImagePrompt(tokens, images)


def _has_urls(req: GenerateRequest) -> bool:
    return any(_is_http(part.image_url.url) for _, part in _image_parts(req))


def _fetch_all(req: GenerateRequest, limits: ImageLimits) -> dict[int, bytes]:
    """The bytes of the request's http(s) images, by their 1-based place among its images."""
    return {i: _fetch(part.image_url.url, f"image {i} ({where})", limits)
            for i, (where, part) in enumerate(_image_parts(req), 1) if _is_http(part.image_url.url)}


def _prepare(req: GenerateRequest, model: ModelView, limits: ImageLimits, fetched: dict[int, bytes]
             ) -> tuple[list[int], ImageInputs]:
    assert model.vision is not None
    decoded = []
    for i, (where, part) in enumerate(_image_parts(req), 1):
        name = f"image {i} ({where})"
        data = fetched.get(i)
        decoded.append(decode_image(part.image_url.url, name, limits) if data is None
                       else _open(data, name, limits.max_pixels))
    try:
        return model.vision.prepare(_template_messages(req), decoded)
    except Exception as exc:  # the processor's own checks (an extreme aspect ratio, say): the job's images
        raise ImageError(f"the images could not be prepared for the model: {_clip(str(exc) or repr(exc))}") from None


def _image_parts(req: GenerateRequest) -> Iterator[tuple[str, ImagePart]]:
    for m, message in enumerate(req.messages or []):
        if not isinstance(message.content, str):
            for p, part in enumerate(message.content):
                if isinstance(part, ImagePart):
                    yield f"messages[{m}].content[{p}]", part


def _template_messages(req: GenerateRequest) -> list[dict[str, Any]]:
    """The messages as chat templates take them: an image part becomes ``{"type": "image"}`` (its URL, maybe
    megabytes, stays out of the template), text parts stay in place."""
    out: list[dict[str, Any]] = []
    for message in req.messages or []:
        content: Any = message.content
        if not isinstance(content, str):
            content = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                       for p in content]
        out.append({"role": message.role, "content": content})
    return out


# --- one image -------------------------------------------------------------------------------------------
def decode_image(url: str, name: str, limits: ImageLimits) -> Image.Image:
    """An image URL's picture, RGB and upright (EXIF), within ``limits``; ``name`` heads every error message."""
    if _is_http(url):
        data = _fetch(url, name, limits)
    elif url.startswith("data:"):
        data = _data_url_bytes(url, name, limits.max_bytes)
    else:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "(none)"
        raise ImageError(f"{name}: unsupported URL scheme {scheme!r}: send a data:image/...;base64 URL"
                         + (" or an http(s) URL" if limits.urls else ""))
    return _open(data, name, limits.max_pixels)


def _is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def _data_url_bytes(url: str, name: str, max_bytes: int) -> bytes:
    header, comma, payload = url[5:].partition(",")
    media_type, _, encoding = header.partition(";")
    if not comma or encoding.lower() != "base64" or not media_type.lower().startswith("image/"):
        raise ImageError(f"{name}: not a base64 image data URL (data:image/<type>;base64,<data>)")
    size = len(payload) * 3 // 4 - payload[-2:].count("=")
    if size > max_bytes:
        raise ImageError(f"{name}: {size} bytes; the limit is {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{name}: its data is not valid base64") from None


def _open(data: bytes, name: str, max_pixels: int) -> Image.Image:
    if not data:
        raise ImageError(f"{name}: empty image data")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError(f"{name}: {_unsupported(data)}; accepted: {', '.join(FORMATS)}") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{name}: cannot decode it: {_clip(str(exc))}") from None
    width, height = img.size
    if width < 1 or height < 1 or width * height > max_pixels:
        raise ImageError(f"{name}: {width}x{height} pixels ({width * height}); the limit is {max_pixels} pixels")
    try:
        img.load()
        return ImageOps.exif_transpose(img).convert("RGB")  # as mlx-vlm's own load_image
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{name}: cannot decode it ({img.format}): {_clip(str(exc))}") from None


def _unsupported(data: bytes) -> str:
    """What the bytes are, when no accepted format reads them: another format PIL knows, or no image."""
    try:
        fmt = Image.open(io.BytesIO(data)).format  # header only: nothing decoded
    except Exception:  # not an image, truncated, or one of PIL's parsers failing on junk
        return "not an image (undecodable data)"
    return f"unsupported image format {fmt}"


# --- http(s) ---------------------------------------------------------------------------------------------
class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects to http(s) only (urllib's default also follows ftp)."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        if not newurl.lower().startswith(("http://", "https://")):
            raise urllib.error.URLError(f"redirect to a non-http(s) URL: {newurl[:100]}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class NotPublic(OSError):
    """An image URL's host is not a public address (a job must not reach the worker's own network)."""


def _connect_public(address: tuple[str, int], timeout: Any = socket._GLOBAL_DEFAULT_TIMEOUT,  # type: ignore[attr-defined]
                    source_address: Any = None) -> socket.socket:
    """Connect only if every address the host resolves to is public, and to the address checked: a redirect,
    or a DNS answer that changes between two lookups, cannot lead to the worker's own network."""
    host, port = address
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    for info in infos:
        ip = str(info[4][0])
        if not ipaddress.ip_address(ip.split("%")[0]).is_global:
            what = ip if ip == host else f"{host} ({ip})"
            raise NotPublic(f"{what} is not a public address (MLXQ_IMAGE_URL_PRIVATE=1 allows it)")
    return socket.create_connection((str(infos[0][4][0]), port), timeout, source_address)


class _PublicHTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = _connect_public


class _PublicHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = _connect_public  # TCP only: TLS is set up on the checked connection


class _PublicHTTP(urllib.request.HTTPHandler):
    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_PublicHTTPConnection, req, **kwargs)


class _PublicHTTPS(urllib.request.HTTPSHandler):
    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_PublicHTTPSConnection, req, **kwargs)


_OPENER = urllib.request.build_opener(_HttpOnlyRedirects)  # with MLXQ_IMAGE_URL_PRIVATE
_PUBLIC_OPENER = urllib.request.build_opener(_HttpOnlyRedirects, _PublicHTTP, _PublicHTTPS)


def _fetch(url: str, name: str, limits: ImageLimits) -> bytes:
    """GET an image: at most ``max_bytes``, all of it within ``fetch_timeout_s``."""
    if not limits.urls:
        raise ImageError(f"{name}: http(s) image URLs are not enabled on this worker (MLXQ_IMAGE_URLS): "
                         f"send the image as a data:image/...;base64 URL")
    deadline = time.monotonic() + limits.fetch_timeout_s
    request = urllib.request.Request(url, headers={"Accept": "image/*", "User-Agent": "mlxq"})
    try:
        opener = _OPENER if limits.private_urls else _PUBLIC_OPENER
        with opener.open(request, timeout=limits.fetch_timeout_s) as resp:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                raise ImageError(f"{name}: {declared} bytes; the limit is {limits.max_bytes} bytes")
            return _read_within(resp, name, limits, deadline)
    except urllib.error.HTTPError as exc:  # also a redirect urllib refuses (to file:, say)
        raise ImageError(f"{name}: fetching it failed: HTTP {exc.code}: {_clip(str(exc.reason))}") from None
    except TimeoutError:
        raise ImageError(f"{name}: fetching it took longer than {limits.fetch_timeout_s:g} s") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ImageError(f"{name}: fetching it failed: {_clip(str(reason))}") from None


def _read_within(resp: Any, name: str, limits: ImageLimits, deadline: float) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        if time.monotonic() > deadline:  # a server dripping bytes never trips the socket's own timeout
            raise ImageError(f"{name}: fetching it took longer than {limits.fetch_timeout_s:g} s")
        chunk = resp.read1(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > limits.max_bytes:
            raise ImageError(f"{name}: more than {limits.max_bytes} bytes; the limit is {limits.max_bytes} bytes")
        chunks.append(chunk)


def _clip(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + "..."
