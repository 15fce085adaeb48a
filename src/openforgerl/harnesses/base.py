"""What every harness adapter provides, and the helpers they share.

A harness is a real, unmodified agent CLI. Its adapter knows four things: how to install the pinned
version into a cache folder, how to tell what is installed, which files and environment point it at a
gateway rollout (written as real files into a private HOME), and the argv for one task.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

# The gateway dialect names (`Dialect.name` in gateway/dialects).
Dialect = Literal["openai", "openai-responses", "anthropic", "gemini"]

# Variables a harness may inherit from the caller; everything else (API keys above all) stays out.
INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "SSL_CERT_FILE", "SSL_CERT_DIR")


def default_cache_dir() -> Path:
    """Where harnesses are installed unless told otherwise ($OPENFORGE_HARNESS_CACHE overrides)."""
    env = os.environ.get("OPENFORGE_HARNESS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "openforgerl" / "harnesses"


@dataclass(frozen=True, slots=True)
class Check:
    """What `check()` found: the installed version, or what is missing."""

    name: str
    pinned: str
    installed: str | None
    missing: str = ""

    @property
    def ok(self) -> bool:
        return self.installed == self.pinned and not self.missing


@dataclass(frozen=True, slots=True)
class RunResult:
    """One harness process, run to its end or to its time limit."""

    argv: list[str]
    returncode: int | None  # None when it was killed at the time limit
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


class Harness(Protocol):
    """One agent CLI, bound to the cache folder it is installed in."""

    name: str  # registry key, e.g. "claude-code"
    package: str  # what is installed: npm or PyPI name
    version: str  # the pinned version
    dialect: Dialect  # the gateway dialect it speaks
    can_resume: bool
    cache_dir: Path

    def install(self) -> None:
        """Install the pinned version under `cache_dir` (a no-op when it is already there)."""
        ...

    def check(self) -> Check: ...

    def prepare(
        self, home: Path, workdir: Path, base_url: str, api_key: str, model: str, max_turns: int | None = None
    ) -> dict[str, str]:
        """Write the config files into `home` and return the whole environment for `command`.

        `base_url` is the rollout's URL (no dialect suffix such as /v1): each adapter adds what its
        client expects. `max_turns` bounds the model calls of one run where the harness has such a
        limit of its own (mini-swe-agent's `agent.step_limit`); the others ignore it, and the task's
        timeout bounds them.
        """
        ...

    def command(self, task: str, resume: bool = False) -> list[str]:
        """argv for one task, run in the work directory with the environment from `prepare`."""
        ...

    def succeeded(self, result: RunResult, home: Path) -> bool:
        """The harness's own success signal for a finished run."""
        ...


class HarnessError(RuntimeError):
    """Installing a harness failed; the message carries the installer's own error."""


# -- shared helpers ------------------------------------------------------------------------------
def base_env(home: Path, extra_path: Sequence[Path] = ()) -> dict[str, str]:
    """A clean environment with a private HOME (and XDG dirs inside it) for one harness run."""
    env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
    env.setdefault("PATH", os.defpath)
    if extra_path:
        env["PATH"] = os.pathsep.join([*(str(p) for p in extra_path), env["PATH"]])
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_STATE_HOME=str(home / ".local" / "state"),
        XDG_CACHE_HOME=str(home / ".cache"),
        # No colours or spinners in captured output; no interactive prompts.
        NO_COLOR="1",
        TERM="dumb",
        CI="1",
    )
    return env


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def toml_string(value: str) -> str:
    """A TOML basic string: JSON's escapes (\\" \\\\ \\n \\uXXXX) are all valid TOML escapes."""
    return json.dumps(value)


def npm_binary() -> str:
    npm = shutil.which("npm")
    if npm is None:
        raise HarnessError("npm is not on PATH; install Node.js (>= 20) with npm.")
    return npm


def npm_install(prefix: Path, spec: str, path_prefix: Sequence[Path] = ()) -> None:
    """`npm install --prefix PREFIX pkg@X.Y.Z`: always an exact version.

    npm 11 otherwise picks the newest version whose `engines` matches the running node, which for
    some packages is an old release or an empty placeholder (openclaw 0.0.1 on node 20).
    """
    env = dict(os.environ)
    if path_prefix:
        env["PATH"] = os.pathsep.join([*(str(p) for p in path_prefix), env.get("PATH", os.defpath)])
    prefix.mkdir(parents=True, exist_ok=True)
    argv = [npm_binary(), "install", "--prefix", str(prefix), "--no-fund", "--no-audit", spec]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HarnessError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-4000:]}")


def npm_package_version(prefix: Path, package: str) -> str | None:
    """The version of `package` installed under an npm prefix, or None."""
    manifest = prefix / "node_modules" / package / "package.json"
    try:
        version = json.loads(manifest.read_text(encoding="utf-8")).get("version")
    except (OSError, ValueError):
        return None
    return version if isinstance(version, str) else None


def check_installed(name: str, pinned: str, installed: str | None, binary: Path) -> Check:
    """What `check()` reports for a harness whose installed version (None: not installed) was read."""
    missing = ""
    if installed is None:
        missing = f"not installed (openforge harness install {name})"
    elif installed != pinned:
        missing = f"version {installed} installed, {pinned} pinned"
    elif not binary.exists():
        missing = f"{binary} is missing"
    return Check(name, pinned, installed, missing)


class NpmHarness:
    """The common shape of the npm-installed harnesses: one npm prefix per harness."""

    name: str
    package: str
    version: str
    bin_name: str
    dialect: Dialect
    can_resume = True

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    @property
    def prefix(self) -> Path:
        return self.cache_dir / self.name

    @property
    def binary(self) -> Path:
        return self.prefix / "node_modules" / ".bin" / self.bin_name

    def install(self) -> None:
        if not self.check().ok:
            npm_install(self.prefix, f"{self.package}@{self.version}")

    def check(self) -> Check:
        return check_installed(
            self.name, self.version, npm_package_version(self.prefix, self.package), self.binary
        )

    # The one settings file `prepare` writes, relative to the private HOME (adapters that write more, or
    # something other than JSON, override `prepare`).
    settings_file: str

    def settings(self, workdir: Path, base_url: str, api_key: str, model: str) -> dict[str, Any]:
        """The content of `settings_file` for one rollout."""
        raise NotImplementedError

    def environment(self, base_url: str, api_key: str, model: str) -> dict[str, str]:
        """The variables set on top of `base_env`."""
        return {}

    def prepare(
        self, home: Path, workdir: Path, base_url: str, api_key: str, model: str, max_turns: int | None = None
    ) -> dict[str, str]:
        write_json(home / self.settings_file, self.settings(workdir, base_url, api_key, model))
        return base_env(home) | self.environment(base_url, api_key, model)

    def succeeded(self, result: RunResult, home: Path) -> bool:
        return result.returncode == 0


def run(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout: float) -> RunResult:
    """Run a harness to its end; at the time limit its whole process group is killed.

    Output goes to files, not pipes: a helper the CLI leaves running (a server, a shell) would keep a
    pipe open and make a finished run look hung. stdin is empty, since several CLIs in print mode
    read a piped stdin into the prompt and wait for it to close.
    """
    start = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,  # its own process group, so it can be cleaned up as a whole
        )
        code: int | None
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        _kill_group(proc.pid)
        proc.wait()
        seconds = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        return RunResult(list(argv), code, stdout, stderr, seconds)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
