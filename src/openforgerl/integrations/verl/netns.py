"""Run a command in a network namespace of its own with only loopback up: where veRL's Ray runs on CPU.

Ray binds the machine's own address, not loopback, and forcing it to loopback has hung; in a
network namespace whose only interface is `lo`, every connection Ray, the gateway and the sandboxes
make stays on this machine, and nothing outside can reach them. A PID namespace comes with it, so
nothing the run started outlives it. `unshare --net` (as root; with
`--user --map-root-user` otherwise) makes the namespace; this module, run inside it, brings `lo` up,
removes a killed run's stale Ray session pointer, and execs the command:

    unshare --net --pid --fork --kill-child --mount-proc -- \
        python -m openforgerl.integrations.verl.netns -- COMMAND...
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import sys
from collections.abc import Sequence
from pathlib import Path

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

# What every veRL process on the CPU needs (the launcher sets them before Ray starts, so the driver
# and every Ray worker inherit them).
CPU_ENV = {
    "VERL_PLATFORM": "cpu",  # the project's CPU platform (integrations/verl/cpu.py)
    "VERL_ENGINE_DEVICE": "cuda",  # veRL's FSDP engine, registered for cuda/npu, runs on CPU tensors
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def loopback_up() -> None:
    """Bring `lo` up in the current network namespace (an ioctl: no `ip` binary needed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, ifreq))[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def clean_stale_ray(tmp: str | None = None) -> None:
    """A killed run leaves `/tmp/ray/ray_current_cluster` (and a session link) behind, which makes
    the next `ray.init` try to join a cluster that is gone."""
    root = Path(tmp or os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"
    for name in ("ray_current_cluster",):
        with_path = root / name
        if with_path.exists():
            with_path.unlink()
    latest = root / "session_latest"
    if latest.is_symlink() and not latest.exists():
        latest.unlink()


def wrap(command: Sequence[str], python: str = sys.executable) -> list[str]:
    """`command` run in a network namespace of its own (see the module doc)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise ValueError("`unshare` (util-linux) gives Ray a private network: apt install util-linux")
    # A PID namespace too (with its own /proc): when the command ends, the kernel ends every process
    # left in it (Ray's daemons and workers), so a killed run leaves nothing behind.
    flags = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if os.geteuid() != 0:
        flags = ["--user", "--map-root-user", *flags]
    return [unshare, *flags, "--", python, "-m", "openforgerl.integrations.verl.netns", "--", *command]


INSIDE_ENV = "OPENFORGE_VERL_NETNS"  # set inside: a launcher there runs its command as it is


def inside() -> bool:
    return os.environ.get(INSIDE_ENV) == "1"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        raise SystemExit("usage: python -m openforgerl.integrations.verl.netns -- COMMAND...")
    loopback_up()
    clean_stale_ray()
    os.environ[INSIDE_ENV] = "1"
    os.execvp(args[0], args)


if __name__ == "__main__":
    main()
