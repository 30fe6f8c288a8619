"""``python -m jmp.launch [-n N] [--cpu-devices K] [--max-restarts R] [options] [-m module | script.py] [args...]``.

SageMaker's launcher for model-parallel jobs, on one machine: one process per device (SMP's process model: a
script's batch is per process), with torchrun's environment, SMP's import paths and SageMaker's ``SM_*``
variables, so an SMP script's ``smp.init()`` joins one JAX multi-process run with no edit (docs/running_scripts.md).

A failed or killed child is seen at once (the launcher is its parent): the others are stopped, then restarted
(``--max-restarts``), or the launcher exits with the failed child's code (128 + the signal number for a signal);
restarts, preemption and ``--step-timeout``: docs/checkpoints.md. Signals sent to the launcher are passed on and
end the run (no restart). It exits 0 only when every child does.

This file uses the standard library only: running it does not import jmp (torch and JAX).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# How long stopped children get after SIGTERM before SIGKILL. A process in a JAX multi-process run catches
# SIGTERM (JAX's preemption notifier records it for multihost_utils.reached_preemption_sync_point) and keeps
# running, so after a failure it is the SIGKILL that stops it.
GRACE_SECONDS = 5.0
PREEMPTION_GRACE_SECONDS = 120.0
# where the processes save when preempted (read by jmp.saving.preemption; this file imports nothing of jmp)
PREEMPTION_DIRECTORY = "JMP_PREEMPTION_CHECKPOINT_DIR"
# the file a process touches after each step (jmp.runtime.step_boundary), watched by --step-timeout
PROGRESS_FILE = "JMP_PROGRESS_FILE"
HUNG_EXIT_CODE = 124  # as timeout(1)
# the file a process writes "connecting" into while smp.init starts JAX's runtime, "connected" after (mesh_state)
STARTUP_FILE = "JMP_STARTUP_FILE"
# a run whose process failed while connecting is started again this often, besides any --max-restarts
STARTUP_RETRIES = 2
_STACK_DUMP_SECONDS = 1.0  # for faulthandler's dumps (SIGUSR1) to reach the launcher's output
_POLL_SECONDS = 0.05
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
# A launcher JAX would read before torchrun's variables (see jmp.runtime.mesh_state): they would describe another run.
_OTHER_LAUNCHERS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# Where `smdistributed` (the package SMP scripts import) resolves to jmp: put first on the children's PYTHONPATH.
SMP_ALIAS_PATH = Path(__file__).resolve().parent / "runtime" / "smp_import_path"
MP_PARAMETERS = "SM_HP_MP_PARAMETERS"
FRAMEWORK_PARAMS = "SM_FRAMEWORK_PARAMS"
# What gloo (JAX's CPU collectives) prints on stdout for every peer group it connects, in every process.
_GLOO_LINE = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
_GLOO_PREFIX = b"[Gloo]"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jmp.launch",
        description="Run N local processes of a jmp script as one JAX multi-process run (like torchrun).",
    )
    parser.add_argument(
        "-n",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        type=int,
        default=None,
        help="processes to start (default: one per GPU; required without GPUs)",
    )
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="emulated CPU devices per process (sets JAX_PLATFORMS=cpu; default 1 on a machine without GPUs)",
    )
    parser.add_argument(
        "--mp-parameters",
        default=None,
        help="the modelparallel parameters as a JSON object, given to the processes as SM_HP_MP_PARAMETERS "
        "(smp.init() with no argument reads them); default: SM_HP_MP_PARAMETERS of the environment",
    )
    parser.add_argument(
        "--no-smp-aliases",
        dest="smp_aliases",
        action="store_false",
        help="do not make `import smdistributed.modelparallel.torch` and `import torch.sagemaker` resolve to jmp "
        "in the processes (nor init_process_group take any backend name)",
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
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=0,
        help="restart every process this many times at most when one fails (torchrun's option; default 0)",
    )
    parser.add_argument(
        "--preemption-checkpoint-dir",
        default=None,
        help="on SIGTERM (to the launcher or a process) every process finishes its step, saves partial checkpoint "
        "'preempted' here (its newest) and exits 0 (JMP_PREEMPTION_CHECKPOINT_DIR; see jmp.saving.preemption)",
    )
    parser.add_argument(
        "--preemption-grace",
        type=float,
        default=PREEMPTION_GRACE_SECONDS,
        help="with --preemption-checkpoint-dir: seconds the processes get after SIGTERM to save and exit before "
        "SIGKILL (default %(default)s, a spot instance's notice)",
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        help="a process that finishes no training step for this many seconds (after its first) is hung: every "
        "process's Python stack is dumped, then all are stopped (and restarted with --max-restarts); default off",
    )
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("target", help="the script (or, with -m, the module) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to every process")
    return parser


def free_port_pair(host: str = "", attempts: int = 50) -> int:
    """A port P with P and P + 1 free (torch's MASTER_PORT and jmp's JAX coordinator), found by binding
    (on every interface by default: JAX's coordinator listens on all of them).

    The processes bind them seconds later, after their imports. Meanwhile the kernel hands ports of its
    ephemeral range to every outgoing connection (gloo's peers, in runs beside this one, open dozens), so a
    port it gave this probe (a bind to port 0) could be taken by then: the run then failed to start. P is drawn
    at random below that range instead, where only another server's explicit bind can take it."""
    below = _below_ephemeral_ports()
    draw = random.Random()
    for _ in range(attempts):
        if below is None:
            with socket.socket() as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
        else:
            port = draw.randrange(*below)
        if port >= 65535:
            continue
        with socket.socket() as first, socket.socket() as second:
            try:
                first.bind((host, port))
                second.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError(f"jmp.launch: found no two consecutive free ports on {host} in {attempts} attempts")


_FIRST_DRAWN_PORT = 20000  # above the ports servers are commonly configured on (8080, 5432, ...)


def _below_ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int] | None:
    """[start, stop) of the ports to draw from, below the kernel's ephemeral range (Linux: 20000-32766 by
    default), None where that range is not known or leaves fewer than 1000 ports below it."""
    try:
        low = int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (_FIRST_DRAWN_PORT, low - 1) if low - 1 - _FIRST_DRAWN_PORT >= 1000 else None


def child_environment(
    rank: int,
    world_size: int,
    port: int,
    cpu_devices: int | None = None,
    base: dict[str, str] | None = None,
    restart_count: int = 0,
    max_restarts: int = 0,
) -> dict[str, str]:
    """The environment of local process ``rank`` of ``world_size``: torchrun's variables on one node, in the
    ``restart_count``-th restart of at most ``max_restarts``."""
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
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }
    if cpu_devices is not None:
        flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={cpu_devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def visible_gpus(env: dict[str, str] | None = None) -> list[str]:
    """The GPUs the processes may use: ``CUDA_VISIBLE_DEVICES`` when set, else those ``nvidia-smi -L`` lists
    (none when ``JAX_PLATFORMS`` asks for the CPU)."""
    env = os.environ if env is None else env
    if env.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return []
    if "CUDA_VISIBLE_DEVICES" in env:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip() not in ("", "-1")]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]


