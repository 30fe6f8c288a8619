"""``python -m jmp.launch -n N [--cpu-devices K] [--port P] [-m module | script.py] [args...]``.

Like ``torchrun --nproc-per-node N`` on one machine: starts N processes of the script (or module) with
torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ...), so
``smp.init()`` in each joins one JAX multi-process run (``jax.distributed``). It is for trying a
multi-process run on one machine and for tests; on a cluster use the cluster's launcher (torchrun, SLURM,
mpirun), which ``smp.init()`` recognises too. ``--cpu-devices K`` gives each process K emulated CPU devices,
so N processes x K devices run on a laptop.

The children share the launcher's stdout and stderr. When one exits non-zero or is killed, the launcher stops
the others (SIGTERM, then SIGKILL ``--grace`` seconds later, default 10), says on stderr which rank failed and
how, and exits with that child's code (128 + the signal number for a signal). SIGINT / SIGTERM / SIGHUP sent
to the launcher are passed on to the children. The launcher exits 0 only when every child does.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

# How long stopped children get after SIGTERM before SIGKILL. A process in a JAX multi-process run catches
# SIGTERM (JAX's preemption notifier records it for multihost_utils.reached_preemption_sync_point) and keeps
# running, so it is the SIGKILL that stops it.
GRACE_SECONDS = 10.0
_POLL_SECONDS = 0.05
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
# A launcher JAX would read before torchrun's variables (see jmp.runtime.mesh_state): they would describe another run.
_OTHER_LAUNCHERS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jmp.launch",
        description="Run N local processes of a jmp script as one JAX multi-process run (like torchrun).",
    )
    parser.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, required=True)
    parser.add_argument(
        "--cpu-devices", type=int, default=None, help="emulated CPU devices per process (sets JAX_PLATFORMS=cpu)"
    )
    parser.add_argument(
        "--port", type=int, default=None, help="MASTER_PORT (default: a free one); JAX's coordinator uses PORT+1"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=GRACE_SECONDS,
        help="seconds stopped processes get between SIGTERM and SIGKILL (default %(default)s)",
    )
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("target", help="the script (or, with -m, the module) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to every process")
    return parser


def free_port_pair(host: str = "", attempts: int = 50) -> int:
    """A port P with P and P + 1 free (torch's MASTER_PORT and jmp's JAX coordinator), found by binding
    (on every interface by default: JAX's coordinator listens on all of them)."""
    for _ in range(attempts):
        with socket.socket() as first:
            first.bind((host, 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind((host, port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError(f"jmp.launch: found no two consecutive free ports on {host} in {attempts} attempts")


def child_environment(
    rank: int, world_size: int, port: int, cpu_devices: int | None = None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of local process ``rank`` of ``world_size``: torchrun's variables on one node."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _OTHER_LAUNCHERS}
    env |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
    }
    if cpu_devices is not None:
        flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={cpu_devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _find_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # Linux's libc
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL if the launcher dies without stopping its children (Linux)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} ({-code})"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


class _Children:
    """The launched processes; stops them all when one fails or the launcher is signalled."""

    def __init__(self):
        self.processes: list[subprocess.Popen] = []
        self.signalled: int | None = None

    def start(self, command: list[str], env: dict[str, str]) -> None:
        # each child in its own session: a terminal's Ctrl-C reaches the launcher only, which passes it on once
        self.processes.append(subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent))

    def forward(self, signum: int, _frame=None) -> None:
        """Signal handler: pass ``signum`` on to the running children (a second signal kills them)."""
        if self.signalled is not None:
            self.send(signal.SIGKILL)
            return
        self.signalled = signum
        self.send(signum)

    def send(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    process.send_signal(signum)
                except ProcessLookupError:
                    pass

    def stop(self, grace: float, signum: int | None = signal.SIGTERM) -> None:
        """Send ``signum`` to the children still running, SIGKILL those still running ``grace`` seconds later."""
        if signum is not None:
            self.send(signum)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.processes):
            time.sleep(_POLL_SECONDS)
        self.send(signal.SIGKILL)
        for process in self.processes:
            process.wait()

    def wait(self, grace: float) -> int:
        """Wait for every child; on the first failure stop the others. Returns the launcher's exit code."""
        while True:
            if self.signalled is not None:
                name = signal.Signals(self.signalled).name
                print(f"jmp.launch: got {name}, passed it on to the processes", file=sys.stderr, flush=True)
                self.stop(grace, signum=None)  # they have the signal already
                return 128 + self.signalled
            codes = [p.poll() for p in self.processes]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                running = sum(c is None for c in codes)
                print(
                    f"jmp.launch: rank {rank} (pid {self.processes[rank].pid}) {_describe(code)}; "
                    f"stopping the {running} other running process(es)",
                    file=sys.stderr,
                    flush=True,
                )
                self.stop(grace)
                return _exit_code(code)
            if all(code == 0 for code in codes):
                return 0
            time.sleep(_POLL_SECONDS)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher with command-line arguments ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    options = _parser().parse_args(argv)
    if options.nproc < 1:
        _parser().error(f"-n must be at least 1, got {options.nproc}")
    if options.cpu_devices is not None and options.cpu_devices < 1:
        _parser().error(f"--cpu-devices must be at least 1, got {options.cpu_devices}")
    port = options.port if options.port is not None else free_port_pair()
    command = [sys.executable, *(["-m"] if options.module else []), options.target, *options.args]
    environments = [child_environment(r, options.nproc, port, options.cpu_devices) for r in range(options.nproc)]
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.getsignal(s) for s in handled}
    children = _Children()
    try:
        for s in handled:  # before the first child starts, so a signal during the start reaches those started
            signal.signal(s, children.forward)
        for env in environments:
            if children.signalled is None:
                children.start(command, env)
        return children.wait(options.grace)
    finally:
        for s, handler in previous.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(s, handler)
        children.stop(0)  # after an unexpected error here too, no child outlives the launcher


if __name__ == "__main__":
    sys.exit(main())
