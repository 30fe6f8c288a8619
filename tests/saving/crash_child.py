"""A training process for the crash tests: ``python -m tests.saving.crash_child DIR MODE``.

MODE ``kill-writing`` / ``kill-finalising``: train 3 steps, save ``step3`` and wait for it, train to step 6,
print the losses of steps 3-5 (the uninterrupted run), then save ``step6`` and die by SIGKILL inside that
save: while Orbax writes the arrays, or once the checkpoint is complete but before ``newest`` names it.
MODE ``resume``: resume from DIR's newest checkpoint, train to step 6, print the losses.
MODE ``save-and-exit``: train 3 steps, save ``step3`` and exit at once (the write finishes before the exit).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import orbax.checkpoint as ocp  # noqa: E402

import jmp as smp  # noqa: E402
from tests.saving.run import FSDP_TP, Run  # noqa: E402


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_while_writing_arrays() -> None:
    serialize = ocp.type_handlers.ArrayHandler.serialize

    async def serialize_then_die(self, *args, **kwargs):
        futures = await serialize(self, *args, **kwargs)
        time.sleep(0.05)  # some of the arrays reach the disk
        _die()
        return futures

    ocp.type_handlers.ArrayHandler.serialize = serialize_then_die


def _kill_before_newest_moves() -> None:
    smp.saving.directory.point_newest = lambda *args: _die()


def main(path: str, mode: str) -> None:
    run = Run(FSDP_TP, kind="mlp")
    if mode == "resume":
        run.resume(path)
        print(json.dumps({"step": run.step, "losses": run.train(6)}), flush=True)
        return
    run.train(3)
    run.save(path)
    if mode == "save-and-exit":
        return
    smp.saving.wait_for_saves()
    print(json.dumps({"step": 3, "losses": run.train(6)}), flush=True)
    {"kill-writing": _kill_while_writing_arrays, "kill-finalising": _kill_before_newest_moves}[mode]()
    run.save(path)
    smp.saving.wait_for_saves()
    raise SystemExit("the save was not interrupted")


if __name__ == "__main__":
    main(*sys.argv[1:])
