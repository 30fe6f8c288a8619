"""The ``torch.sagemaker`` modules SMP v2 scripts import at module level: ``grad_norm.clip_grad_norm_(model, ...)``,
``delayed_param.DelayedParamIniter``, ``checkpoint.utils.limit_num_subdirs``, ``utils.utils.timeit``, ``logger``."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import jmp
import jmp.tsm as tsm
from jmp.errors import ConfigError
from jmp.tsm.checkpoint.utils import SORT_BY_LAST_INT, limit_num_subdirs
from jmp.tsm.delayed_param import DelayedParamIniter, initer_of
from jmp.tsm.grad_norm import clip_grad_norm_
from jmp.tsm.logger import get_logger
from jmp.tsm.utils.utils import timeit

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def test_clip_grad_norm_takes_the_model_and_clips_as_torch_does():
    tsm.init({"hybrid_shard_degree": 8})
    torch.manual_seed(0)
    reference = _mlp()
    model = jmp.DistributedModel(copy.deepcopy(reference))
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    F.mse_loss(model(x), y).backward()
    F.mse_loss(reference(x), y).backward()
    norm = clip_grad_norm_(model, 0.05)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    assert float(expected) > 0.05  # the gradients are clipped
    assert "%.4f" % norm == "%.4f" % expected  # noqa: UP031 (the scripts' logging formats it so)
    torch.testing.assert_close(torch.as_tensor(float(norm)), expected, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(torch.as_tensor(p.grad), q.grad, rtol=1e-5, atol=1e-7, msg=name)
    plain = _mlp()  # a module jmp does not hold: torch's own clipping
    twin = copy.deepcopy(plain)
    F.mse_loss(plain(x), y).backward()
    F.mse_loss(twin(x), y).backward()
    torch.testing.assert_close(clip_grad_norm_(plain, 0.05), torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05))


def _llama_config():
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )


def test_delayed_param_initer_lets_jmp_initialise_an_init_empty_weights_model_in_its_shards():
    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 4})
    built = transformers.AutoModelForCausalLM.from_config(_llama_config())
    with accelerate.init_empty_weights():  # parameters on the meta device, buffers (rotary frequencies) with values
        model = transformers.AutoModelForCausalLM.from_config(_llama_config())
    initer = DelayedParamIniter(model)
    assert initer_of(initer.get_param_init_fn()) is initer and initer_of(lambda m: None) is None
    with initer.validate_params_and_buffers_inited():
        wrapped = jmp.DistributedModel(model)
    module = wrapped.module
    torch.testing.assert_close(module.model.rotary_emb.inv_freq, built.model.rotary_emb.inv_freq)
    weight = module.model.layers[0].self_attn.q_proj.weight
    # Llama's initializer_range is 0.02
    assert torch.isfinite(weight).all() and 0.005 < float(weight.detach().std()) < 0.05


def test_delayed_param_initers_functions_initialise_module_by_module_on_the_cpu():
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(_llama_config())
    initer = DelayedParamIniter(model)
    with pytest.raises(ConfigError, match="still on the meta device"):
        with initer.validate_params_and_buffers_inited():
            pass  # nothing initialised it
    initialise = initer.get_param_init_fn()
    with initer.validate_params_and_buffers_inited():
        for module in model.modules():
            initialise(module)
        initer.get_post_param_init_fn()(model)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    norm = model.model.layers[1].input_layernorm.weight
    torch.testing.assert_close(norm, torch.ones_like(norm))  # Llama's _init_weights sets RMSNorm weights to 1
    assert 0.005 < float(model.lm_head.weight.detach().std()) < 0.05


def test_limit_num_subdirs_keeps_the_newest_n_by_the_last_integer(tmp_path):
    for name in ("llama-10steps", "llama-2steps", "llama-30steps", "llama-4steps", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "llama-1steps.txt").write_text("a file, not a checkpoint")
    removed = limit_num_subdirs(tmp_path, 2, sort_fn=SORT_BY_LAST_INT, regex=r"^.*\d+steps$", log=False)
    assert sorted(removed) == ["llama-2steps", "llama-4steps"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-10steps", "llama-1steps.txt", "llama-30steps", "other"]


def test_timeit_logs_on_rank_0_through_the_logger_scripts_get(caplog, capsys, monkeypatch):
    caplog.set_level(logging.INFO, logger="jmp")
    with timeit(True, "Model creation", 0):
        pass
    with timeit(True, "FSDP constructor", 1):
        pass
    assert "Model creation took" in caplog.text and "FSDP constructor" not in caplog.text
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a script that configured no logging: it prints
    get_logger().info("Batch 0 Loss: 1.25")
    assert "[INFO] [jmp] Batch 0 Loss: 1.25" in capsys.readouterr().err


def test_the_rng_state_tracker_keeps_tes_bookkeeping_and_changes_no_random_number():
    from jmp.errors import JmpError

    tracker = tsm.state.get_rng_state_tracker()
    assert tracker is tsm.state.get_rng_state_tracker()  # one per process, as TE's
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    with pytest.raises(JmpError, match="already exists"):
        tracker.add("model-parallel-rng", 1)
    saved = tracker.get_states()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork():
        assert torch.equal(torch.rand(3), expected)
    with pytest.raises(JmpError, match="never added"):
        with tracker.fork("other"):
            pass
    tracker.reset()
    tracker.set_states(saved)
    assert tracker.get_states() == {"model-parallel-rng": 1234}
    tracker.reset()
