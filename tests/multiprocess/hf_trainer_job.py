"""A tiny Hugging Face ``Trainer`` job, run by ``test_hf_trainer.py`` twice: in plain PyTorch, and under
``python -m jmp.launch`` with SageMaker's model-parallel environment, where ``Trainer`` takes its SMP path
(``is_sagemaker_mp_enabled()``: ``smp.init()`` at import, ``smp.DistributedModel``, ``smp.DistributedOptimizer``, the
loss from ``@smp.step``'s ``smp_forward_backward``, ``smp.state.cfg``, ``smp.barrier``, ``smp.rank``).

``hf_trainer_job.py INITIAL_STATE OUT_DIR``: a 2-layer GPT-2 from its config, loaded with ``INITIAL_STATE``, trains 4
steps of 4 rows x 12 tokens (AdamW, weight decay, linear schedule, gradients clipped at 1), then prints one JSON
line (the logged losses, gradient norms and learning rates, the rows of each batch, what ``Trainer`` wrapped) and
saves the trained weights to ``OUT_DIR/final.pt``.

Two things of transformers' SMP path are adapted here, only when that path is taken (each fails the same way under
SageMaker's own SMP on a CPU-only torch, resp. with any SMP; neither is jmp's):

- ``TrainingArguments`` picks ``torch.device("cuda", smp.local_rank())`` and calls ``torch.cuda.set_device`` on
  it, whatever the host (SMP runs on GPUs only); a CPU build of torch raises ``AttributeError: module 'torch._C'
  has no attribute '_cuda_setDevice'``, and batches moved to ``cuda`` would raise next. ``use_cpu=True`` does not
  help: its branch comes first and the SMP branch then leaves ``device`` unset (``UnboundLocalError``). Here the
  device is the CPU when torch has no CUDA or JAX runs on the CPU (jmp's arrays are placed by JAX, not by torch's
  device).
- transformers 5.x delays the optimizer on the SMP path and creates it only for a model ``accelerate`` prepares,
  which a ``DistributedModel`` is not: ``self.optimizer`` stays None and ``create_scheduler`` fails in
  ``LambdaLR(None)`` (``'NoneType' object has no attribute 'param_groups'``). Here it is created as transformers
  4.x did, from the wrapped model, once ``_wrap_model`` has made it; ``create_optimizer`` then wraps it in
  ``smp.DistributedOptimizer`` itself.
"""

from __future__ import annotations

import json
import os
import sys
from functools import cached_property
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator
from transformers.utils.import_utils import is_sagemaker_mp_enabled

STEPS, ROWS, TOKENS, VOCAB = 4, 4, 12, 64
LOGGED = ("loss", "grad_norm", "learning_rate")


def model_config() -> GPT2Config:
    """No dropout: the two runs draw their masks from different generators (torch's, JAX's)."""
    dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, **dropout)


def dataset() -> list[dict]:
    """16 rows of random tokens. Each row's first label is -100: the plain path divides the summed loss by the
    labels that are not -100 (for a model whose ``loss_type`` it does not recognise, such as a GPT-2 made from its
    config, it counts position 0 too, which no prediction targets), the SMP path takes the model's own mean over
    the predicted tokens; with position 0 ignored the two counts are the same."""
    ids = torch.randint(0, VOCAB, (STEPS * ROWS, TOKENS), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, 0] = -100
    return [{"input_ids": row, "labels": label} for row, label in zip(ids, labels)]


class Arguments(TrainingArguments):
    @cached_property
    def _setup_devices(self) -> torch.device:
        on_cpu = not torch.cuda.is_available() or os.environ.get("JAX_PLATFORMS") == "cpu"  # --cpu-devices
        if not is_sagemaker_mp_enabled() or not on_cpu:
            return super()._setup_devices
        torch.cuda.set_device = lambda device: None  # what transformers' SMP branch calls (see the docstring)
        cuda = super()._setup_devices  # the rest of its set-up (no accelerate state on the SMP path)
        return torch.device("cpu") if cuda.type == "cuda" else cuda


class SmpTrainer(Trainer):
    def _wrap_model(self, model, training=True, dataloader=None):
        wrapped = super()._wrap_model(model, training, dataloader)
        if is_sagemaker_mp_enabled() and training and self.optimizer is None:
            self.create_optimizer(wrapped)  # see the docstring: transformers 5.x skips it for a DistributedModel
        return wrapped


def main(initial_state: str, out_dir: str) -> None:
    model = GPT2LMHeadModel(model_config())
    model.load_state_dict(torch.load(initial_state))
    batches = []

    def collate(rows: list[dict]) -> dict:
        batches.append([int(row["input_ids"].sum()) for row in rows])
        return default_data_collator(rows)

    args = Arguments(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=ROWS,
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    trainer = SmpTrainer(model=model, args=args, train_dataset=dataset(), data_collator=collate)
    trainer.train()
    wrapped, optimizer = trainer.model_wrapped, getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    report = {
        "sagemaker_mp_enabled": is_sagemaker_mp_enabled(),
        "log": [{k: h[k] for k in LOGGED} for h in trainer.state.log_history if "loss" in h],
        "batches": batches[:STEPS],
        "wrapped": type(wrapped).__module__ + "." + type(wrapped).__qualname__,
        "optimizer": type(optimizer).__module__ + "." + type(optimizer).__qualname__,
        "decayed_parameters": sum(len(g["params"]) for g in optimizer.param_groups if g["weight_decay"] > 0),
    }
    if is_sagemaker_mp_enabled():
        import smdistributed.modelparallel.torch as smp

        report["is_smp_distributed_model"] = isinstance(wrapped, smp.model.DistributedModel)
        report["is_smp_distributed_optimizer"] = isinstance(optimizer, smp.DistributedOptimizer)
        report["mesh"] = dict(smp.get_mesh().shape)
    torch.save({k: v.detach().clone() for k, v in wrapped.state_dict().items()}, Path(out_dir) / "final.pt")
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
