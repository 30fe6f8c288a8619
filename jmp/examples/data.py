"""The embedded default dataset: scikit-learn's 8x8 digits upsampled to 28x28 and normalised as MNIST (no download)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_images, train_labels, test_images, test_labels); images [N, 1, 28, 28] float32."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32) / 16.0)[:, None]
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    images = (images - MNIST_MEAN) / MNIST_STD
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    n_test = int(len(labels) * test_fraction)
    return images[n_test:], labels[n_test:], images[:n_test], labels[:n_test]


class ProcessShare(torch.utils.data.Sampler):
    """Batches of ``batch_size`` row indices: process ``rank``'s block of each global batch (times ``processes``).

    The global batches are drawn as one process would draw them (a permutation from ``seed`` per epoch, or in
    order); the incomplete last one is dropped.
    """

    def __init__(self, rows: int, batch_size: int, rank: int, processes: int, shuffle: bool, seed: int = 0):
        self.rows, self.batch_size, self.rank, self.processes, self.shuffle = rows, batch_size, rank, processes, shuffle
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.rows // (self.batch_size * self.processes)

    def __iter__(self):
        order = torch.randperm(self.rows, generator=self.generator) if self.shuffle else torch.arange(self.rows)
        whole = self.batch_size * self.processes
        for start in range(0, len(self) * whole, whole):
            first = start + self.rank * self.batch_size
            yield order[first : first + self.batch_size].tolist()
