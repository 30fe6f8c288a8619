"""In a multi-process run an uncaught error ends the process at once, with its traceback, from the moment JAX's
runtime is up: also while torch.distributed starts (its store's port taken), and after torch.distributed's own
excepthook (which buffers what the hook it wraps prints) was installed; and a process that ends well ends without
Python's garbage collections over every object left."""

from __future__ import annotations

import contextlib
import gc
import io
import sys
import traceback

import pytest

from jmp.runtime import mesh_state


class _Exited(Exception):
    pass


def _print_traceback(kind, value, traceback_) -> None:
    """Python's own hook, printing to the sys.stderr of the moment."""
    traceback.print_exception(kind, value, traceback_)


@pytest.fixture
def hooks(monkeypatch):
    """sys.excepthook as a fresh process has it, os._exit recorded (it raises _Exited)."""
    exits: list[int] = []

    def record_exit(code: int) -> None:
        exits.append(code)
        raise _Exited

    monkeypatch.setattr(sys, "excepthook", _print_traceback)
    monkeypatch.setattr(mesh_state.os, "_exit", record_exit)
    return exits


def _torch_distributed_style_hook() -> None:
    """What torch.distributed.init_process_group installs: the wrapped hook's output buffered, then written."""
    wrapped = sys.excepthook

    def _distributed_excepthook(*args):
        real, sys.stderr = sys.stderr, io.StringIO()
        try:
            wrapped(*args)
        finally:
            buffered, sys.stderr = sys.stderr.getvalue(), real
        sys.stderr.write("".join(f"[rank0]: {line}\n" for line in buffered.splitlines()))

    sys.excepthook = _distributed_excepthook


def _uncaught(message: str) -> str:
    """What the hooks print for an uncaught RuntimeError(message), which must end the process."""
    with contextlib.redirect_stderr(io.StringIO()) as stderr, pytest.raises(_Exited):
        try:
            raise RuntimeError(message)
        except RuntimeError as error:
            sys.excepthook(type(error), error, error.__traceback__)
    return stderr.getvalue()


def test_an_error_while_torch_distributed_starts_ends_the_process(hooks):
    mesh_state._exit_on_uncaught()  # JAX's runtime is up
    printed = _uncaught("The server socket has failed to listen on any local network address (EADDRINUSE)")
    assert hooks == [1] and "RuntimeError: The server socket has failed to listen" in printed


def test_after_torch_distributeds_hook_the_outer_hook_exits_once_its_traceback_written(hooks):
    mesh_state._exit_on_uncaught()
    _torch_distributed_style_hook()
    mesh_state._exit_on_uncaught()  # after process_groups.start: outside torch.distributed's
    printed = _uncaught("a step failed")
    assert hooks == [1] and "[rank0]: RuntimeError: a step failed" in printed  # written out before the exit
    mesh_state._exit_on_uncaught()  # outermost already: no third hook
    assert "[rank0]: RuntimeError: again" in _uncaught("again") and hooks == [1, 1]


def test_a_multi_process_run_freezes_the_garbage_collector_at_exit_once(monkeypatch):
    """Python's full collections over torch's and JAX's objects at finalization took 2-3 s of each launched
    process's end (0.3 s frozen); registered once however often smp.init runs."""
    registered = []
    monkeypatch.setattr(mesh_state, "_exits_without_collecting", False)
    monkeypatch.setattr(mesh_state.atexit, "register", registered.append)
    mesh_state._exit_without_collecting()
    mesh_state._exit_without_collecting()
    assert registered == [gc.freeze]
