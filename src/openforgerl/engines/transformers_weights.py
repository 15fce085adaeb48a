"""A save_pretrained checkpoint's weights for the built-in engine's in-place swap
(`TransformersEngine.load_weights`): read, renamed to the model's parameters and checked against
them, so a swap never half-applies. Runs off the event loop, on a thread of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from openforgerl.engines.base import EngineError


def checkpoint_names_to_model(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """Rename checkpoint tensors to the model's parameter names.

    save_pretrained writes some models (Qwen2-VL: `model.layers.*`, `visual.*`) under the names of an
    older layout than their modules' (`model.language_model.layers.*`, `model.visual.*`);
    from_pretrained renames them on load with the model's registered renamings, and so does this.
    """
    params = model.state_dict()
    if all(k in params for k in state):
        return state
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    out = {}
    for key, tensor in state.items():
        name = key
        for renaming in renamings:
            if name in params:
                break
            name, _ = renaming.rename_source_key(name)
        out[name] = tensor
    return out


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def validated_state(path: str, model: Any) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, checked against the model so a swap never half-applies."""
    return validated_tensors(read_state_dict(path), model, f"checkpoint {path}")


def validated_tensors(
    state: dict[str, torch.Tensor], model: Any, source: str = "the weights"
) -> dict[str, torch.Tensor]:
    """Named tensors (a checkpoint's, or a trainer's in memory) renamed to the model's parameters and
    checked against them: no unknown name, no missing tensor, every shape right."""
    state = checkpoint_names_to_model(state, model)
    params = model.state_dict()
    unexpected = sorted(set(state) - set(params))
    if unexpected:
        raise EngineError(f"{source} has tensors the model lacks: {unexpected[:5]}")
    # Tied weights (e.g. lm_head = embed_tokens) are saved once; they share storage in the model.
    loaded_ptrs = {params[k].data_ptr() for k in state}
    missing = sorted(k for k in set(params) - set(state) if params[k].data_ptr() not in loaded_ptrs)
    if missing:
        raise EngineError(f"{source} lacks tensors: {missing[:5]}")
    for k, t in state.items():
        if t.shape != params[k].shape:
            raise EngineError(f"{source}: {k} has shape {tuple(t.shape)}, want {params[k].shape}")
    return state
