"""A pipeline in bf16 or fp16 is cut as in float32: the same stages, each holding the parameters of its own modules,
and it trains as PyTorch does.

Mixed precision casts the float32 master parameters to the half dtype at the top of the step's forward. The cut took
those casts for the first stage's glue: stage 0 read every parameter and sent the cast copies down the pipeline, so
it held every byte and the other stages none (a Llama at pp2 in fp16: 361,728 / 0 bytes against float32's
180,736 / 180,992), while the losses still matched. Each cast is now made where its value is read. A cut that would
leave a stage holding no parameters and running no module is an error.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.errors import PipelineError
from tests.sharding.models import causal_lm, token_batches

PRECISIONS = {"float32": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True}}
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# one rounding of bf16 (2^-9) / fp16 (2^-12) on the losses, as tests/precision/test_transformers.py
TOLERANCE = {"float32": 2e-5, "bf16": 2e-3, "fp16": 5e-4}
STEPS, LR, INIT_SCALE = 2, 3e-3, 2.0**10
VOCAB = 64


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Tower(nn.Module):
    """A small language model of our own: embedding, four blocks, a norm and a head tied to the embedding."""

    def __init__(self, width: int = 32, depth: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tower() -> nn.Module:
    torch.manual_seed(0)
    return Tower()


def tower_loss(module, ids):
    """Each next token from the ones before (random tokens: the loss stays near log(VOCAB))."""
    return F.cross_entropy(module(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())


def hf_loss(module, ids):
    return module(input_ids=ids, labels=ids, use_cache=False).loss


@smp.step
def tower_step(model, ids):
    loss = tower_loss(model, ids)
    model.backward(loss)
    return loss


@smp.step
def hf_step(model, ids):
    loss = hf_loss(model, ids)
    model.backward(loss)
    return loss


MODELS = {  # name: (build, step, torch loss, the layers in order, the modules after them)
    "tower": (tower, tower_step, tower_loss, "blocks", ("norm", "head")),
    "llama": (lambda: causal_lm("llama", layers=4), hf_step, hf_loss, "model.layers", ("model.norm", "lm_head")),
    "gpt2": (lambda: causal_lm("gpt2", layers=4), hf_step, hf_loss, "transformer.h", ("transformer.ln_f", "lm_head")),
}


def _init(pp: int, how: str, precision: str) -> None:
    """``how``: "auto" or "manual", and "-sdp2" for stages split over sharded data parallelism."""
    config = {"pipeline_parallel_degree": pp, "microbatches": pp, "ddp": True, **PRECISIONS[precision]}
    if how.startswith("manual"):
        config |= {"auto_partition": False, "default_partition": 0}
    if how.endswith("-sdp2"):
        config["sharded_data_parallel_degree"] = 2
    smp.init(config)


def _placed(model, name: str, pp: int, how: str):
    """By hand: the layers in ``pp`` equal runs, the embedding on the first stage, the head on the last."""
    if how.startswith("manual"):
        _, _, _, layers, last = MODELS[name]
        blocks = list(model.module.get_submodule(layers))
        for i, block in enumerate(blocks):
            smp.set_partition(block, i * pp // len(blocks))
        for path in last:
            smp.set_partition(model.module.get_submodule(path), pp - 1)
    return model


def _cut_of(model, caplog) -> tuple[str, list[int], dict]:
    (logged,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Partition assignments")]
    layout = model.pipeline.layout
    return logged, layout.stage_bytes(), dict(layout.stages)


def cut(name: str, pp: int, how: str, precision: str, caplog) -> tuple[str, list[int], dict]:
    """The partition log, each stage's parameter bytes and each parameter's stages, from tracing the first step."""
    build, step, *_ = MODELS[name]
    _init(pp, how, precision)
    model = _placed(smp.DistributedModel(build()), name, pp, how)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jmp"):
        step.trace(model, token_batches(1, seed=2)[0] % VOCAB)
    return _cut_of(model, caplog)


def trained(name: str, pp: int, how: str, precision: str, caplog) -> tuple[list[float], tuple]:
    """``STEPS`` AdamW steps on one batch: the losses, and the cut as ``cut`` gives it."""
    build, step, *_ = MODELS[name]
    _init(pp, how, precision)
    model = _placed(smp.DistributedModel(build()), name, pp, how)
    scaling = {}
    if precision == "fp16":
        scaling = dict(static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": INIT_SCALE})
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.module.parameters(), lr=LR), **scaling)
    ids = token_batches(1, seed=2)[0] % VOCAB
    losses = []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jmp"):
        for _ in range(STEPS):
            optimizer.zero_grad()
            losses.append(float(step(model, ids).reduce_mean()))
            optimizer.step()
            assert not optimizer.overflow
    return losses, _cut_of(model, caplog)


def torch_losses(name: str, precision: str) -> list[float]:
    """PyTorch on CPU: float32, or float32 parameters under autocast (a GradScaler for fp16)."""
    build, _, loss_of, *_ = MODELS[name]
    module = build()
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, enabled=precision == "fp16")
    ids = token_batches(1, seed=2)[0] % VOCAB
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=HALF.get(precision, torch.bfloat16), enabled=precision in HALF):
            loss = loss_of(module, ids)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(float(loss.detach()))
    return losses


LAYOUTS = [(2, "auto"), (2, "manual"), (4, "auto"), (4, "manual")]


@pytest.mark.parametrize(("pp", "how"), LAYOUTS, ids=[f"pp{pp}-{how}" for pp, how in LAYOUTS])
def test_bf16_and_fp16_cut_our_model_exactly_as_float32(pp, how, caplog):
    """The same log, the same stages for every parameter, the same bytes on each, none empty."""
    logged, sizes, stages = cut("tower", pp, how, "float32", caplog)
    assert len(sizes) == pp and min(sizes) > 0, logged
    assert stages["embed.weight"] == (0, pp - 1)  # tied to the head: held by both ends
    for precision in ("bf16", "fp16"):
        assert cut("tower", pp, how, precision, caplog) == (logged, sizes, stages), precision


CASES = [  # (model, pp, precision, partition); the suite runs the first, the slow tier the rest (tests/conftest.py)
    ("llama", 2, "bf16", "auto"),
    ("llama", 4, "bf16", "auto"),
    ("llama", 4, "fp16", "manual"),
    ("gpt2", 2, "fp16", "manual"),
    ("gpt2", 4, "bf16", "auto"),
    ("tower", 2, "fp16", "manual"),
    ("tower", 4, "bf16", "auto"),
    ("tower", 2, "float32", "auto"),
    ("llama", 4, "float32", "manual"),
    ("llama", 4, "bf16", "auto-sdp2"),
    ("gpt2", 2, "fp16", "manual-sdp2"),
]


@pytest.mark.parametrize(("name", "pp", "precision", "how"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_a_pipeline_in_each_precision_trains_as_pytorch_on_float32s_cut(name, pp, precision, how, caplog):
    losses, half_cut = trained(name, pp, how, precision, caplog)
    float32_cut = cut(name, pp, how, "float32", caplog)
    assert half_cut == float32_cut
    assert min(half_cut[1]) > 0, half_cut[0]
    np.testing.assert_allclose(losses, torch_losses(name, precision), rtol=TOLERANCE[precision])
    if precision in HALF:
        np.testing.assert_allclose(losses, torch_losses(name, "float32"), rtol=TOLERANCE[precision])


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.body = nn.Linear(16, 16)

    def forward(self, x):
        return F.log_softmax(self.body(self.stem(x)), dim=1)


@smp.step
def nll_step(model, data, target):
    loss = F.nll_loss(model(data), target)
    model.backward(loss)
    return loss


def test_a_stage_left_with_only_the_glue_between_modules_is_an_error():
    """The root on stage 1 but both its layers on stage 0: stage 1 would run only the root's log_softmax."""
    _init(2, "manual", "bf16")
    model = smp.DistributedModel(Root())
    smp.set_partition(model.module, 1)
    smp.set_partition(model.module.stem, 0)
    smp.set_partition(model.module.body, 0)
    with pytest.raises(PipelineError, match=r"stage\(s\) \[1\] of 2 would hold no parameters and run no module"):
        nll_step.trace(model, torch.randn(8, 16), torch.randint(0, 16, (8,)))


@smp.step
def glue_first_step(model, data, target):
    data = torch.tanh(data @ data.transpose(0, 1) @ data)  # 4 rows x 16 x rows FLOPs: 4x a layer's at 32 rows
    loss = F.nll_loss(model(data), target)
    model.backward(loss)
    return loss


def test_the_automatic_cut_keeps_the_glue_before_the_model_with_its_first_module():
    """Heavy code before the model's call was a segment of its own, and balancing FLOPs alone made it stage 0,
    holding nothing; now it goes with the first layer."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "memory_weight": 0.0})
    model = smp.DistributedModel(Root())
    glue_first_step.trace(model, torch.randn(64, 16), torch.randint(0, 16, (64,)))
    stages = model.pipeline.layout.stages
    assert stages["stem.weight"] == (0,) and stages["body.weight"] == (1,)