def gpu_share(gpus: list[str], rank: int, world_size: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` of process ``rank``: its equal, consecutive share of ``gpus``."""
    share = len(gpus) // world_size
    return ",".join(gpus[rank * share : (rank + 1) * share])


def sagemaker_environment(
    env: dict[str, str], world_size: int, mp_parameters: str | None = None, smp_aliases: bool = True
) -> dict[str, str]:
    """``env`` with what SageMaker's launcher gives an SMP process: the modelparallel parameters, MPI enabled,
    and (``smp_aliases``) ``smdistributed`` importable as jmp."""
    env = dict(env)
    if mp_parameters is not None:
        env[MP_PARAMETERS] = mp_parameters
    if FRAMEWORK_PARAMS not in env:  # the keys SageMaker's PyTorch estimator sets for smdistributed + mpi
        env[FRAMEWORK_PARAMS] = json.dumps(
            {
                "sagemaker_mpi_enabled": True,
                "sagemaker_mpi_num_of_processes_per_host": world_size,
                "sagemaker_mpi_custom_mpi_options": "",
                "sagemaker_distributed_dataparallel_enabled": False,
            }
        )
    if smp_aliases:
        env["PYTHONPATH"] = os.pathsep.join([str(SMP_ALIAS_PATH), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _mp_parameters_argument(text: str | None, parser: argparse.ArgumentParser) -> str | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        parser.error(f"--mp-parameters is not valid JSON ({error}); give an object, e.g. '{{\"partitions\": 2}}'")
    if not isinstance(value, dict):
        parser.error(f"--mp-parameters must be a JSON object, e.g. '{{\"partitions\": 2}}', not {text}")
    return text


def pass_on_output(source: int, target: int) -> None:
    """Copy a child's output from the pipe ``source`` to ``target`` as it comes, less gloo's connection lines
    (a line that may be one is held until its end)."""
    pending, at_line_start = b"", True
    while chunk := os.read(source, 1 << 16):
        kept, data, pending = [], pending + chunk, b""
        for piece in re.findall(rb"[^\n]*\n|[^\n]+", data):
            complete = piece.endswith(b"\n")
            if at_line_start and not complete and (piece.startswith(_GLOO_PREFIX) or _GLOO_PREFIX.startswith(piece)):
                pending = piece
                break
            if not (at_line_start and _GLOO_LINE.match(piece)):
                kept.append(piece)
            at_line_start = complete
        _write_all(target, b"".join(kept))
    _write_all(target, pending)
    os.close(source)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _fileno(stream, default: int) -> int:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return default


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


def _is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): its state in /proc is T or t (Linux)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


@dataclass(frozen=True)
class _Failure:
    rank: int
    cause: str  # "was killed by SIGKILL (9)", "exited with code 3", "finished no step for 30 s"
    exit_code: int


class _Watchdog:
    """Hung steps: each process touches its progress file after every training step; one whose file has not
    moved for ``timeout`` seconds since its last step is hung. The first step (compiling) is not timed."""

    def __init__(self, timeout: float, world_size: int):
        self.timeout = timeout
        self.directory = Path(tempfile.mkdtemp(prefix="jmp-launch-progress-"))
        self.files = [self.directory / f"rank{rank}" for rank in range(world_size)]

    def restart(self) -> None:
        for file in self.files:
            file.write_bytes(b"")
            os.utime(file, (0, 0))  # no step yet

    def hung(self) -> list[int]:
        now = time.time()
        stepped = [file.stat().st_mtime for file in self.files]
        return [rank for rank, last in enumerate(stepped) if last > 0 and now - last > self.timeout]

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class _Startup:
    """Where each process's start-up got to: a process that fails while it connects to the others (JAX's
    coordinator, gloo's peers: both time out on a loaded machine) failed to start, not to train."""

    def __init__(self, world_size: int):
        self.directory = Path(tempfile.mkdtemp(prefix="jmp-launch-startup-"))
        self.files = [self.directory / f"rank{rank}" for rank in range(world_size)]

    def restart(self) -> None:
        for file in self.files:
            file.unlink(missing_ok=True)

    def failed_connecting(self, rank: int) -> bool:
        file = self.files[rank]
        return file.exists() and file.read_text() == "connecting"

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class _Children:
    """The launched processes; stops them all when one fails or the launcher is signalled."""

    def __init__(self):
        self.processes: list[subprocess.Popen] = []
        self.signalled: int | None = None
        self.forwarders: list[threading.Thread] = []

    def start(self, command: list[str], env: dict[str, str]) -> None:
        # each child in its own session: a terminal's Ctrl-C reaches the launcher only, which passes it on once
        process = subprocess.Popen(
            command,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.processes.append(process)
        for pipe, target in ((process.stdout, _fileno(sys.stdout, 1)), (process.stderr, _fileno(sys.stderr, 2))):
            thread = threading.Thread(target=pass_on_output, args=(os.dup(pipe.fileno()), target), daemon=True)
            pipe.close()
            thread.start()
            self.forwarders.append(thread)

    def drain(self, timeout: float = 5.0) -> None:
        """Wait until the children's last output is passed on (a grandchild holding a pipe open ends the wait)."""
        deadline = time.monotonic() + timeout
        for thread in self.forwarders:
            thread.join(max(0.0, deadline - time.monotonic()))

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
                with contextlib.suppress(ProcessLookupError):  # it exited between the poll and the signal
                    process.send_signal(signum)

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

    def reset(self) -> None:
        """Forget the stopped processes of a failed attempt (their last output passed on) before a restart."""
        self.drain()
        self.processes, self.forwarders = [], []

    def wait_for_failure(self, watchdog: _Watchdog | None = None) -> _Failure | None:
        """Wait until every child has exited 0 (None), one has failed or hung, or the launcher is signalled
        (None, ``signalled`` set)."""
        while self.signalled is None:
            codes = [p.poll() for p in self.processes]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                return _Failure(rank, _describe(code), 128 - code if code < 0 else code)
            if all(code == 0 for code in codes):
                return None
            hung = watchdog.hung() if watchdog is not None else []
            if hung:
                return self._hang(hung, watchdog.timeout)
            time.sleep(_POLL_SECONDS)
        return None

    def _hang(self, hung: list[int], timeout: float) -> _Failure:
        """Dump every running child's Python stack (jmp's processes answer SIGUSR1 with faulthandler) and name
        the hung ranks, and those stopped (SIGSTOP: they dump nothing until continued)."""
        stopped = [rank for rank, p in enumerate(self.processes) if _is_stopped(p.pid)]
        _say(
            f"rank(s) {', '.join(map(str, hung))} finished no step for {timeout:g} s (--step-timeout)"
            + (f"; rank(s) {', '.join(map(str, stopped))} stopped (SIGSTOP)" if stopped else "")
            + "; the processes' Python stacks follow"
        )
        self.send(signal.SIGUSR1)
        time.sleep(_STACK_DUMP_SECONDS)
        rank = stopped[0] if stopped else hung[0]
        cause = "is stopped (SIGSTOP)" if stopped else f"finished no step for {timeout:g} s"
        return _Failure(rank, cause, HUNG_EXIT_CODE)

    def end_signalled(self, grace: float) -> int:
        """After a signal passed on: wait ``grace`` seconds for the children, then kill the rest. 0 if every
        child exited 0 (it stopped cleanly, e.g. a preempted job that saved), else 128 + the signal."""
        name = signal.Signals(self.signalled).name
        print(f"jmp.launch: got {name}, passed it on to the processes", file=sys.stderr, flush=True)
        self.stop(grace, signum=None)  # they have the signal already
        clean = self.processes and all(p.returncode == 0 for p in self.processes)
        return 0 if clean else 128 + self.signalled


def _say(message: str) -> None:
    print(f"jmp.launch: {message}", file=sys.stderr, flush=True)


def _run(
    children: _Children,
    command: list[str],
    environments: Callable[[int, int], list[dict[str, str]]],
    max_restarts: int,
    grace: tuple[float, float],
    port: int | None,
    watchdog: _Watchdog | None = None,
    startup: _Startup | None = None,
) -> int:
    """Start the processes and restart them all after a failure, up to ``max_restarts`` times, and up to
    ``STARTUP_RETRIES`` more when a process failed while connecting; the exit code. ``grace``: the seconds stopped
    processes get before SIGKILL (after a failure, after a signal passed on)."""
    (grace, signal_grace), attempt, restarts, retries, lost = grace, 0, 0, 0, 0.0
    while True:
        started = time.monotonic()
        for tracker in (watchdog, startup):
            if tracker is not None:
                tracker.restart()
        for env in environments(attempt, port if port is not None else free_port_pair()):
            if children.signalled is None:
                children.start(command, env)
        failure = children.wait_for_failure(watchdog)
        if children.signalled is not None:
            return children.end_signalled(signal_grace)
        if failure is None:
            if attempt:
                _say(f"the run finished after {attempt} restart(s); {lost:.1f} s went to the failed attempts")
            return 0
        failed = children.processes[failure.rank]
        others = sum(p.poll() is None for p in children.processes if p is not failed)
        connecting = startup is not None and startup.failed_connecting(failure.rank)
        retrying = connecting and retries < STARTUP_RETRIES
        restarting = retrying or restarts < max_restarts
        _say(
            f"rank {failure.rank} (pid {failed.pid}) {failure.cause}"
            + (" while the processes connected (smp.init starting JAX's runtime)" if connecting else "")
            + f"; stopping {'it and ' if failed.poll() is None else ''}the {others} other running process(es)"
            + ("" if restarting or not max_restarts else f" (no restarts left: --max-restarts {max_restarts})")
        )
        if connecting and not retrying:
            _say(
                f"the processes failed to connect {retries + 1} times; on a loaded machine give them more time "
                "(JMP_INIT_TIMEOUT=600, in seconds) or start fewer (-n)"
            )
        failed_at = time.monotonic()
        children.stop(grace)
        if not restarting or children.signalled is not None:
            return failure.exit_code
        lost += time.monotonic() - started
        which = f"start-up retry {retries + 1} of {STARTUP_RETRIES}" if retrying else f"restart {restarts + 1} of"
        _say(
            f"{which}{'' if retrying else f' {max_restarts}'} (rank {failure.rank} {failure.cause}): starting the "
            f"{len(children.processes)} processes again on a fresh port; time lost: the failed attempt's "
            f"{failed_at - started:.1f} s and {time.monotonic() - failed_at:.1f} s stopping it"
        )
        children.reset()
        retries, restarts, attempt = retries + retrying, restarts + (not retrying), attempt + 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher with command-line arguments ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = _parser()
    options = parser.parse_args(argv)
    mp_parameters = _mp_parameters_argument(options.mp_parameters, parser)
    gpus = [] if options.cpu_devices is not None else visible_gpus()
    nproc = options.nproc if options.nproc is not None else len(gpus)
    if options.nproc is None and not gpus:
        parser.error("found no GPU: give the number of processes, -n N (each gets one emulated CPU device)")
    if nproc < 1:
        parser.error(f"-n must be at least 1, got {nproc}")
    if gpus and nproc > len(gpus):
        parser.error(f"-n {nproc} is more processes than the {len(gpus)} GPUs; use --cpu-devices K to run on the CPU")
    if options.cpu_devices is not None and options.cpu_devices < 1:
        parser.error(f"--cpu-devices must be at least 1, got {options.cpu_devices}")
    cpu_devices = None if gpus else (options.cpu_devices or 1)
    if options.max_restarts < 0:
        parser.error(f"--max-restarts must be at least 0, got {options.max_restarts}")
    if options.step_timeout is not None and options.step_timeout <= 0:
        parser.error(f"--step-timeout must be a positive number of seconds, got {options.step_timeout}")
    command = [sys.executable, *(["-m"] if options.module else []), options.target, *options.args]
    watchdog = _Watchdog(options.step_timeout, nproc) if options.step_timeout is not None else None
    startup = _Startup(nproc) if nproc > 1 else None

    def environments(attempt: int, port: int) -> list[dict[str, str]]:
        result = []
        for rank in range(nproc):
            env = child_environment(rank, nproc, port, cpu_devices, None, attempt, options.max_restarts)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpu_share(gpus, rank, nproc)
            if options.preemption_checkpoint_dir is not None:
                env[PREEMPTION_DIRECTORY] = str(Path(options.preemption_checkpoint_dir).absolute())
            if watchdog is not None:
                env[PROGRESS_FILE] = str(watchdog.files[rank])
            if startup is not None:
                env[STARTUP_FILE] = str(startup.files[rank])
            result.append(sagemaker_environment(env, nproc, mp_parameters, options.smp_aliases))
        return result

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.getsignal(s) for s in handled}
    children = _Children()
    try:
        for s in handled:  # before the first child starts, so a signal during the start reaches those started
            signal.signal(s, children.forward)
        grace = (options.grace, options.preemption_grace if options.preemption_checkpoint_dir else options.grace)
        return _run(children, command, environments, options.max_restarts, grace, options.port, watchdog, startup)
    finally:
        for s, handler in previous.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(s, handler)
        children.stop(0)  # after an unexpected error here too, no child outlives the launcher
        children.drain()
        for tracker in (watchdog, startup):
            if tracker is not None:
                tracker.close()


if __name__ == "__main__":
    sys.exit(main())
