# The seed's manual-partition example (001_3002168262ba1b43.txt), changed only in its import line
# (jmp for smdistributed), the removal of its CUDA device calls, and the dataset (synthetic tensors
# instead of torchvision's MNIST, so no torchnet/torchvision imports either). The configuration SageMaker
# would pass through the estimator is given to smp.init: two pipeline stages, manual partitioning.
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import jmp as smp


class GroupedNet(nn.Module):
    def __init__(self):
        super().__init__()
        with smp.partition(0):
            # define child modules on device 0
            self.conv1 = nn.Conv2d(1, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
        with smp.partition(1):
            # define child modules on device 1
            self.fc1 = nn.Linear(9216, 128)
            self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        # define forward pass and return model outputs
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(x, 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


# smdistributed: Define smp.step. Return any tensors needed outside.
@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


def train(model, device, train_loader, optimizer):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        # smdistributed: Move input tensors to the GPU ID used by the current process,
        # based on the set_device call.
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        # Return value, loss_mb is a StepOutput object
        _, loss_mb = train_step(model, data, target)
        # smdistributed: Average the loss across microbatches.
        loss = loss_mb.reduce_mean()
        optimizer.step()
        losses.append(float(loss))


losses = []
# smdistributed: initialize the backend
smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0})
device = torch.device("cpu")
generator = torch.Generator().manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(192, 1, 28, 28, generator=generator),
                                         torch.randint(0, 10, (192,), generator=generator))
# smdistributed: Shard the dataset based on data-parallel ranks
if smp.dp_size() > 1:
    raise AssertionError("one process loads the whole batch")
# smdistributed: Set drop_last=True to ensure that batch size is always divisible
# by the number of microbatches
train_loader = torch.utils.data.DataLoader(dataset, batch_size=64, drop_last=True)
model = GroupedNet()
optimizer = optim.Adadelta(model.parameters(), lr=4.0)
# smdistributed: Use the DistributedModel container to provide the model
# to be partitioned across different ranks. For the rest of the script,
# the returned DistributedModel object should be used in place of
# the model provided for DistributedModel class instantiation.
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(optimizer)
train(model, device, train_loader, optimizer)
