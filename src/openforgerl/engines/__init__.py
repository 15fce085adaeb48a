"""Inference engines behind one protocol (see `base.Engine`)."""

from __future__ import annotations

from openforgerl.engines.base import Engine


def make_engine(spec: str, model_dir: str) -> Engine:
    """`builtin` (transformers in this process), `vllm:URL` or `sglang:URL`."""
    kind, _, url = spec.partition(":")
    if kind == "builtin":
        from openforgerl.engines.transformers_engine import TransformersEngine

        return TransformersEngine(model_dir)
    if kind in ("vllm", "sglang") and url:
        if kind == "vllm":
            from openforgerl.engines.vllm import VLLMEngine

            return VLLMEngine(url)
        from openforgerl.engines.sglang import SGLangEngine

        return SGLangEngine(url)
    raise ValueError(f"unknown engine {spec!r}: use builtin, vllm:URL or sglang:URL")
