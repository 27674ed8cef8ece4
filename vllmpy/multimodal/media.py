"""Images from what clients send: PIL images, data: URLs, file:// under --allowed-local-media-path,
http(s):// with a timeout, a size cap and a content-type check. Every refusal is a MediaError naming the
request field it came from."""
from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from PIL import Image

DEFAULT_FETCH_TIMEOUT = 5.0  # seconds, vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_BYTES = 20 * 1024 * 1024  # one encoded image; a larger download is cut off and refused


class MediaError(ValueError):
    """An image that cannot be used; `field` is the request field that sent it (a 400 names it)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class MediaConfig:
    """Where images may come from: local files only under `allowed_local_media_path` (None: no file://)."""

    allowed_local_media_path: str | None = None
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    max_bytes: int = DEFAULT_MAX_BYTES

    @classmethod
    def of(cls, model_config) -> MediaConfig:
        """From the engine's ModelConfig (--allowed-local-media-path, --media-fetch-timeout, --max-media-bytes)."""
        return cls(model_config.allowed_local_media_path, model_config.media_fetch_timeout,
                   model_config.max_media_bytes)


def load_image(source: object, config: MediaConfig, field: str) -> Image.Image:
    """A decoded image from a PIL image, raw bytes, or a data: / file:// / http(s):// URL."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), field)
    if not isinstance(source, str):
        raise MediaError(f"an image must be a URL string or a PIL image, got {type(source).__name__}", field)
    scheme = source.split(":", 1)[0].lower() if ":" in source else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(source, field), field)
    if scheme == "file":
        return decode_image(_local_file_bytes(source, config, field), field)
    if scheme in ("http", "https"):
        return decode_image(_fetch(source, config, field), field)
    raise MediaError(f"image URL scheme {scheme or '(none)'!r} is not supported; send a data: URL (base64), an "
                     f"http(s):// URL, or file:// under --allowed-local-media-path", field)


def decode_image(data: bytes, field: str) -> Image.Image:
    """Decode fully now (a truncated file fails here, not in the engine); decompression bombs are refused."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise MediaError(f"image is too large to decode: {exc}", field) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"image could not be decoded ({len(data)} bytes): {exc}", field) from None
    return image


def _data_url_bytes(url: str, field: str) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise MediaError("data: URL has no ',' before its payload; send data:image/png;base64,<data>", field)
    media_type, *params = header.split(";")
    if media_type and not media_type.lower().startswith("image/"):
        raise MediaError(f"data: URL media type {media_type!r} is not an image type (image/*)", field)
    if "base64" not in params:
        raise MediaError("data: URL must be base64-encoded (data:image/png;base64,<data>)", field)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"data: URL payload is not valid base64: {exc}", field) from None


def _local_file_bytes(url: str, config: MediaConfig, field: str) -> bytes:
    root = config.allowed_local_media_path
    if root is None:
        raise MediaError("file:// URLs are refused: the server was not started with --allowed-local-media-path",
                         field)
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL names host {parsed.netloc!r}; only local files are read", field)
    path = os.path.realpath(unquote(parsed.path))  # resolves '..' and symlinks before the check
    root = os.path.realpath(root)
    if os.path.commonpath([path, root]) != root:
        raise MediaError(f"file:// path is outside --allowed-local-media-path {root}", field)
    if not os.path.isfile(path):
        raise MediaError("file:// path is not a file under --allowed-local-media-path", field)
    size = os.path.getsize(path)
    if size > config.max_bytes:
        raise MediaError(f"image file is {size} bytes, over the limit of {config.max_bytes}", field)
    with open(path, "rb") as f:
        return f.read()


def _fetch(url: str, config: MediaConfig, field: str) -> bytes:
    """GET with a timeout; refuses a non-200, a non-image content type, and a body over max_bytes."""
    import httpx

    try:
        with httpx.stream("GET", url, timeout=config.fetch_timeout, follow_redirects=True) as response:
            if response.status_code != 200:
                raise MediaError(f"fetching the image returned HTTP {response.status_code}", field)
            kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if not kind.startswith("image/"):
                raise MediaError(f"fetched content type {kind or '(none)'!r} is not an image type (image/*)", field)
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > config.max_bytes:
                    raise MediaError(f"image download is over the limit of {config.max_bytes} bytes", field)
            return bytes(body)
    except httpx.TimeoutException:
        raise MediaError(f"fetching the image timed out after {config.fetch_timeout} s", field) from None
    except httpx.HTTPError as exc:
        raise MediaError(f"fetching the image failed: {type(exc).__name__}: {exc}", field) from None
