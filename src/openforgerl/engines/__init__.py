"""Inference engines behind one protocol (see `base.Engine`): the built-in one in this process
(`transformers_engine`) and the servers reached by HTTP (`vllm`, `sglang`, both on `http.HTTPEngine`)."""

from __future__ import annotations

from openforgerl.engines.base import PREFIX_CACHE_MB, Engine


def make_engine(
    spec: str,
    model_dir: str,
    *,
    policy_version: int = 0,
    threads: int | None = None,
    prefix_cache_mb: float = PREFIX_CACHE_MB,
) -> Engine:
    """`builtin` (transformers in this process), `vllm:URL` or `sglang:URL` (a running server), or
    `vllm` (a vLLM server on loopback that the engine starts and stops: vllm_server.py);
    `policy_version` is the version of the weights the engine starts with (its calls carry it until
    the first load_weights);
    `threads` caps the built-in engine's CPU threads (torch's intra-op pool, process-wide) and
    `prefix_cache_mb` sizes its prefix cache (0: off); server engines have their own."""
    kind, _, url = spec.partition(":")
    if kind == "builtin":
        from openforgerl.engines.transformers_engine import TransformersEngine

        return TransformersEngine(
            model_dir, policy_version=policy_version, threads=threads, prefix_cache_mb=prefix_cache_mb
        )
    if spec == "vllm":
        from openforgerl.engines.vllm_server import LocalVLLMEngine

        return LocalVLLMEngine(model_dir, policy_version=policy_version)
    if kind in ("vllm", "sglang") and url:
        if kind == "vllm":
            from openforgerl.engines.vllm import VLLMEngine

            return VLLMEngine(url, policy_version=policy_version)
        from openforgerl.engines.sglang import SGLangEngine

        return SGLangEngine(url, policy_version=policy_version)
    raise ValueError(f"unknown engine {spec!r}: use builtin, vllm, vllm:URL or sglang:URL")
