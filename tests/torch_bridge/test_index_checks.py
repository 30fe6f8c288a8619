"""Out-of-range indices raise PyTorch's IndexError with the module path, instead of a nan or zero loss.

An embedding id past the table and a class target past the classes (``ignore_index`` and ``padding_idx``
kept) are checked inside the compiled step and raised when the step's values are read; with concrete values
(the converter alone) at once.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.torch_bridge import convert


class Tagger(nn.Module):
    """Token ids -> one of 3 classes: ``nn.Embedding(10, 4)`` (row 0 the padding) and a Linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4, padding_idx=0)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


@smp.step
def train_step(model, ids, labels):
    loss = F.cross_entropy(model(ids), labels, reduction="sum")  # summed over microbatches: torch's whatever the split
    model.backward(loss)
    return loss


def _batch(bad_id: bool = False, bad_label: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (16, 5), generator=generator)
    ids[3, 1] = 0  # the padding row
    labels = torch.randint(0, 3, (16,), generator=generator)
    labels[5] = -100  # ignored
    if bad_id:
        ids[9, 2] = 12
    if bad_label:
        labels[2] = 7
    return ids, labels


CONFIGS = {
    "dp8": {},
    "sdp8": {"sharded_data_parallel_degree": 8},
    "tp2-microbatches": {"tensor_parallel_degree": 2, "microbatches": 2},
    "pipeline": {"pipeline_parallel_degree": 2, "microbatches": 2},
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_out_of_range_ids_and_labels_raise_torchs_index_error_in_a_step(config):
    smp.init(config)
    torch.manual_seed(0)
    with smp.tensor_parallelism(config.get("tensor_parallel_degree", 1) > 1):
        net = Tagger()
    ids, labels = _batch()
    expected = F.cross_entropy(net(ids), labels, reduction="sum")
    model = smp.DistributedModel(net)

    loss = train_step(model, ids, labels).reduce_sum()  # in range, a padding id and an ignored label
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)

    out = train_step(model, *_batch(bad_id=True))
    with pytest.raises(IndexError, match=re.escape("index out of range in self (in module 'embed' (Embedding)")):
        out.reduce_mean()

    out = train_step(model, *_batch(bad_label=True))
    with pytest.raises(IndexError, match=r"^Target 7 is out of bounds\. \(at .*: loss = F.cross_entropy"):
        out.reduce_mean()


_COLLECTIVE = re.compile(r"= ([^\n]*)\b(?:all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)\(")


def test_checks_add_no_collective_to_a_step_on_a_split_batch():
    """Each device's rows are checked where they are: a maximum over the whole batch is one more all-reduce (of
    the checks' int32 indices), which XLA:CPU ran beside a layer scan's collectives and hung (GPT-2 at tp2 x fsdp4)."""
    smp.init({"sharded_data_parallel_degree": 8})
    model = smp.DistributedModel(Tagger())
    text = train_step.lower(model, *_batch()).compile().as_text()
    carried = [found.group(1) for found in _COLLECTIVE.finditer(text)]  # the values each collective carries
    assert carried and not [values for values in carried if "s32" in values]  # the gradients' only
    with pytest.raises(IndexError, match=r"Target 7 is out of bounds"):  # and the checks still see every row
        train_step(model, *_batch(bad_label=True)).reduce_mean()


def test_an_unread_bad_step_raises_at_the_models_next_step_call():
    smp.init({})
    model = smp.DistributedModel(Tagger())
    out = train_step(model, *_batch(bad_label=True))
    out._stacked.block_until_ready()  # the step has run: its check is ready without a wait
    other = smp.DistributedModel(Tagger())
    train_step(other, *_batch())  # another model's step: not this one's error
    with pytest.raises(IndexError, match=r"Target 7 is out of bounds\..*in the data of an earlier step call"):
        train_step(model, *_batch())
    train_step(model, *_batch()).reduce_mean()  # reported once; good data trains on


