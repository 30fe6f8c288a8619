"""A small training run that saves and resumes: GPT-2 with dropout, AdamW, a step LR schedule.

Shared by the in-process tests and by the processes the crash tests start and kill. Everything that
decides the next loss is either in the checkpoint (parameters, optimizer state, loss scale, random stream)
or in ``user_content`` (the schedule, the data position), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import torch

import jmp as smp

VOCAB = 128
FSDP_TP = {"sharded_data_parallel_degree": 4, "tensor_parallel_degree": 2}


def gpt2(dropout: float = 0.1, layers: int = 2) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32, n_layer=layers, n_head=4, n_positions=32, vocab_size=VOCAB, bos_token_id=0, eos_token_id=1,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).train()


def mlp(dropout: float = 0.1) -> torch.nn.Module:
    """A plain-torch model for the tests that start processes (no transformers import, a quick compile)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(dropout),
        torch.nn.Linear(64, VOCAB),
    )  # fmt: skip


def batch(step: int) -> torch.Tensor:
    """The data at position ``step`` (a stand-in for a data loader that resumes where it was)."""
    return torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(1000 + step))


@smp.step
def train_step(model, ids):
    if isinstance(model.torch_module, torch.nn.Sequential):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    else:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    model.backward(loss)
    return loss


class Run:
    """A model, its optimizer and LR scheduler under ``config``; ``step`` is the data position."""

    def __init__(
        self, config: dict, dropout: float = 0.1, layers: int = 2, optimizer_args: dict | None = None, kind="gpt2"
    ):
        smp.init(config)
        self.model = smp.DistributedModel(gpt2(dropout, layers) if kind == "gpt2" else mlp(dropout))
        self.optimizer = smp.DistributedOptimizer(
            torch.optim.AdamW(self.model.parameters(), lr=3e-3), **(optimizer_args or {})
        )
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.step = 0

    def train(self, until: int) -> list[float]:
        losses = []
        while self.step < until:
            self.optimizer.zero_grad()
            losses.append(float(train_step(self.model, batch(self.step)).reduce_mean()))
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
        return losses

    def save(self, path, partial: bool = True, **kwargs) -> None:
        content = {"scheduler": self.scheduler.state_dict(), "step": self.step}
        smp.save_checkpoint(
            path, f"step{self.step}", partial=partial, model=self.model, optimizer=self.optimizer,
            user_content=content, **kwargs,
        )  # fmt: skip

    def resume(self, path, **kwargs) -> None:
        content = smp.resume_from_checkpoint(path, **kwargs)
        self.scheduler.load_state_dict(content["scheduler"])
        self.step = content["step"]
