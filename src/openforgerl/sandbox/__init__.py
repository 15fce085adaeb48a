"""Sandboxes behind one protocol (see `base.Sandbox`); `local.LocalBackend` runs them on this machine."""

from __future__ import annotations

from openforgerl.sandbox.base import (
    BackendCheck,
    ExecResult,
    ImageUnavailable,
    Limits,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxInfo,
    SandboxSpec,
    SandboxStartError,
    SandboxUnavailable,
)

__all__ = [
    "BackendCheck",
    "ExecResult",
    "ImageUnavailable",
    "Limits",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxStartError",
    "SandboxUnavailable",
]
