"""A process killed (SIGKILL) in the middle of ``save_checkpoint`` loses nothing that was saved before:
``newest`` still names the last complete checkpoint, and a fresh process resumed from it trains to the same
losses, bit for bit, as the killed process did before the save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _child(path: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.saving.crash_child", str(path), mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )


def _losses(result: subprocess.CompletedProcess) -> dict:
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no losses printed (exit {result.returncode}):\n{result.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("moment", ["kill-writing", "kill-finalising"])
def test_sigkill_inside_save_checkpoint(tmp_path, moment):
    killed = _child(tmp_path, moment)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    before_kill = _losses(killed)
    assert (tmp_path / "newest").read_text() == "step3"
    # killed while writing: no step6 checkpoint is visible; killed after Orbax committed it: it is complete
    assert (tmp_path / "step6_partial").exists() == (moment == "kill-finalising")
    resumed = _child(tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(resumed) == before_kill  # from step 3, bitwise


def test_a_process_that_exits_right_after_saving_completes_the_checkpoint(tmp_path):
    """``save_checkpoint`` returns before the files are written; the interpreter's exit waits for them."""
    saved = _child(tmp_path, "save-and-exit")
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert (tmp_path / "newest").read_text() == "step3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newest", "step3_partial"]
