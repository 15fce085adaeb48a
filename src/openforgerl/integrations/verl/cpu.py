"""veRL on the CPU: a platform for veRL's `PlatformRegistry`, chosen with `VERL_PLATFORM=cpu`.

veRL 0.9.1 has no CPU platform, but a pluggable platform layer: `get_platform()` resolves
`VERL_PLATFORM` against the registry, and `import verl` imports our `verl.plugins` entry point
(`openforgerl.integrations.verl.plugin`) first, which registers this platform. What it handles:

- device ids: veRL moves tensors with `.to(get_device_id())` and builds `torch.device(...)` of it;
  `current_device()` returns `torch.device("cpu")`, so those stay on the CPU (an integer would mean
  `cuda:N`, which a CPU-only torch refuses);
- collectives: gloo. veRL builds the backend string `"cpu:gloo,{device}:{backend}"`, which is
  "cpu:gloo,cpu:gloo" here and torch rejects: `install()` wraps veRL's
  `initialize_global_process_group_ray` to pass plain "gloo" for that string (nothing else changes);
- Ray resources: veRL's resource pools ask for `num_gpus` (hard-coded `use_gpu=True`), so the CPU
  recipe declares logical GPUs (`ray_kwargs.ray_init.num_gpus`): one per training process. The
  resource name stays "GPU"; CUDA_VISIBLE_DEVICES is meaningless to a CPU torch;
- the training engine: veRL registers its FSDP engine for "cuda" and "npu" only; the engine code
  itself is device-agnostic, so `VERL_ENGINE_DEVICE=cuda` (set by the launcher: `netns.CPU_ENV`)
  selects it.

Nothing here is imported unless `VERL_PLATFORM=cpu`; importing it does not import veRL's trainer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformRegistry
from verl.plugin.platform.platform_base import PlatformBase

log = logging.getLogger(__name__)

PLATFORM = "cpu"


class _CPUDevice(ModuleType):
    """`torch.cpu` with the memory and RNG calls veRL makes of a device module (`torch.cuda`'s
    names): memory figures are 0 (veRL only logs them), caches have nothing to free, the RNG state is
    the CPU generator's."""

    def __init__(self) -> None:
        super().__init__("openforgerl_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> Any:
        return torch.device("cpu")

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * size
        return pages * size, total

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"


CPU_DEVICE = _CPUDevice()


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """veRL's platform interface on the CPU (see the module doc)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return CPU_DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM

    def current_device(self) -> Any:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: Any) -> None:
        return None

    def synchronize(self, device_index: Any = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"  # logical GPUs: veRL's resource pools always ask for num_gpus

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _plain_gloo(init: Any) -> Any:
    @functools.wraps(init)
    def wrapper(timeout_second: Any = None, backend: str | None = None) -> Any:
        if backend is None or backend.replace(" ", "") in ("cpu:gloo,cpu:gloo", "cpu:gloo"):
            backend = "gloo"  # torch refuses the same device twice in a backend list
        return init(timeout_second=timeout_second, backend=backend)

    wrapper.__openforge_cpu__ = True  # type: ignore[attr-defined]
    return wrapper


def install() -> None:
    """The one runtime wrap the CPU needs in veRL's own code (idempotent): plain gloo for the
    process group. Called by the plugin at `import verl`, before veRL's workers import the name."""
    from verl.utils import distributed

    fn = distributed.initialize_global_process_group_ray
    if not getattr(fn, "__openforge_cpu__", False):
        distributed.initialize_global_process_group_ray = _plain_gloo(fn)
    for name in ("verl.workers.engine_workers", "verl.checkpoint_engine.base"):
        module = __import__("sys").modules.get(name)
        if module is not None and not getattr(
            module.initialize_global_process_group_ray, "__openforge_cpu__", False
        ):
            module.initialize_global_process_group_ray = distributed.initialize_global_process_group_ray
