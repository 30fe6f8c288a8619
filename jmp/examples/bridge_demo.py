"""Convert the seed's GroupedNet to Flax NNX, check it against PyTorch, train it in JAX and export it back."""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F
from flax import nnx

import jmp
from jmp.examples.data import digits
from jmp.examples.models import GroupedNet


def nll(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


@nnx.jit
def train_step(module, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: nll(m(x), y))(module)
    optimizer.update(module, grads)
    return loss


def check_parity(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(max |output difference|, max relative gradient difference) in eval mode."""
    model.eval()
    converted = jmp.torch_bridge.convert(model)
    x, y = jnp.asarray(images.numpy()), jnp.asarray(labels.numpy())
    out_diff = float(jnp.max(jnp.abs(converted(x) - model(images).detach().numpy())))
    model.zero_grad()
    F.nll_loss(model(images), labels).backward()
    grads = nnx.grad(lambda m: nll(m(x), y))(converted)
    graphdef, _, rest = nnx.split(converted, nnx.Param, ...)
    named = dict(jmp.torch_bridge.named_variables(nnx.merge(graphdef, grads, rest)))
    grad_diff = max(
        float(np.max(np.abs(np.asarray(named[n][...]) - p.grad.numpy())) / np.max(np.abs(p.grad.numpy())))
        for n, p in model.named_parameters()
    )
    return out_diff, grad_diff


def lock_step(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, steps: int = 5):
    """Losses of ``steps`` plain SGD steps taken by torch and by the converted model."""
    model.eval()
    converted = jmp.torch_bridge.convert(model)
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.05)
    optimizer = nnx.Optimizer(converted, optax.sgd(0.05), wrt=nnx.Param)
    pairs = []
    for step in range(steps):
        batch = slice(step * 32, (step + 1) * 32)
        torch_opt.zero_grad()
        torch_loss = F.nll_loss(model(images[batch]), labels[batch])
        torch_loss.backward()
        torch_opt.step()
        x, y = jnp.asarray(images[batch].numpy()), jnp.asarray(labels[batch].numpy())
        jax_loss = train_step(converted, optimizer, x, y)
        pairs.append((float(torch_loss), float(jax_loss)))
    return pairs


def train(converted, train_images, train_labels, epochs: int, batch_size: int = 64) -> None:
    converted.train()
    optimizer = nnx.Optimizer(converted, optax.adadelta(learning_rate=4.0, rho=0.9, eps=1e-6), wrt=nnx.Param)
    x_all, y_all = jnp.asarray(train_images.numpy()), jnp.asarray(train_labels.numpy())
    steps = len(y_all) // batch_size  # drop_last=True, as the seed script asks
    for epoch in range(1, epochs + 1):
        order = np.random.default_rng(epoch).permutation(len(y_all))
        total, start = 0.0, time.perf_counter()
        for i in range(steps):
            idx = order[i * batch_size : (i + 1) * batch_size]
            total += float(train_step(converted, optimizer, x_all[idx], y_all[idx]))
            _progress(epoch, epochs, i + 1, steps, total / (i + 1))
        print(f"  ({time.perf_counter() - start:.1f}s)")


def _progress(epoch, epochs, done, steps, loss):
    if done != steps and not sys.stdout.isatty():
        return  # in a log, one line per epoch
    filled = int(20 * done / steps)
    sys.stdout.write(f"\r  epoch {epoch}/{epochs} [{'#' * filled}{'.' * (20 - filled)}] {done}/{steps} loss {loss:.4f}")
    sys.stdout.flush()


def accuracy_jax(converted, images, labels) -> float:
    converted.eval()
    predictions = jnp.argmax(nnx.jit(lambda m, x: m(x))(converted, jnp.asarray(images.numpy())), axis=1)
    return float(jnp.mean(predictions == jnp.asarray(labels.numpy())))


def accuracy_torch(model, images, labels) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(images).argmax(1) == labels).float().mean())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train_images, train_labels, test_images, test_labels = digits()
    print(f"jmp {jmp.__version__}: JAX {jax.__version__} on {jax.device_count()} {jax.default_backend()} device(s)")
    print(f"data: {len(train_labels)} train / {len(test_labels)} held-out digits (28x28, bundled with scikit-learn)")

    # A random batch: digit images have flat backgrounds whose max-pool ties are broken by
    # 1-ulp differences between the two convolution implementations, which moves gradients.
    out_diff, grad_diff = check_parity(GroupedNet(), torch.randn(64, 1, 28, 28), train_labels[:64])
    print(
        f"1. parity with PyTorch on a random batch: max |output diff| {out_diff:.2e}, "
        f"max relative gradient diff {grad_diff:.2e}"
    )

    print("2. five SGD steps in lock-step (torch loss / JAX loss):")
    for i, (torch_loss, jax_loss) in enumerate(lock_step(GroupedNet(), train_images, train_labels), 1):
        print(f"   step {i}: {torch_loss:.6f} / {jax_loss:.6f}")

    print(f"3. training GroupedNet in JAX (Adadelta lr=4.0, batch 64, dropout on) for {args.epochs} epochs:")
    model = GroupedNet()
    converted = jmp.torch_bridge.convert(model)
    train(converted, train_images, train_labels, args.epochs)
    jax_accuracy = accuracy_jax(converted, test_images, test_labels)
    print(f"   held-out accuracy (JAX): {jax_accuracy:.2%}")

    model.load_state_dict(jmp.torch_bridge.to_state_dict(converted), strict=True)
    torch_accuracy = accuracy_torch(model, test_images, test_labels)
    print(f"4. weights exported back to PyTorch: held-out accuracy (torch) {torch_accuracy:.2%}")


if __name__ == "__main__":
    main()