class Functional(nn.Module):
    """``F.embedding`` and ``F.nll_loss`` with an ``ignore_index`` of its own, inside a custom module."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 3))

    def forward(self, ids, labels):
        return F.nll_loss(F.log_softmax(F.embedding(ids, self.table), -1), labels, ignore_index=9)


def test_functional_calls_raise_at_once_on_concrete_values():
    net = Functional()
    converted = convert(net)
    ids, labels = torch.tensor([1, 2, 3]), torch.tensor([0, 9, 2])
    expected = net(ids, labels).detach()
    assert float(converted(jnp.asarray(ids.numpy()), jnp.asarray(labels.numpy()))) == pytest.approx(float(expected))
    with pytest.raises(IndexError, match=re.escape("index out of range in self (in module '<root>' (Functional)")):
        converted(jnp.asarray([1, 10, 3]), jnp.asarray(labels.numpy()))
    with pytest.raises(IndexError, match=re.escape("Target -1 is out of bounds.")):
        converted(jnp.asarray(ids.numpy()), jnp.asarray([0, -1, 2]))


def test_a_plain_loop_raises_when_the_loss_is_read():
    smp.init({})
    model = smp.DistributedModel(Tagger())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch, error in [(_batch(), None), (_batch(bad_id=True), "index out of range in self")]:
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if error is None:
            assert loss.item() > 0
        else:
            with pytest.raises(IndexError, match=re.escape(f"{error} (in module 'embed' (Embedding)")):
                loss.item()


class Picker(nn.Module):
    """Rows and entries picked by the data: ``index_select``, ``gather``, advanced indexing, ``one_hot``."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 4))

    def forward(self, selected, gathered, indexed, classes):
        rows = self.table.index_select(0, selected)
        entries = torch.gather(rows, 1, gathered)
        return rows.sum() + entries.sum() + (self.table[indexed] * F.one_hot(classes, 4).float()).sum()


@smp.step
def picker_step(model, *indices):
    loss = model(*indices)
    model.backward(loss)
    return loss


def _picks(**bad) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    picks = {
        "selected": torch.randint(0, 6, (16,), generator=generator),
        "gathered": torch.randint(0, 4, (16, 2), generator=generator),
        "indexed": torch.randint(-6, 6, (16,), generator=generator),
        "classes": torch.randint(0, 4, (16,), generator=generator),
    }
    for name, (position, value) in bad.items():
        picks[name][position] = value
    return list(picks.values())


@pytest.mark.parametrize(
    "config",
    [{}, {"sharded_data_parallel_degree": 8}, CONFIGS["tp2-microbatches"]],
    ids=["dp8", "sdp8", "tp2-microbatches"],
)
def test_index_select_gather_indexing_and_one_hot_raise_as_torch(config):
    smp.init(config)
    torch.manual_seed(0)
    net = Picker()
    expected = net(*_picks()).detach()
    model = smp.DistributedModel(net)
    torch.testing.assert_close(picker_step(model, *_picks()).reduce_sum(), expected, rtol=1e-5, atol=1e-5)
    for bad in [
        {"selected": (3, 6)},
        {"gathered": ((2, 1), 4)},
        {"indexed": (1, -7)},
        {"classes": (0, 4)},
        {"classes": (0, -1)},
    ]:
        with pytest.raises(Exception) as torch_error:
            net(*_picks(**bad))
        out = picker_step(model, *_picks(**bad))
        with pytest.raises(
            torch_error.type, match="^" + re.escape(f"{torch_error.value} (in module '<root>' (Picker)")
        ):
            out.reduce_sum()


class TwoPickers(nn.Module):
    """Two ``Picker``s, one a pipeline stage each."""

    def __init__(self):
        super().__init__()
        self.first, self.second = Picker(), Picker()

    def forward(self, *indices):
        return self.first(*indices) + self.second(*indices)


def test_index_select_gather_indexing_and_one_hot_raise_as_torch_in_a_pipeline():
    smp.init(CONFIGS["pipeline"])
    torch.manual_seed(0)
    net = TwoPickers()
    expected = net(*_picks()).detach()
    model = smp.DistributedModel(net)
    torch.testing.assert_close(picker_step(model, *_picks()).reduce_sum(), expected, rtol=1e-5, atol=1e-5)
    for bad in [{"selected": (3, 6)}, {"gathered": ((2, 1), 4)}, {"indexed": (1, -7)}, {"classes": (0, 4)}]:
        with pytest.raises(Exception) as torch_error:
            net(*_picks(**bad))
        out = picker_step(model, *_picks(**bad))
        where = r" \(in module '(first|second)' \(Picker\)"
        with pytest.raises(torch_error.type, match="^" + re.escape(str(torch_error.value)) + where):
            out.reduce_sum()


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.rows = nn.Parameter(torch.randn(6, 4))

    def forward(self, h, index):
        return torch.tanh(self.linear(h) + self.rows[index])


