"""A script written for SageMaker's SMP v1, run as is by ``python -m jmp.launch`` (``test_smp_launcher.py``).

``python -m jmp.launch -n 2 --mp-parameters '{"partitions": 1, "ddp": true}' tests/multiprocess/smp_script.py
MODE [hyperparameters...]``, MODE one of:

- ``smp``: import SMP's modules, ``smp.init()`` from the launcher's parameters, then print one JSON line per
  process of what SMP's names resolved to, ``smp.state``, and ``torch.distributed`` collectives on SMP's
  process groups (also after a second ``smp.init`` that pipelines over the two processes); then train one SGD
  step of a linear model on this process's batch of 4 rows (SMP: the batch size is per process) and print the
  loss and weights; then the same at tensor parallelism 2 (one process per tp rank) without and with
  ``prescaled_batch``, each process taking its rows as AWS's SMP v1 GPT-2 script does: by ``smp.dp_rank()`` of
  ``smp.dp_size()``, or with ``prescaled_batch`` by ``smp.rdp_rank()`` of ``smp.rdp_size()`` (a tp group reads one
  batch).
- ``find-spec``: print whether ``smdistributed`` can be found (no jmp imported).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys


def emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def collectives(smp, dist, torch) -> dict:
    """all_reduce / all_gather / broadcast / barrier on SMP's groups, of tensors that depend on the rank."""
    me = smp.rank()
    out = {}
    for name in ("world", "dp", "mp", "pp", "tp", "rdp"):
        group = getattr(smp, f"get_{name}_process_group")()
        value = torch.tensor([me + 1.0, 10.0 * (me + 1)])
        dist.all_reduce(value, group=group)
        gathered = [torch.zeros(1) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, torch.tensor([float(me)]), group=group)
        source = torch.tensor([float(me)])
        dist.broadcast(source, src=dist.get_global_rank(group, 0), group=group)
        dist.barrier(group=group)
        out[name] = {
            "sum": value.tolist(),
            "gathered": [t.item() for t in gathered],
            "broadcast": source.item(),
            "ranks": smp.get_dp_group() if name == "dp" else None,
        }
    out["lists"] = {name: getattr(smp, f"get_{name}_group")() for name in ("dp", "rdp", "mp", "pp", "tp")}
    return out


def one_sgd_step(smp, torch, share: int | None = None) -> dict:
    """One step on this process's 4 rows of the 8 rows every process generates alike: the ``share``-th 4 rows
    (default: ``smp.dp_rank()``'s)."""
    torch.manual_seed(0)
    data, target = torch.randn(8, 3), torch.randn(8, 2)
    share = smp.dp_rank() if share is None else share
    mine = slice(4 * share, 4 * share + 4)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)

    @smp.step
    def train_step(model, data, target):
        loss = torch.nn.functional.mse_loss(model(data), target)
        model.backward(loss)
        return loss

    optimizer.zero_grad()
    loss = train_step(model, data[mine], target[mine]).reduce_mean()
    optimizer.step()
    return {"loss": float(loss), "state": {k: v.tolist() for k, v in model.state_dict().items()}}


def smp_mode(hyperparameters: list[str]) -> None:
    import smdistributed.modelparallel
    import smdistributed.modelparallel.torch as smp
    import torch
    import torch.distributed as dist
    from smdistributed.modelparallel.torch.nn import FusedLayerNorm
    from transformers.utils.import_utils import is_sagemaker_mp_enabled

    import jmp

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    smp.init()  # the launcher's --mp-parameters, through SM_HP_MP_PARAMETERS
    me = smp.rank()
    report = {
        "rank": me,
        "smp_is_jmp": smp is jmp and FusedLayerNorm is jmp.nn.FusedLayerNorm,
        "version": smdistributed.modelparallel.__version__,
        "sagemaker_mp_enabled": is_sagemaker_mp_enabled(),
        "framework_params": json.loads(os.environ["SM_FRAMEWORK_PARAMS"]),
        "hyperparameters": hyperparameters,
        "cfg": {key: getattr(smp.state.cfg, key) for key in ("partitions", "microbatches", "ddp")},
        "state_ranks": [smp.state.rank, smp.state.dp_rank, smp.state.dp_size],
        "torch_ranks": [dist.get_rank(), dist.get_world_size(), smp.rank(), smp.size()],
        "data_parallel": collectives(smp, dist, torch),
    }
    smp.init({"pipeline_parallel_degree": 2})  # process i holds stage i: the pipeline group holds both
    report["pipelined"] = collectives(smp, dist, torch)
    smp.init({})
    report["step"] = one_sgd_step(smp, torch)
    for prescaled in (False, True):
        smp.init({"tensor_parallel_degree": 2, "prescaled_batch": prescaled})
        share, shares = (smp.rdp_rank(), smp.rdp_size()) if prescaled else (smp.dp_rank(), smp.dp_size())
        step = one_sgd_step(smp, torch, share) | {"share": [share, shares]}
        report["tp2_prescaled_step" if prescaled else "tp2_step"] = step
    emit(report)


def main(mode: str, *args: str) -> None:
    if mode == "find-spec":
        emit({"rank": int(os.environ["RANK"]), "found": importlib.util.find_spec("smdistributed") is not None})
    elif mode == "smp":
        smp_mode(list(args))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
