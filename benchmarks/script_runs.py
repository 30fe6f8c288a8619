"""What the runners of AWS's example scripts share (``smp_examples`` for SMP v1, ``smp_v2_examples`` for v2; the
scripts come from a checkout given by path, ``aws_scripts/checkout.py``): a script's arguments, its launch under
``jmp.launch`` and the first error in its log, a reference run in a process of its own, and the tolerance of a
logged loss by precision."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900

_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$')
_RANKED = re.compile(r"^\[rank(\d+)\]: ")  # torch's @record (on a script's main) prints each rank's error so
_FIRST_FAILED = re.compile(r"^jmp\.launch: rank (\d+) \(pid \d+\) exited", re.MULTILINE)
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|heartbeat", re.IGNORECASE)


def with_args(base: list[str], **overrides) -> list[str]:
    """``base`` with ``--key value`` pairs replaced or added."""
    out = list(base)
    for key, value in overrides.items():
        flag = f"--{key}"
        if flag in out:
            out[out.index(flag) + 1] = str(value)
        else:
            out += [flag, str(value)]
    return out


def arg_value(args: list[str], key: str) -> str | None:
    """The value given to ``--key`` in ``args``, or None."""
    flag = f"--{key}"
    return args[args.index(flag) + 1] if flag in args else None


def tolerance(args: list[str]) -> tuple[float, str]:
    """The relative tolerance of a configuration's logged losses, and its precision (the runners' docstrings
    derive each figure)."""
    if arg_value(args, "fp8") == "1":
        return 2e-2, "fp8"
    if arg_value(args, "fp16") == "1":
        return 2.5e-4, "fp16"
    if arg_value(args, "bf16") == "1":
        return 2e-3, "bf16"
    return 1e-4, "fp32"


def launch(command: list[str], work: Path, env: dict[str, str], timeout_s: int) -> tuple[str, int | str, float]:
    """Run ``command`` in ``work``: its output (stdout then stderr), return code (or "timeout") and seconds."""
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout_s)
        log, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        code = "timeout"
    return log, code, round(time.monotonic() - start, 1)


def first_error(log: str, scripts: Path, interleaved: re.Pattern) -> dict | None:
    """The first traceback in ``log``: exception type and message, innermost frame, and the last frame in a
    script under ``scripts`` (the checkout's folder, which names such frames). Each process's traceback may
    interleave with the others' (lines ``interleaved`` matches are stepped over); where torch's ``@record`` prefixes
    each rank's lines (``[rank2]: ...``), one rank's is read: the lowest whose error is not a peer gone from a
    collective (the consequence of another rank's failure), else the one the launcher says failed first."""
    ranked = [(int(m.group(1)), line[m.end() :]) for line in log.splitlines() if (m := _RANKED.match(line))]
    failed = sorted({rank for rank, text in ranked if text.startswith("Traceback")})
    if failed:
        own = [r for r in failed if not any(_PEER_GONE.search(text) for rank, text in ranked if rank == r)]
        first = _FIRST_FAILED.search(log)
        rank = own[0] if own else int(first.group(1)) if first and int(first.group(1)) in failed else failed[0]
        log = "\n".join(text for r, text in ranked if r == rank)
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last):"):
            continue
        frames, j = [], i + 1
        while j < len(lines) and (lines[j][:1] in (" ", "\t", "") or interleaved.match(lines[j])):
            match = _FRAME.match(lines[j])
            if match:
                frames.append((match.group(1), int(match.group(2)), match.group(3)))
            j += 1
        if j >= len(lines):
            continue
        kind, _, message = lines[j].partition(":")
        script = [f for f in frames if str(scripts) in f[0]]
        where = lambda f: f"{short_path(f[0], scripts)}:{f[1]} in {f[2]}" if f else None
        return {
            "type": kind.strip(),
            "message": message.strip()[:600],
            "raised_at": where(frames[-1] if frames else None),
            "script_frame": where(script[-1] if script else None),
        }
    return None


def short_path(path: str, scripts: Path | None = None) -> str:
    """``path`` from site-packages, the scripts' folder or the repository root."""
    for marker in ("site-packages/", *([str(scripts) + "/"] if scripts else []), str(ROOT) + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def reference_in_own_process(module: str, arguments: list[str], env_for) -> dict:
    """``python -m module --reference ...arguments`` in a fresh process (no jmp imported there), run in a temporary
    folder's environment ``env_for(folder)``; the JSON its last line prints."""
    with tempfile.TemporaryDirectory(prefix="smp-ref-") as tmp:
        done = subprocess.run(
            [sys.executable, "-m", module, "--reference", *arguments],
            cwd=ROOT, env=env_for(Path(tmp)), capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"reference {arguments} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def status_line(name: str, record: dict) -> str:
    """One line per configuration: ran or the first error, the losses, the comparison."""
    error = record["first_error"] or {}
    where = error.get("script_frame") or error.get("raised_at")
    failure = f" {error.get('type')}: {error.get('message', '')[:200]} at {where}" if error else ""
    status = "ran" if record["ran"] else "FAILED"
    return f"{name}: {status}{failure} | losses {record['losses']} | {record['comparison']}"


def jmp_tree() -> dict:
    """The commit the results were measured on, and whether jmp/ had uncommitted changes."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "jmp"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"commit": head, "jmp_uncommitted_changes": bool(dirty.strip())}
