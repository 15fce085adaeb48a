"""Vision-language models: the processor, pixel inputs and 3-D rope positions, shared by engine and trainer.

The engine and the trainer must feed a model the same pixels for the same image, or the trainer's
recomputed logprobs drift from the ones the engine sampled with. Both therefore load the model with
`load_model` and the processor with `load_processor`, compute a sequence's pixel inputs with
`checked_vision_inputs` (`vision_inputs`, checked against its placeholders), position ids with
`rope_positions`, and mask the ids no policy emits with `mask_unsampleable`.

`load_processor` builds the processor from the tokenizer and the image processor's PIL backend
rather than with AutoProcessor: transformers' AutoProcessor (for the video processor) and
AutoImageProcessor need torchvision, and a torchvision backend resizes with other kernels than PIL's,
so one backend everywhere keeps pixels identical on every machine. Supported: the Qwen2-VL family
(`Qwen2VLForConditionalGeneration`, and models with the same image placeholder and rope scheme).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from openforgerl.images import Image

PREPROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class VisionProcessor:
    """What the gateway, engine and trainer need of a VLM's processor."""

    tokenizer: Any
    image_processor: Any
    image_token: str  # the placeholder repeated once per image token, e.g. <|image_pad|>
    image_token_id: int
    merge_size: int  # patches merged into one token per side

    def image_tokens(self, image: Image) -> int:
        """How many placeholder tokens `image` expands to (its pixels are not processed)."""
        patches = int(self.image_processor.get_number_of_image_patches(image.height, image.width, {}))
        return patches // self.merge_size**2


# Config attributes naming the tokens that only the processor writes (image/video placeholders and
# their brackets), never the model: a sampled one would make the next prompt's image runs mismatch.
_PROCESSOR_ONLY = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
NEVER_SAMPLED = -1e9  # the logit these tokens get: exp() of it is exactly 0 in float32


def unsampleable_token_ids(model: Any) -> list[int]:
    """The ids a VLM policy may never emit, masked alike in the engine's sampling and the trainer's
    logprobs (so both describe one distribution); none for a text model."""
    ids = set()
    for config in (model.config, getattr(model.config, "text_config", None)):
        for name in _PROCESSOR_ONLY:
            value = getattr(config, name, None)
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    return sorted(ids)


def mask_unsampleable(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`logits` with the `ids` no policy may emit (`unsampleable_token_ids`, as a tensor) set to
    NEVER_SAMPLED along the last axis; `logits` itself when there are none."""
    if not len(ids):
        return logits
    return logits.index_fill(-1, ids.to(logits.device), NEVER_SAMPLED)


def is_vision_model(model_dir: str | Path) -> bool:
    """Whether the directory holds a vision-language model (its config has a vision tower)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return False
    return "vision_config" in json.loads(config.read_text())


def load_model(model_dir: str | Path, dtype: torch.dtype | str = torch.float32) -> Any:
    """The model of `model_dir`: AutoModelForImageTextToText for a vision-language model, else
    AutoModelForCausalLM (the engine and the trainer load the same class)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto: Any = AutoModelForImageTextToText if is_vision_model(model_dir) else AutoModelForCausalLM
    return auto.from_pretrained(model_dir, dtype=dtype)


def _image_processor(model_dir: Path) -> Any:
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    config = json.loads((model_dir / PREPROCESSOR_FILE).read_text())
    name = str(config.get("image_processor_type") or "Qwen2VLImageProcessor").removesuffix("Fast")
    cls = get_image_processor_class_from_name(name.removesuffix("Pil") + "Pil")
    if cls is None:
        raise ValueError(f"{model_dir}: no PIL image processor for {name}")
    return cls.from_pretrained(model_dir)


def load_processor(model_dir: str | Path) -> VisionProcessor:
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not (path / PREPROCESSOR_FILE).is_file():
        raise ValueError(f"{model_dir} has no {PREPROCESSOR_FILE}: not a vision-language model directory")
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = _image_processor(path)
    image_token = str(getattr(tokenizer, "image_token", None) or "<|image_pad|>")
    image_token_id = tokenizer.convert_tokens_to_ids(image_token)
    if not isinstance(image_token_id, int) or image_token_id == tokenizer.unk_token_id:
        raise ValueError(f"{model_dir}: the tokenizer has no image token {image_token}")
    return VisionProcessor(
        tokenizer, image_processor, image_token, image_token_id, int(image_processor.merge_size)
    )


def vision_inputs(processor: VisionProcessor, images: Sequence[Image]) -> dict[str, torch.Tensor]:
    """`pixel_values` (patches x features) and `image_grid_thw` (images x 3) of `images`, in order."""
    if not images:
        raise ValueError("vision_inputs needs at least one image")
    out = processor.image_processor([im.pil() for im in images], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def image_token_counts(processor: VisionProcessor, grid_thw: torch.Tensor) -> list[int]:
    """Placeholder tokens per image, from the processed grid."""
    return [int(n) // processor.merge_size**2 for n in grid_thw.prod(-1).tolist()]


def check_placeholders(processor: VisionProcessor, ids: Sequence[int], counts: Sequence[int]) -> None:
    """Raise ValueError unless `ids` hold exactly one placeholder run of each image's size, in order."""
    runs: list[int] = []
    prev = False
    for t in ids:
        is_pad = t == processor.image_token_id
        if is_pad:
            if prev:
                runs[-1] += 1
            else:
                runs.append(1)
        prev = is_pad
    if runs != list(counts):
        raise ValueError(
            f"the prompt's image placeholder runs {runs} do not match its images' token counts {list(counts)}"
        )


def checked_vision_inputs(
    processor: VisionProcessor, ids: Sequence[int], images: Sequence[Image]
) -> dict[str, torch.Tensor] | None:
    """The `vision_inputs` of a sequence's `images` (None when it has none), after checking that `ids`
    hold one placeholder run of each image's size, in order (ValueError otherwise)."""
    out = vision_inputs(processor, images) if images else None
    check_placeholders(processor, ids, image_token_counts(processor, out["image_grid_thw"]) if out else [])
    return out


def rope_positions(
    model: Any, ids: torch.Tensor, attention: torch.Tensor, grid_thw: torch.Tensor | None, image_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, B, L) M-RoPE position ids and (B,) rope deltas (next text position minus sequence length).

    Image tokens take (temporal, height, width) positions; text continues after the image's largest
    one. Padding (attention 0) gets position 0. Computed by the model's own `get_rope_index`.
    """
    token_type = (ids == image_token_id).int()
    position_ids, deltas = model.model.get_rope_index(
        ids, mm_token_type_ids=token_type, image_grid_thw=grid_thw, attention_mask=attention
    )
    return position_ids, deltas.reshape(-1)
