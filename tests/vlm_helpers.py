"""Tiny vision-language model and images for the VLM tests."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

from openforgerl.images import Image, image_from_bytes
from openforgerl.modelkit import cached_model


def tiny_vlm(tmp: Path) -> Path:
    """A private copy of the kit's tiny Qwen2-VL (built once per machine and kit version, then copied)."""
    out = tmp / "tiny-vlm"
    if not out.is_dir():
        shutil.copytree(cached_model("tiny", 0, vision=True), out)
    return out


def screenshot(width: int = 640, height: int = 400, seed: int = 0) -> Image:
    """A PNG with coloured blocks that depend on `seed` (different seeds: different pixels, same size)."""
    import random

    from PIL import Image as PILImage
    from PIL import ImageDraw

    rng = random.Random(seed)
    im = PILImage.new("RGB", (width, height), (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
    draw = ImageDraw.Draw(im)
    for _ in range(12):
        x, y = rng.randrange(width), rng.randrange(height)
        w, h = rng.randrange(8, width // 2), rng.randrange(8, height // 2)
        draw.rectangle(
            (x, y, x + w, y + h), fill=(rng.randrange(256), rng.randrange(256), rng.randrange(256))
        )
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return image_from_bytes(buf.getvalue())
