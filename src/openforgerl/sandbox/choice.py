"""Which sandbox backend a run's rollouts use: `--backend local|docker|kubernetes` on `eval`, `rollout`,
`train`, `sft --teacher` and `tasks check` (cli/options.py), and the one place that makes it.

A light module: the backends themselves (and the docker and kubernetes SDKs) are imported by `make`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from openforgerl.sandbox.base import SandboxBackend

BackendName = Literal["local", "docker", "kubernetes"]
BACKENDS: tuple[BackendName, ...] = ("local", "docker", "kubernetes")
# Container backends: the image of tasks that name none. `make docker-base` builds it offline (Debian
# minbase with python3, which the gateway's relay and the built-in harnesses run on).
DEFAULT_IMAGE = "openforgerl/debian:bookworm"


@dataclass(frozen=True)
class BackendChoice:
    name: BackendName = "local"
    image: str = DEFAULT_IMAGE
    # The backend's own settings beyond run_id and image: DockerConfig's fields (base_url, runtime,
    # tmpfs_size, ...) or KubernetesConfig's (namespace, gateway_url, ...), as --backend-config has them.
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {self.name!r}")

    def make(self, run_id: str) -> SandboxBackend:
        """The backend for run `run_id`; ValueError names a setting it does not know."""
        if self.name == "local":
            from openforgerl.sandbox.local import LocalBackend

            return LocalBackend()
        if self.name == "docker":
            from openforgerl.sandbox.docker import DockerBackend, DockerConfig

            known = {f.name for f in dataclasses.fields(DockerConfig)} - {"run_id", "image"}
            unknown = sorted(set(self.settings) - known)
            if unknown:
                raise ValueError(
                    f"the docker backend has no setting {', '.join(unknown)} "
                    f"(it has {', '.join(sorted(known))})"
                )
            return DockerBackend(DockerConfig(run_id=run_id, image=self.image, **self.settings))
        import pydantic

        from openforgerl.sandbox.kubernetes import KubernetesBackend, KubernetesConfig

        try:
            cfg = KubernetesConfig.model_validate({"image": self.image, **self.settings, "run_id": run_id})
        except pydantic.ValidationError as exc:
            raise ValueError(f"the kubernetes backend's settings: {exc}") from exc
        return KubernetesBackend(cfg)

    @property
    def gateway_host(self) -> str:
        """Where a gateway embedded in the run (eval, train, sft --teacher) listens: loopback, or for
        Kubernetes the settings' `gateway_host`, an address of this machine that Pods route to (such
        as `make k8s-up`'s bridge), so that they reach the gateway at the runner's own URL."""
        host = self.settings.get("gateway_host") if self.name == "kubernetes" else None
        return str(host or "127.0.0.1")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "image": self.image, "settings": dict(self.settings)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> BackendChoice:
        return cls(**d) if d else cls()
