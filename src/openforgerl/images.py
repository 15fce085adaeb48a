"""Images as the gateway carries them: decoded bytes, content-addressed, checked once on arrival.

An `Image` is what every dialect's image part becomes (an OpenAI data URL, an Anthropic base64
block, Gemini `inlineData`, a Responses `input_image`). Its `digest` (sha256 of the bytes as the
harness sent them) is its identity everywhere after: in token memory's message keys, in the store
(each image kept once, however many calls show it), in training samples (the trainer loads the same
bytes by digest, so it sees the pixels the policy saw).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from collections.abc import Mapping
from dataclasses import dataclass

# Limits in line with the public APIs (OpenAI and Anthropic refuse images over ~20 MB / 8000 px).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_SIDE = 8000
MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}

_WHITESPACE = re.compile(r"\s+")
_URLSAFE = str.maketrans("-_", "+/")
_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?)(?P<b64>;base64)?,", re.I)


# Digests of images already checked, with what the check found. A harness resends every screenshot of
# the episode with each call; decoding them all again would cost more than the call itself.
_SEEN: dict[str, tuple[str, int, int]] = {}
_SEEN_MAX = 4096


class ImageError(ValueError):
    """An image the gateway refuses (not decodable, too large, unknown format): a 400 for the caller."""


@dataclass(frozen=True, slots=True)
class Image:
    digest: str  # hex sha256 of `data`
    media_type: str  # image/png, image/jpeg, image/webp or image/gif (what the bytes are)
    width: int
    height: int
    data: bytes

    def data_url(self) -> str:
        return f"data:{self.media_type};base64,{base64.b64encode(self.data).decode()}"

    def b64(self) -> str:
        return base64.b64encode(self.data).decode()

    def pil(self) -> object:
        """The decoded picture as an RGB PIL image (what processors take)."""
        from PIL import Image as PILImage

        with PILImage.open(io.BytesIO(self.data)) as im:
            return im.convert("RGB")


def image_from_bytes(data: bytes) -> Image:
    """Check and identify raw image bytes; the media type is read from the bytes, not trusted."""
    if not data:
        raise ImageError("the image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES} bytes")
    digest = hashlib.sha256(data).hexdigest()
    seen = _SEEN.get(digest)
    if seen is not None:
        return Image(digest, *seen, data)
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(data)) as im:
            fmt, (width, height) = im.format or "", im.size
            if fmt not in MEDIA_TYPES:
                raise ImageError(f"unsupported image format {fmt or 'unknown'}; send PNG, JPEG, WEBP or GIF")
            if width > MAX_SIDE or height > MAX_SIDE:
                raise ImageError(f"the image is {width}x{height} pixels; the limit is {MAX_SIDE} per side")
            im.load()  # a truncated or corrupt file fails here, not later in the engine
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError("the bytes are not an image this gateway reads (PNG, JPEG, WEBP or GIF)") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"the image could not be decoded: {exc}") from None
    except PILImage.DecompressionBombError as exc:
        raise ImageError(f"the image is too large to decode: {exc}") from None
    _SEEN[digest] = (MEDIA_TYPES[fmt], width, height)
    if len(_SEEN) > _SEEN_MAX:
        _SEEN.pop(next(iter(_SEEN)), None)
    return Image(digest, MEDIA_TYPES[fmt], width, height, data)


def image_from_base64(b64: str) -> Image:
    if len(b64) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"the image is over the limit of {MAX_IMAGE_BYTES} bytes")
    try:
        # Strict, so a malformed payload is named as such (not as an undecodable picture); line
        # breaks (MIME-wrapped base64), the URL-safe alphabet (the google-genai SDK sends it) and
        # missing padding are allowed.
        text = _WHITESPACE.sub("", b64).translate(_URLSAFE)
        data = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the image's base64 data is malformed: {exc}") from None
    return image_from_bytes(data)


def image_from_data_url(url: str) -> Image:
    """`data:image/png;base64,....`; a remote URL is refused (the gateway fetches nothing: the record
    must hold the pixels, and a proxy that fetches URLs for its callers is an open door)."""
    m = _DATA_URL.match(url)
    if m is None:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "a path"
        raise ImageError(
            f"image URL of scheme {scheme!r}: the gateway takes images inline only, as a data URL "
            "(data:image/png;base64,...) or an uploaded file's id"
        )
    if not m.group("b64"):
        raise ImageError("a data URL image must be base64-encoded (data:image/png;base64,...)")
    return image_from_base64(url[m.end() :])


# -- uploaded files ---------------------------------------------------------------------------
# An uploaded image (POST /v1/files) is kept like any image: once, by digest. Its file id is derived
# from the digest, so the same picture uploaded twice has one id, and a gateway restarted on the same
# store still knows every id it ever gave out.
FILE_ID_PREFIX = "file-"
_FILE_ID = re.compile(r"file-([0-9a-f]{64})")
_FILE_ID_BYTES = re.compile(rb"file-[0-9a-f]{64}")


def file_id(digest: str) -> str:
    return FILE_ID_PREFIX + digest


def digest_of_file_id(text: str) -> str | None:
    """The digest a gateway file id (bare, or inside a URI such as `.../files/file-<digest>`) names."""
    m = _FILE_ID.search(text)
    return m.group(1) if m else None


def file_ids_in(body: bytes) -> set[str]:
    """The gateway file ids a request body mentions (fetched from the store before it is parsed)."""
    return {m.decode() for m in _FILE_ID_BYTES.findall(body)}


def image_from_file(ref: str, files: Mapping[str, Image]) -> Image:
    """The uploaded image a file reference names; `files` holds the request's files, by file id."""
    digest = digest_of_file_id(ref)
    image = files.get(file_id(digest)) if digest else None
    if image is None:
        raise ImageError(
            f"unknown file {ref!r}: this gateway knows only the images uploaded to it (POST /v1/files)"
        )
    return image


def image_from_url(url: str, files: Mapping[str, Image]) -> Image:
    """An image URL as the OpenAI APIs carry it: a data URL, or a gateway file id in its place."""
    if url.startswith(FILE_ID_PREFIX):
        return image_from_file(url, files)
    return image_from_data_url(url)
