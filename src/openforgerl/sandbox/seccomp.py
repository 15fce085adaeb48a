"""The seccomp filter of local sandboxes: the system calls an agent never needs fail with EPERM.

bwrap loads it (`--seccomp FD`) into the sandbox's init and command just before they start, so every
process inside carries it and none can drop it. It is a classic BPF program (`struct sock_filter`s)
built here, with no library: an allow-list would break whatever an agent runs next (a compiler, a
browser, a language runtime), so it denies a short list and lets the rest through.

Denied, by group:

- Other processes: `ptrace`, `process_vm_readv`/`process_vm_writev`, `pidfd_getfd`, `kcmp`. An agent
  has no business reading or steering another process's memory and files (its harness's included:
  the harness holds the rollout's API key), and ptrace is a classic lever for escaping a sandbox.
- Mounts, root changes and namespaces: `mount`, `umount2`, `pivot_root`, `chroot`, `unshare`,
  `setns` and the new mount API (`fsopen`, `fsconfig`, `fsmount`, `fspick`, `move_mount`,
  `open_tree`, `mount_setattr`). The sandbox's view of the file system is the runner's to set; new
  namespaces (user namespaces above all) open most of the kernel's privileged code to a process.
  bwrap's `--disable-userns` already refuses nested user namespaces; this refuses the call itself.
- The machine itself: kernel modules (`init_module`, `finit_module`, `delete_module`), `kexec_load`,
  `kexec_file_load`, `reboot`, `swapon`/`swapoff`, `acct`, the clock (`settimeofday`,
  `clock_settime`), the kernel log (`syslog`), quotas (`quotactl`, `quotactl_fd`), `vhangup`, I/O
  ports (`iopl`, `ioperm`, x86 only), `lookup_dcookie`, `uselib` (x86 only). Most need capabilities
  the sandbox lacks anyway; `syslog` may not (the host's kernel log, where dmesg_restrict is off).
- Kernel interfaces that are attack surface more than tools, and that no harness uses: `bpf`,
  `perf_event_open`, `userfaultfd`, the key rings (`keyctl`, `add_key`, `request_key`: not
  namespaced), io_uring (`io_uring_setup`, `io_uring_enter`, `io_uring_register`: Node's libuv falls
  back to its thread pool when setup fails) and `open_by_handle_at` (opens files by handle, past
  the mount namespace).

Calls of another ABI than the native one (32-bit x86 on x86_64, 32-bit ARM on aarch64, and x32's
numbers on x86_64) kill the process: their numbers differ, and a filter that let them through would
be a way around it. Only x86_64 and aarch64 are known; elsewhere `program()` returns None and the
backend says that sandboxes run without a filter.
"""

from __future__ import annotations

import errno
import platform
import struct

# <linux/audit.h>
AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
# <linux/seccomp.h>
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
# <linux/filter.h>: BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_JMP|BPF_JGE|BPF_K, BPF_RET|BPF_K
LD_ABS = 0x20
JEQ = 0x15
JGE = 0x35
RET = 0x06
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6];
_NR_OFFSET = 0
_ARCH_OFFSET = 4
_X32_SYSCALL_BIT = 0x40000000

DENIED_GROUPS: dict[str, tuple[str, ...]] = {
    "other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp"),
    "mounts and namespaces": (
        "mount",
        "umount2",
        "pivot_root",
        "chroot",
        "unshare",
        "setns",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "move_mount",
        "open_tree",
        "mount_setattr",
    ),
    "the machine": (
        "init_module",
        "finit_module",
        "delete_module",
        "kexec_load",
        "kexec_file_load",
        "reboot",
        "swapon",
        "swapoff",
        "acct",
        "settimeofday",
        "clock_settime",
        "syslog",
        "quotactl",
        "quotactl_fd",
        "vhangup",
        "iopl",
        "ioperm",
        "lookup_dcookie",
        "uselib",
    ),
    "attack surface": (
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "keyctl",
        "add_key",
        "request_key",
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "open_by_handle_at",
    ),
}
DENIED: tuple[str, ...] = tuple(name for group in DENIED_GROUPS.values() for name in group)

