"""The model and batch of replica_gradients_script.py, for the test's PyTorch reference too."""

import torch
import torch.nn.functional as F

ROWS = 16


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.norm = torch.nn.LayerNorm(4 * 10 * 10)
        self.fc = torch.nn.Linear(4 * 10 * 10, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))  # one stacked weight
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = self.fc(self.norm(torch.flatten(F.relu(self.conv(x)), 1)))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return F.log_softmax(self.head(x), dim=1)


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 1, 12, 12, generator=generator), torch.randint(0, 10, (ROWS,), generator=generator)


FP8_ROWS, FP8_FACTORS = 32, (1.0, 8.0, 0.25)  # the fp8 Linear's batch, and its scale at each step


def fp8_linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(32, 16)


def fp8_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and output gradients whose rows grow 100x down the batch: each process's amaxes differ from the
    batch's (a sum over processes of their gradient amaxes would not be their maximum)."""
    generator = torch.Generator().manual_seed(5)
    magnitudes = torch.logspace(-1, 1, FP8_ROWS).reshape(FP8_ROWS, 1)
    x = torch.randn(FP8_ROWS, 32, generator=generator) * magnitudes
    return x, torch.randn(FP8_ROWS, 16, generator=generator) * magnitudes * 1e-3
