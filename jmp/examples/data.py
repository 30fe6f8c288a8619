"""The embedded default dataset: scikit-learn's bundled handwritten digits, shaped like MNIST.

1,797 8x8 grey images ship inside scikit-learn, so nothing is downloaded. They
are upsampled to 28x28 and normalised with MNIST's mean and deviation, so the
seed scripts' MNIST models run on them unchanged.
"""

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