# The numbers of the denied calls, from <asm/unistd_64.h> (x86_64) and <asm-generic/unistd.h>
# (aarch64); a call the architecture lacks is left out. tests/sandbox/test_sandbox_hardening.py checks them
# against the headers where those are installed. Calls numbered from 424 on have the same number on
# every architecture (Linux 5.1 unified the tables): they are listed once.
_UNIFIED = {
    "pidfd_getfd": 438,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "move_mount": 429,
    "open_tree": 428,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
}
SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "kcmp": 312,
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "chroot": 161,
        "unshare": 272,
        "setns": 308,
        "init_module": 175,
        "finit_module": 313,
        "delete_module": 176,
        "kexec_load": 246,
        "kexec_file_load": 320,
        "reboot": 169,
        "swapon": 167,
        "swapoff": 168,
        "acct": 163,
        "settimeofday": 164,
        "clock_settime": 227,
        "syslog": 103,
        "quotactl": 179,
        "vhangup": 153,
        "iopl": 172,
        "ioperm": 173,
        "lookup_dcookie": 212,
        "uselib": 134,
        "bpf": 321,
        "perf_event_open": 298,
        "userfaultfd": 323,
        "keyctl": 250,
        "add_key": 248,
        "request_key": 249,
        "open_by_handle_at": 304,
        **_UNIFIED,
    },
    "aarch64": {
        "ptrace": 117,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "kcmp": 272,
        "mount": 40,
        "umount2": 39,
        "pivot_root": 41,
        "chroot": 51,
        "unshare": 97,
        "setns": 268,
        "init_module": 105,
        "finit_module": 273,
        "delete_module": 106,
        "kexec_load": 104,
        "kexec_file_load": 294,
        "reboot": 142,
        "swapon": 224,
        "swapoff": 225,
        "acct": 89,
        "settimeofday": 170,
        "clock_settime": 112,
        "syslog": 116,
        "quotactl": 60,
        "vhangup": 58,
        "lookup_dcookie": 18,
        "bpf": 280,
        "perf_event_open": 241,
        "userfaultfd": 282,
        "keyctl": 219,
        "add_key": 217,
        "request_key": 218,
        "open_by_handle_at": 265,
        **_UNIFIED,
    },
}
AUDIT_ARCH = {"x86_64": AUDIT_ARCH_X86_64, "aarch64": AUDIT_ARCH_AARCH64}
_MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def native_arch() -> str | None:
    """This machine's architecture as the tables name it, or None where there is no table."""
    return _MACHINES.get(platform.machine().lower())


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(arch: str | None = None) -> bytes | None:
    """The filter for `arch` (default: this machine's) as bwrap's --seccomp reads it; None where
    the architecture has no table."""
    arch = arch or native_arch()
    if arch not in SYSCALLS:
        return None
    # (code, k, label jumped to when true, label when false); labels resolve to relative jumps.
    code: list[tuple[int, int, str | None, str | None]] = [
        (LD_ABS, _ARCH_OFFSET, None, None),
        (JEQ, AUDIT_ARCH[arch], None, "kill"),
        (LD_ABS, _NR_OFFSET, None, None),
    ]
    if arch == "x86_64":
        # x32's numbers have bit 30 set; "negative" numbers (-1 from tracers) just fail with ENOSYS.
        code += [(JGE, 0x80000000, "allow", None), (JGE, _X32_SYSCALL_BIT, "kill", None)]
    code += [(JEQ, nr, "deny", None) for nr in sorted(set(SYSCALLS[arch].values()))]
    labels = {"allow": len(code), "deny": len(code) + 1, "kill": len(code) + 2}

    def jump(at: int, label: str | None) -> int:
        return 0 if label is None else labels[label] - at - 1

    out = [_insn(op, k, jump(i, t), jump(i, f)) for i, (op, k, t, f) in enumerate(code)]
    out += [_insn(RET, RET_ALLOW), _insn(RET, RET_ERRNO | errno.EPERM), _insn(RET, RET_KILL_PROCESS)]
    return b"".join(out)


def evaluate(prog: bytes, nr: int, arch: int) -> int:
    """What `prog` returns for a call: the few classic-BPF instructions program() uses, interpreted
    (for tests, and to check a program without loading it into a kernel)."""
    insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    data = struct.pack("=iI", nr, arch)
    acc = 0
    pc = 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == LD_ABS:
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (JEQ, JGE):
            taken = acc == k if code == JEQ else acc >= k
            pc += 1 + (jt if taken else jf)
        elif code == RET:
            return int(k)
        else:
            raise ValueError(f"instruction {code:#x} is not one program() emits")
