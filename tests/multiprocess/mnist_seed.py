# The seed's auto-partition MNIST example (001_3002168262ba1b43.txt) for several processes: as
# tests/front_end/seed_scripts/auto_partition.py, with the seed's data-parallel sharding kept
# (torchnet's SplitDataset, which gives each rank an equal contiguous part, written with torch's Subset).
# Prints one JSON line per process: its ranks and losses.
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import jmp as smp

ROWS = 256  # synthetic digits: 2 steps of 64 per process with 2 processes


class GroupedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(x, 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


def train(model, device, train_loader, optimizer):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):  # noqa: B007 (as the seed writes it)
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        _, loss_mb = train_step(model, data, target)
        loss = loss_mb.reduce_mean()
        optimizer.step()
        losses.append(float(loss))


def dataset():
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(ROWS, 1, 28, 28, generator=generator), torch.randint(0, 10, (ROWS,), generator=generator)
    )


losses = []
if __name__ == "__main__":
    smp.init()
    device = torch.device("cpu")
    data = dataset()
    # smdistributed: Shard the dataset based on data-parallel ranks
    if smp.dp_size() > 1:
        part = len(data) // smp.dp_size()
        data = torch.utils.data.Subset(data, range(smp.dp_rank() * part, (smp.dp_rank() + 1) * part))
    train_loader = torch.utils.data.DataLoader(data, batch_size=64, drop_last=True)
    torch.manual_seed(0)
    model = GroupedNet()
    optimizer = optim.Adadelta(model.parameters(), lr=4.0)
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)
    train(model, device, train_loader, optimizer)
    print(json.dumps({"rank": smp.rank(), "dp": [smp.dp_rank(), smp.dp_size()], "losses": losses}), flush=True)
