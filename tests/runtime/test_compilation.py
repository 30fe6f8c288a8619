"""The persistent compilation cache (on by default, per user, switchable) and the compile-time log line."""

import contextlib
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.runtime import compilation_cache as compilation


@pytest.fixture
def restore_cache_settings():
    names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_persistent_cache_min_compile_time_secs")
    saved = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation.configure_cache()


def test_cache_directory_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(compilation.ENVIRONMENT, str(tmp_path / "mine"))
    assert compilation.cache_directory() == tmp_path / "mine"
    for off in ("0", "off", "OFF"):
        monkeypatch.setenv(compilation.ENVIRONMENT, off)
        assert compilation.cache_directory() is None
    monkeypatch.delenv(compilation.ENVIRONMENT)
    assert compilation.cache_directory(enabled=False) is None
    with _no_jax_cache_dir():
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        assert compilation.cache_directory() == tmp_path / "jmp" / "xla"
        monkeypatch.delenv("XDG_CACHE_HOME")
        assert compilation.cache_directory() == Path.home() / ".cache" / "jmp" / "xla"
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax's"))
        assert compilation.cache_directory() == tmp_path / "jax's"  # the user's own JAX setting wins


@contextlib.contextmanager
def _no_jax_cache_dir():
    saved = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", saved)


def test_config_key_turns_the_cache_off_and_on(restore_cache_settings, monkeypatch, tmp_path):
    monkeypatch.setenv(compilation.ENVIRONMENT, str(tmp_path))
    smp.init({"compilation_cache": False})
    assert not jax.config.jax_enable_compilation_cache
    smp.init({})
    assert jax.config.jax_enable_compilation_cache
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)


def test_a_program_compiled_once_is_loaded_from_the_cache(restore_cache_settings, monkeypatch, tmp_path, caplog):
    """What a second run of a script sees: the in-memory caches are empty, the directory is not."""
    monkeypatch.setenv(compilation.ENVIRONMENT, str(tmp_path))
    compilation.configure_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    def program(x):
        return jnp.tanh(x @ x.T).sum(axis=0) * 3.0

    x = jnp.arange(12.0).reshape(3, 4)
    with caplog.at_level(logging.INFO, logger="jmp"):
        with compilation.timed("program"):
            first = jax.jit(program)(x)
        assert any(p.is_file() for p in tmp_path.iterdir())
        jax.clear_caches()
        with compilation.timed("program"):
            second = jax.jit(program)(x)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("compiled program in "), messages
    assert messages[1].startswith("loaded from the compilation cache program in "), messages
    assert jnp.array_equal(first, second)


def test_a_step_logs_its_first_compilation_once(caplog):
    smp.init({})
    model = smp.DistributedModel(nn.Linear(4, 2))

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with caplog.at_level(logging.INFO, logger="jmp"):
        for _ in range(3):
            train_step(model, x, y)
    compiled = [r.getMessage() for r in caplog.records if "train_step in" in r.getMessage()]
    assert len(compiled) == 1, compiled
    assert "(tracing " in compiled[0] and "XLA " in compiled[0]
