"""Generation loops on a wrapped causal LM, as people write them, give the tokens PyTorch gives on the same
weights: Hugging Face's ``model.generate(...)`` (greedy, with and without ``use_cache``) and a hand-written greedy
loop calling ``model(input_ids=ids)`` once per token under ``torch.no_grad()``.

Each forward is a forward-only program cached by its inputs' shapes: jmp generates without a key/value cache, so
N new tokens run N programs (one per sequence length) the first time and none when the lengths repeat.
"""

from __future__ import annotations

import copy

import pytest
import torch

import jmp as smp
from jmp.errors import StepError
from jmp.runtime import notices
from tests.sharding.models import VOCAB, causal_lm

pytest.importorskip("transformers")

NEW_TOKENS = 3


def _prompt(rows: int, length: int = 4) -> torch.Tensor:
    return torch.randint(2, VOCAB, (rows, length), generator=torch.Generator().manual_seed(3))  # no eos (id 1)


def _compiled(caplog) -> int:
    """Programs compiled (or loaded from the compilation cache) since the log was last cleared."""
    return sum("implicit_step in" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    "name, config, rows",
    [
        ("gpt2", {}, 2),  # 2 rows on 8 data-parallel devices: each computes the whole batch
        ("llama", {"tensor_parallel_degree": 2}, 4),  # 4 rows split over the 4 data-parallel shards
    ],
)
def test_generate_gives_pytorchs_tokens(name, config, rows, caplog, monkeypatch):
    caplog.set_level("INFO", logger="jmp")
    monkeypatch.setattr(notices, "_SAID", set())  # said once per job: as if this were the first generation
    smp.init(config)
    net = causal_lm(name).eval()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    model.eval()
    prompt = _prompt(rows)
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        caplog.clear()
        tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        compiled = _compiled(caplog)
        again = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=False)
    assert expected.shape == (rows, prompt.shape[1] + NEW_TOKENS)
    torch.testing.assert_close(tokens, expected, rtol=0, atol=0)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    assert compiled == NEW_TOKENS  # one per sequence length
    assert _compiled(caplog) == NEW_TOKENS  # the second generation reused them (with or without use_cache)
    assert caplog.text.count("runs without a key/value cache") == 1


def test_a_hand_written_greedy_loop_gives_pytorchs_tokens():
    smp.init({"sharded_data_parallel_degree": 4})
    net = causal_lm("gpt2").eval()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    model.eval()

    def greedy(lm, ids, steps=3):
        for _ in range(steps):
            logits = lm(input_ids=ids).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1)[:, None]], 1)
        return ids

    prompt = _prompt(8)
    with torch.no_grad():
        torch.testing.assert_close(greedy(model, prompt), greedy(reference, prompt), rtol=0, atol=0)


def test_a_cache_passed_to_the_model_is_refused_and_generate_is_the_modules():
    smp.init({})
    net = causal_lm("gpt2").eval()
    with torch.no_grad():
        cache = copy.deepcopy(net)(input_ids=_prompt(8)).past_key_values
    model = smp.DistributedModel(net)
    with torch.no_grad(), pytest.raises(StepError, match="use_cache=False"):
        model(input_ids=_prompt(8, 1), past_key_values=cache)
    with pytest.raises(StepError, match="input_ids"):
        model.generate(_prompt(8, 1), past_key_values=cache, max_new_tokens=1)
    assert model.generate.__doc__ == net.generate.__doc__
    assert not hasattr(smp.DistributedModel(torch.nn.Linear(4, 4)), "generate")


def test_a_batch_that_microbatches_cannot_split_says_how_to_pad_it():
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(causal_lm("gpt2").eval())
    with torch.no_grad(), pytest.raises(StepError, match="Pad the batch to 16 rows"):
        model(input_ids=_prompt(1))
