"""A vLLM server the run starts and stops itself (`--engine vllm`, no URL): on loopback, in the
environment that holds vLLM, with what RL needs of it.

What RL needs, and why (engines/vllm.py has the measurements):
- `VLLM_SERVER_DEV_MODE=1`: weights are reloaded through `/collective_rpc` after each step;
- `--logprobs-mode processed_logprobs`: the behaviour logprobs are of logits / temperature, as the
  trainer's are;
- `--dtype float32` unless told otherwise: the engine's logprobs then agree with an fp32 trainer's
  to float precision (bf16 halves the weight bytes a decode step reads: `OPENFORGE_VLLM_ARGS="--dtype
  bfloat16"`, benchmarks/README.md "RL throughput" measures both);
- on a CPU, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`: vLLM keeps one core for its front end unless told,
  which on 2 cores would leave the model one; and `VLLM_CPU_KVCACHE_SPACE=2` (GiB): unset, vLLM
  reserves 92% of the memory, and refuses to start where that much is not free.
Either environment variable, set already, is kept.

The server's Python is `OPENFORGE_VLLM_PYTHON`, else `.venv-vllm/bin/python` under the working
directory (what `make test-vllm` builds); vLLM usually lives in an environment of its own, since it
pins its own torch. `OPENFORGE_VLLM_ARGS` adds server arguments (they win over the ones above).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import tempfile
from pathlib import Path
from typing import Unpack

from openforgerl.engines.base import EngineError, EngineUnavailable
from openforgerl.engines.http import HTTPEngineOptions
from openforgerl.engines.vllm import VLLMEngine

PYTHON_ENV = "OPENFORGE_VLLM_PYTHON"
ARGS_ENV = "OPENFORGE_VLLM_ARGS"
LOCAL_VENV_PYTHON = Path(".venv-vllm/bin/python")
START_TIMEOUT_S = 900.0  # a CPU build compiles its graphs at start: about a minute for SmolLM2


def server_python() -> str:
    """The Python that runs the server: OPENFORGE_VLLM_PYTHON, else ./.venv-vllm/bin/python."""
    if given := os.environ.get(PYTHON_ENV):
        return given
    if LOCAL_VENV_PYTHON.exists():
        return str(LOCAL_VENV_PYTHON.absolute())  # not resolved: the venv's python is a link out of it
    raise EngineError(
        f"--engine vllm starts a vLLM server: set {PYTHON_ENV} to the Python of an environment with "
        "vLLM (`make test-vllm` builds one in .venv-vllm), or give a running server as vllm:URL"
    )


def server_command(python: str, model_dir: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The server's command line and environment."""
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--logprobs-mode", "processed_logprobs",
        *shlex.split(os.environ.get(ARGS_ENV, "")),
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
        # GiB of KV cache on a CPU build; unset, vLLM reserves 92% of the machine's memory, which
        # the trainer beside it needs (GPU builds ignore it).
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_NO_USAGE_STATS": "1",
    }
    return cmd, env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalVLLMEngine(VLLMEngine):
    """VLLMEngine on a server it starts in `start` and stops in `close` (its whole process group).
    The server's output goes to `log` (default: a file in the system's temporary folder), named in
    every error about it."""

    def __init__(self, model_dir: str, *, log: str | None = None, **kw: Unpack[HTTPEngineOptions]) -> None:
        self._python = server_python()
        port = _free_port()
        kw.setdefault("start_timeout", START_TIMEOUT_S)
        super().__init__(f"http://127.0.0.1:{port}", **kw)
        self._cmd, self._env = server_command(self._python, model_dir, port)
        self.log = log or tempfile.mkstemp(prefix="openforgerl-vllm-", suffix=".log")[1]
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with open(self.log, "wb") as out:  # noqa: ASYNC230 (opening a local file: no wait worth a thread)
            self._proc = await asyncio.create_subprocess_exec(
                *self._cmd,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
            )
        healthy = asyncio.ensure_future(super().start())
        exited = asyncio.ensure_future(self._proc.wait())
        try:
            await asyncio.wait({healthy, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not healthy.done():
                raise EngineUnavailable(
                    f"the vLLM server exited with {self._proc.returncode} while starting; its log, "
                    f"{self.log}, ends: {self._log_tail()}"
                )
            healthy.result()
        except BaseException:
            healthy.cancel()
            await self.close()
            raise
        finally:
            exited.cancel()

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            await self._stop()

    async def _stop(self) -> None:
        """SIGTERM to the server's process group (API server, engine core, workers), SIGKILL after
        30 s; then SIGKILL to whatever of the group outlived its leader."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.returncode is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def _log_tail(self, chars: int = 2000) -> str:
        try:
            return Path(self.log).read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(unreadable: {e})"

    @property
    def server_pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None
