"""GPT-2 trained by every process of a multi-process run, each feeding its share of the batch.

``PYTHONPATH=. python -m jmp.launch -n 2 --cpu-devices 4 tests/multiprocess/train_gpt2.py LAYOUT OUT_DIR``:
each process prints one JSON line (its ranks, the losses and a step output's rows); process 0 saves the gathered
``state_dict()`` to OUT_DIR/state_dict.pt, and all save a partial checkpoint in OUT_DIR/checkpoints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import jmp as smp
from tests.sharding.models import causal_lm, token_batches

STEPS = 3


@smp.step
def train_step(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    model.backward(out.loss)
    return out.loss, out.logits


def train(layout: dict) -> tuple[smp.DistributedModel, list[float], list[torch.Tensor]]:
    """(model, this process's losses, each step's logits of this process's rows); the optimizer is the model's."""
    smp.init(layout)
    model = smp.DistributedModel(causal_lm("gpt2"))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    losses, logits_per_step = [], []
    for ids in token_batches(STEPS):
        share = ids.chunk(smp.dp_size())[smp.dp_rank()]  # what this process's data loader yields
        optimizer.zero_grad()
        loss, logits = train_step(model, share)
        optimizer.step()
        losses.append(float(loss.reduce_mean()))
        logits_per_step.append(logits.concat())
    return model, losses, logits_per_step


def main(layout_json: str, out_dir: str) -> None:
    model, losses, logits_per_step = train(json.loads(layout_json))
    logits = logits_per_step[-1]
    state_dict = model.state_dict()
    local = model.local_state_dict()
    local_moments = model.attached_optimizer.local_state_dict()["state"]
    try:
        model.load_state_dict(local)
        refused = ""
    except smp.StateDictError as error:  # pieces of a multi-process run: not a state to load
        refused = str(error)
    report = {
        "local_load_refused": refused,
        "numel": sum(t.numel() for t in state_dict.values()),
        "local_numel": sum(t.numel() for k, t in local.items() if k != "_smp_is_partial"),
        "local_moment_numel": sum(s["exp_avg"].numel() for s in local_moments.values()),
        "rank": smp.rank(),
        "size": smp.size(),
        "dp": [smp.dp_rank(), smp.dp_size()],
        "losses": losses,
        "logits_shape": list(logits.shape),
        "logits_sum": float(logits.float().sum()),
    }
    print(json.dumps(report), flush=True)
    if smp.rank() == 0:
        torch.save(state_dict, Path(out_dir) / "state_dict.pt")
    smp.save_checkpoint(Path(out_dir) / "checkpoints", "step3", model=model, optimizer=model.attached_optimizer)


if __name__ == "__main__":
    main(*sys.argv[1:])
