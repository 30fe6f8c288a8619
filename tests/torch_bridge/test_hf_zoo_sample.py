"""A sample of the Hugging Face zoo sweep (``benchmarks/hf_zoo.py``), always on: architectures no other test
names, each built from its shrunk default config, with jmp's loss and every gradient under ``jit`` equal to
PyTorch's. Each one exercises a construct the sweep found: Mamba takes torch's ``associative_scan`` (the
bridge reports compiling), DeepSeek-V3 attends with values narrower than its queries and routes over experts,
FNet mixes tokens with ``torch.fft.fftn``, XLM checks its inputs with ``assert lengths.max().item() <= slen``
(a value check on the step's data under ``jit``), T5Gemma2 builds its masks with ``torch.vmap``, LongT5's stack
makes its default attention mask only when not compiling (torch.compile's fallback to eager, per module)."""

import pytest

pytest.importorskip("transformers")

from benchmarks.hf_zoo_models import RTOL, check  # noqa: E402

SAMPLE = [
    "causal_lm/deepseek_v3",
    "causal_lm/mamba",
    "masked_lm/fnet",
    "masked_lm/xlm",
    "token_classification/t5gemma2",
    "seq2seq/longt5",
]


@pytest.mark.parametrize("key", SAMPLE)
def test_architecture_matches_pytorch(key):
    result = check(*key.split("/"))
    assert result["status"] == "pass", result
    assert result["loss_rel_error"] <= RTOL and result["max_grad_rel_error"] <= RTOL
