"""The seed document's recipe for several processes (``test_training.py``): ``smp.init()`` from the launcher's
``SM_HP_MP_PARAMETERS``, each process's share of the data chosen by ``smp.dp_rank()`` of ``smp.dp_size()`` (an
equal contiguous part), batches of 64 with ``drop_last``, the model of ``tests/front_end/test_seed_recipe.py``
trained by Adadelta at lr 4.0. Prints one JSON line per process: its ranks and losses."""

import json

import torch

import jmp as smp
from tests.front_end.test_seed_recipe import Digits, train_step

ROWS = 256  # 2 steps of 64 per process with 2 processes


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(ROWS, 1, 16, 16, generator=generator)
    return torch.utils.data.TensorDataset(images, torch.randint(0, 10, (ROWS,), generator=generator))


def main() -> None:
    smp.init()
    data = dataset()
    if smp.dp_size() > 1:
        part = len(data) // smp.dp_size()
        data = torch.utils.data.Subset(data, range(smp.dp_rank() * part, (smp.dp_rank() + 1) * part))
    torch.manual_seed(0)
    model = smp.DistributedModel(Digits())
    optimizer = smp.DistributedOptimizer(torch.optim.Adadelta(model.parameters(), lr=4.0))
    losses = []
    for images, labels in torch.utils.data.DataLoader(data, batch_size=64, drop_last=True):
        optimizer.zero_grad()
        _, loss_mb = train_step(model, images, labels)
        losses.append(float(loss_mb.reduce_mean()))
        optimizer.step()
    print(json.dumps({"rank": smp.rank(), "dp": [smp.dp_rank(), smp.dp_size()], "losses": losses}), flush=True)


if __name__ == "__main__":
    main()