class Layers(nn.Module):
    """Identical layers indexing by the data (one scan), and indexing inside ``torch.func.vmap`` / ``torch.cond``
    bodies, whose values cannot leave them: those indices go unchecked, the step runs."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, h, index):
        for layer in self.layers:
            h = layer(h, index)
        rows = self.layers[0].rows
        mapped = torch.func.vmap(lambda i: rows[i])(index).sum()
        branched = torch.cond(index.sum() > 0, lambda i: rows[i].sum(), lambda i: rows[i].mean(), (index,))
        return h.sum() + mapped + branched


def test_checks_in_a_layer_scan_and_in_transformed_bodies(caplog):
    caplog.set_level("INFO", logger="jmp")
    smp.init({})
    net = Layers()
    h, index = torch.randn(16, 4), torch.randint(0, 6, (16,))
    expected = net(h, index).detach()
    model = smp.DistributedModel(net)
    torch.testing.assert_close(picker_step(model, h, index).reduce_sum(), expected, rtol=1e-5, atol=1e-5)
    assert "its 3 layers run as one scan" in caplog.text  # a check's maximum sown again is harmless
    index[2] = 6
    out = picker_step(model, h, index)
    with pytest.raises(IndexError, match=re.escape("index 6 is out of bounds for dimension 0 with size 6 (in mod")):
        out.reduce_sum()


class Misfit(nn.Module):
    """A ``Linear(16, 2)``, a ``Conv2d(3, 4, 3)`` and a ``matmul``, each fed the wrong size by ``kind``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(16, 2)
        self.mix = nn.Parameter(torch.randn(16, 2))

    def forward(self, x):
        if self.kind == "linear":
            return self.head(x.flatten(1)[:, :8]).sum()
        if self.kind == "conv":
            return self.conv(x[:, :, :, :5].reshape(2, 5, 8, 3)).sum()
        return torch.matmul(x.flatten(1)[:, :8], self.mix).sum()


@pytest.mark.parametrize(
    "kind, where",
    [("linear", "in module 'head' (Linear)"), ("conv", "in module 'conv' (Conv2d)"), ("matmul", "<root>' (Misfit)")],
)
def test_shape_errors_read_as_torchs_with_the_module(kind, where):
    smp.init({})
    net = Misfit(kind)
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(RuntimeError) as torch_error:
        net(x)
    model = smp.DistributedModel(net)
    with pytest.raises(RuntimeError, match="^" + re.escape(str(torch_error.value)) + r" \(.*" + re.escape(where)):
        picker_step(model, x)


class Selecting(nn.Module):
    """Keeps rows with ``nonzero`` (a data-dependent size): its step runs op by op, its checks are still read."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        h = self.embed(ids).mean(1)
        keep = torch.nonzero(h[:, 0] > -100).squeeze(1)
        return self.head(h[keep]), keep


@smp.step
def selecting_step(model, ids, labels):
    logits, keep = model(ids)
    loss = F.cross_entropy(logits, labels[keep])
    model.backward(loss)
    return loss


def test_a_step_run_op_by_op_raises_when_its_values_are_read():
    smp.init({})
    net = Selecting()
    ids, labels = _batch()
    labels[5] = 1
    expected = F.cross_entropy(net(ids)[0], labels).detach()
    model = smp.DistributedModel(net)
    torch.testing.assert_close(selecting_step(model, ids, labels).reduce_mean(), expected, rtol=1e-5, atol=1e-6)
    for bad, message in [({"bad_id": True}, "index out of range in self"), ({"bad_label": True}, "Target 7 is")]:
        bad_ids, bad_labels = _batch(**bad)
        bad_labels[5] = 1
        out = selecting_step(model, bad_ids, bad_labels)  # no host sync per checked op: raised at the read
        with pytest.raises(IndexError, match=re.escape(message)):
            out.reduce_mean()
