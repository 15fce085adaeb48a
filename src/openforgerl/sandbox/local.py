"""The local backend: bubblewrap namespaces, cgroup v1 limits; a plain subprocess where bwrap is missing.

Each exec is one bwrap run over the sandbox's own work dir, HOME and /tmp (host temp dirs that persist
between execs): new user, pid, net, ipc, uts and cgroup namespaces; a root holding only the read-only
system dirs (/usr, /etc, the lib links) and the spec's binds, minus its hidden paths; uid 1000, no
capabilities, and the seccomp filter of seccomp.py (ptrace, mount, namespaces, bpf, io_uring... fail
with EPERM). The pid namespace dies with its command, so nothing one exec starts outlives it.

Who uid 1000 is on the host: a root runner drops to `host_user` (nobody:nogroup by default) before
bwrap starts (setpriv: no capabilities, no other groups, no_new_privs), so the kernel's own checks keep
from the agent every file that other users may not read, under /etc and under every bind alike (a
0600 file in the venv, a 0700 dir in the package). The sandbox's work dir, HOME and /tmp belong to that
uid, and so does every file the runner puts there. bwrap resolves its binds as that uid too: a bind the
uid could not reach (the interpreter under a 0700 /root) is first bound by root onto a mount point it
can reach, in a mount namespace of the exec's own. A runner that is not root runs sandboxes as itself,
and masks /etc where other users may not read instead.
With network "gateway" the command's loopback has a relay (bridge.py) to a Unix socket that the host
end forwards to the gateway; nothing else is reachable. With network "host" (for tasks on live web
sites) the command shares the host's network namespace: it reaches the internet, the gateway at its
host URL, and whatever else listens on the host, its loopback included; the other namespaces stay.

A spec's own work dir (`SandboxSpec.workdir`, Harbor's /app) is where bwrap binds the sandbox's work
dir, and each of its extra dirs (/tests, /logs/verifier) is a dir of the sandbox's own bound there;
without bwrap such a spec is refused (SandboxUnavailable), as the host has no /app to give.

Limits: a cgroup v1 per sandbox (memory, cpu, pids) that every exec joins before it starts, which also
tells OOM kills and pids-limit hits apart; rlimits through `prlimit` where cgroups are not writable.

Without bwrap, commands run as plain subprocesses in the sandbox's temp dirs: no isolation at all, and
the backend says so (a warning at every creation, isolation "none" in check() and info). Paths inside are
then those host dirs: `workdir`, HOME and `tmpdir` (TMPDIR), never the host's own /tmp.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

from openforgerl.sandbox import seccomp as seccomp_filter
from openforgerl.sandbox.base import (
    OUTPUT_LIMIT,
    BackendCheck,
    SandboxSpec,
    SandboxUnavailable,
)
from openforgerl.sandbox.cgroups import CGROUP_PARENT, CONTROLLERS
from openforgerl.sandbox.local_sandbox import DEFAULT_PATH as DEFAULT_PATH
from openforgerl.sandbox.local_sandbox import INSIDE_HOME as INSIDE_HOME
from openforgerl.sandbox.local_sandbox import INSIDE_RUN as INSIDE_RUN
from openforgerl.sandbox.local_sandbox import INSIDE_WORKDIR as INSIDE_WORKDIR
from openforgerl.sandbox.local_sandbox import SANDBOX_UID as SANDBOX_UID
from openforgerl.sandbox.local_sandbox import STAGE
from openforgerl.sandbox.local_sandbox import LocalSandbox as LocalSandbox

log = logging.getLogger(__name__)

# The host uid:gid that sandboxes run as when the runner is root (nobody:nogroup unless this is set).
HOST_USER_ENV = "OPENFORGERL_SANDBOX_USER"
DEFAULT_HOST_USER = (65534, 65534)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")


def _unreadable_under(top: str) -> tuple[list[str], list[str]]:
    """Files and dirs under `top` that other users may not read. The sandbox's uid maps to the runner's
    (root here), so unmasked it would read what the host keeps from unprivileged users (/etc/shadow)."""
    files: list[str] = []
    dirs: list[str] = []
    for dirpath, dirnames, filenames in os.walk(top):
        for d in list(dirnames):
            p = os.path.join(dirpath, d)
            mode = os.lstat(p).st_mode
            if stat.S_ISDIR(mode) and mode & 0o005 != 0o005:
                dirs.append(p)
                dirnames.remove(d)
        for f in filenames:
            p = os.path.join(dirpath, f)
            mode = os.lstat(p).st_mode
            if stat.S_ISREG(mode) and not mode & stat.S_IROTH:
                files.append(p)
    return files, dirs


def _host_user(value: str) -> tuple[int, int]:
    """uid[:gid] (the gid defaults to the uid) as HOST_USER_ENV gives it."""
    uid, _, gid = value.partition(":")
    try:
        user = (int(uid), int(gid or uid))
    except ValueError:
        raise ValueError(f"{HOST_USER_ENV} must be uid[:gid], not {value!r}") from None
    if min(user) < 0:
        raise ValueError(f"{HOST_USER_ENV} must be uid[:gid], not {value!r}")
    return user


class LocalBackend:
    """Sandboxes on this machine. bwrap/cgroups: None detects them, True requires them, False skips them.

    `host_user`: the host (uid, gid) that sandboxes run as when the runner is root; None takes
    OPENFORGERL_SANDBOX_USER (uid[:gid]) or else 65534:65534 (nobody:nogroup). A uid of 0 keeps them
    root, as they were before: then root-only files under the binds are readable inside. A runner that
    is not root runs them as itself. `seccomp`: load sandbox/seccomp.py's filter into every command.
    """

    name = "local"

    def __init__(
        self,
        *,
        bwrap: bool | None = None,
        cgroups: bool | None = None,
        state_dir: str | Path | None = None,
        cgroup_root: str | Path = "/sys/fs/cgroup",
        output_limit: int = OUTPUT_LIMIT,
        host_user: tuple[int, int] | None = None,
        seccomp: bool = True,
    ) -> None:
        self.state_dir = Path(state_dir) if state_dir else None
        self.cgroup_root = Path(cgroup_root)
        self.output_limit = output_limit
        self._available: dict[str, str] = {}
        self._missing: dict[str, str] = {}
        self.bwrap = self._find_bwrap(bwrap)
        self.host_user: tuple[int, int] | None = None
        self.drop_argv: list[str] = []  # setpriv and its args: becomes host_user, with no privileges
        self.stage_argv: list[str] = []  # unshare and the staging script (see STAGE)
        if self.bwrap:
            self._find_host_user(host_user)
        self.seccomp_program = self._seccomp_program(seccomp) if self.bwrap else None
        self.bwrap_base = self._bwrap_base() if self.bwrap else []
        self.cgroups = self._probe_cgroups(cgroups)
        self.prlimit = shutil.which("prlimit") if not self.cgroups else None
        if not self.cgroups:
            if self.prlimit:
                self._available["rlimits"] = (
                    f"{self.prlimit}: memory as RLIMIT_AS, pids as RLIMIT_NPROC unless root; "
                    "cpus not enforced, OOM not reported"
                )
            else:
                self._missing["rlimits"] = "prlimit not found (Debian package util-linux): no limits at all"
        if not self.bwrap:
            log.warning(
                "NO SANDBOX ISOLATION: bubblewrap is unavailable (%s); commands run as plain subprocesses "
                "that see the whole host, its files and its network. Install the Debian package bubblewrap.",
                self._missing.get("bwrap", "disabled"),
            )

    def _find_bwrap(self, want: bool | None) -> str | None:
        if want is False:
            self._missing["bwrap"] = "disabled by configuration"
            return None
        path = shutil.which("bwrap")
        if path is None:
            self._missing["bwrap"] = "bwrap not found: install the Debian package bubblewrap"
        else:
            probe = subprocess.run(
                [path, "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "true"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if probe.returncode == 0:
                self._available["bwrap"] = path
                return path
            self._missing["bwrap"] = (
                f"{path} cannot create namespaces here ({probe.stderr.strip()}): "
                "unprivileged user namespaces may be disabled"
            )
        if want:
            raise SandboxUnavailable(self._missing["bwrap"])
        return None

    def _find_host_user(self, want: tuple[int, int] | None) -> None:
        """Sets host_user and the commands that drop to it, where the runner is root and can."""
        if os.geteuid() != 0:
            self._available["user"] = f"sandboxes run as the runner's own uid {os.geteuid()}"
            return
        env = os.environ.get(HOST_USER_ENV)
        user = want if want is not None else _host_user(env) if env else DEFAULT_HOST_USER
        if user[0] == 0:
            self._missing["user"] = (
                "sandboxes run as host root (by configuration): root-only files are readable"
            )
            log.warning(
                "sandboxes run as host root: files only root may read, under every bind, are readable"
            )
            return
        tools = {t: shutil.which(t) for t in ("setpriv", "unshare", "mount")}
        lacking = [t for t, path in tools.items() if path is None]
        drop = [str(tools["setpriv"]), f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups"]
        drop += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        stage = [str(tools["unshare"]), "--mount", "--propagation", "private", "--"]
        stage += ["/bin/sh", "-c", STAGE.format(mount=shlex.quote(str(tools["mount"]))), "sh"]
        problem = f"{', '.join(lacking)} not found (Debian packages util-linux, mount)" if lacking else ""
        if not problem:
            assert self.bwrap
            # The whole chain an exec uses, once: a kernel or policy that refuses unprivileged user
            # namespaces (or mount namespaces to root) shows here, not in every sandbox.
            probe = subprocess.run(
                [
                    *stage[:5],
                    *drop,
                    self.bwrap,
                    "--unshare-all",
                    "--unshare-user",
                    "--ro-bind",
                    "/",
                    "/",
                    "true",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if probe.returncode != 0:
                problem = probe.stderr.strip() or f"exit {probe.returncode}"
        if problem:
            self._missing["user"] = (
                f"cannot run sandboxes as host uid {user[0]} ({problem}): they run as host root, "
                "and root-only files under the binds are readable inside"
            )
            log.warning("sandboxes run as host root: %s", self._missing["user"])
            return
        self.host_user, self.drop_argv, self.stage_argv = user, drop, stage
        self._available["user"] = (
            f"sandboxes run as host uid {user[0]}, gid {user[1]} (no capabilities, no other groups): "
            "files other users may not read stay unreadable under every bind"
        )

    def _seccomp_program(self, want: bool) -> bytes | None:
        if not want:
            self._missing["seccomp"] = "disabled by configuration"
            return None
        program = seccomp_filter.program()
        if program is None:
            self._missing["seccomp"] = f"no system call table for {os.uname().machine}: no filter"
            return None
        n = len(seccomp_filter.SYSCALLS[str(seccomp_filter.native_arch())])
        self._available["seccomp"] = f"{n} system calls fail with EPERM (openforgerl.sandbox.seccomp)"
        return program

    def _probe_cgroups(self, want: bool | None) -> bool:
        if want is False:
            self._missing["cgroups"] = "disabled by configuration"
            return False
        try:
            for c in CONTROLLERS:
                if not (self.cgroup_root / c / "cgroup.procs").exists():
                    raise FileNotFoundError(f"no cgroup v1 {c} hierarchy at {self.cgroup_root / c}")
                (self.cgroup_root / c / CGROUP_PARENT).mkdir(exist_ok=True)
        except OSError as e:
            self._missing["cgroups"] = f"cgroup v1 memory/cpu/pids not writable ({e}); rlimits instead"
            if want:
                raise SandboxUnavailable(self._missing["cgroups"]) from e
            return False
        where = f"{self.cgroup_root}/{{memory,cpu,pids}}/{CGROUP_PARENT}"
        self._available["cgroups"] = f"cgroup v1 under {where}"
        return True

    @property
    def isolation(self) -> str:
        return "bwrap" if self.bwrap else "none"

    @property
    def limits(self) -> str:
        return "cgroup" if self.cgroups else "rlimit" if self.prlimit else "none"

    def _bwrap_base(self) -> list[str]:
        """The bwrap args every sandbox shares: namespaces, identity, and the read-only system (/usr, the
        lib and bin links, /etc: without host_user, masked where other users may not read)."""
        assert self.bwrap
        args = [self.bwrap, "--unshare-all", "--unshare-user"]
        # bwrap >= 0.8 can forbid nested user namespaces, the usual door to kernel exploits.
        if (
            "--disable-userns"
            in subprocess.run([self.bwrap, "--help"], capture_output=True, text=True).stdout
        ):
            args.append("--disable-userns")
        args += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
        args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        for d in _SYSTEM_DIRS:
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        if self.host_user is not None:
            return args  # the kernel keeps from the sandbox's uid what other users may not read
        files, dirs = _unreadable_under("/etc")
        for f in files:
            args += ["--ro-bind", os.devnull, f]
        for d in dirs:
            args += ["--tmpfs", d]
        return args

    def check(self) -> BackendCheck:
        return BackendCheck(
            backend=self.name,
            isolation=self.isolation,
            limits=self.limits,
            available=dict(self._available),
            missing=dict(self._missing),
        )

    def create(self, spec: SandboxSpec, name: str) -> LocalSandbox:
        if not _NAME.fullmatch(name):
            raise ValueError(f"sandbox name {name!r} must match {_NAME.pattern}")
        for bind in spec.ro_binds:
            src = bind if isinstance(bind, str) else bind[0]
            if not os.path.exists(src):
                raise ValueError(f"ro_binds: {src} does not exist")
        if not self.bwrap and (spec.workdir or spec.extra_dirs):
            wanted = ", ".join(p for p in (spec.workdir, *spec.extra_dirs) if p)
            raise SandboxUnavailable(
                f"sandbox {name} needs {wanted} inside it, which the local backend makes only with "
                f"bubblewrap ({self._missing.get('bwrap', 'disabled')}): install the Debian package "
                "bubblewrap, or use the Docker backend"
            )
        if not self.bwrap:
            log.warning(
                "sandbox %s runs WITHOUT ISOLATION (no bwrap): it can read the host's files%s",
                name,
                " and reach any address" if spec.network == "gateway" else " and reach the network",
            )
        return LocalSandbox(self, spec, name)
