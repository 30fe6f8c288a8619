"""Steps that need concrete values: op by op with compiled segments, wholly op by op, and PyTorch eager.

    python -m benchmarks.op_by_op [--steps 5] [--out benchmarks/results/op_by_op.json]

Hugging Face's BART and DeBERTa-v2 sequence classifiers (small configs, random weights, no dropout) cannot be
traced whole: BART's head counts end-of-sequence tokens with ``unique_consecutive``, DeBERTa-v2's loss keeps the
labelled rows with ``nonzero``. jmp runs their steps outside ``jit`` (``jmp.compiled_step.uncompiled``), the module
calls that trace as compiled segments (``jmp.compiled_step.segments``) or, with ``JMP_COMPILED_SEGMENTS=0``,
every op on its own. Per model, from the same weights and batches on 8 CPU devices (data parallel, 2
microbatches), one ``@smp.step`` + AdamW update per step: the sides' steps interleaved, the median seconds, the
first step's (compiles), the first step's loss against PyTorch's, and which modules ran as segments.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time

from benchmarks.harness import emulate_devices, machine, time_interleaved, write_results

emulate_devices(8)

import torch  # noqa: E402
import transformers  # noqa: E402

import jmp as smp  # noqa: E402
from jmp.compiled_step import segments, uncompiled  # noqa: E402

BATCH, LENGTH, VOCAB = 16, 32, 512
CONFIGS = {
    "bart": transformers.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, classifier_dropout=0.0, num_labels=3,
    ),
    "deberta-v2": transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    ),
}  # fmt: skip


@smp.step
def train_step(model, input_ids, labels):
    out = model(input_ids=input_ids, labels=labels)
    model.backward(out.loss)
    return out.loss


def batch(config: transformers.PretrainedConfig) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)
    ids[:, -1] = config.eos_token_id if config.eos_token_id is not None else 2  # one end token per row (BART)
    labels = torch.randint(0, 3, (BATCH,), generator=generator)
    return ids, labels


@contextlib.contextmanager
def segments_enabled(on: bool):
    previous = os.environ.get(segments.ENVIRONMENT)
    os.environ[segments.ENVIRONMENT] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(segments.ENVIRONMENT, None)
        else:
            os.environ[segments.ENVIRONMENT] = previous


def jmp_run(base: torch.nn.Module, ids, labels, with_segments: bool):
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(copy.deepcopy(base))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    def run():
        with segments_enabled(with_segments):
            optimizer.zero_grad()
            loss = train_step(model, ids, labels).reduce_mean()
            optimizer.step()
        return loss

    return model, run


def torch_run(base: torch.nn.Module, ids, labels):
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run():
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return run


def programs_segments(model) -> dict:
    found = [p for p, _ in model.programs if isinstance(p, uncompiled.UncompiledProgram)]
    if not found:
        return {"op_by_op_program": False}
    held = found[0].segments
    return {"op_by_op_program": True, "segments": sorted(held.compiled_paths), "op_by_op": held.op_by_op}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/op_by_op.json")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        base = transformers.AutoModelForSequenceClassification.from_config(config).train()
        ids, labels = batch(config)
        models, runs, first = {}, {}, {}
        for side, with_segments in (("segments", True), ("op_by_op", False)):
            models[side], runs[side] = jmp_run(base, ids, labels, with_segments)
        runs["torch_eager"] = torch_run(base, ids, labels)
        for side, run in runs.items():  # the first step (compiling) apart
            start = time.perf_counter()
            first[side] = (float(run()), time.perf_counter() - start)
        samples = time_interleaved(runs, args.steps, warmup=1)
        medians = {side: statistics.median(times) for side, times in samples.items()}
        rows[name] = {
            "median_step_s": medians,
            "first_step_s": {side: seconds for side, (_, seconds) in first.items()},
            "first_loss": {side: loss for side, (loss, _) in first.items()},
            "segments_over_op_by_op": medians["segments"] / medians["op_by_op"],
            "segments_over_torch_eager": medians["segments"] / medians["torch_eager"],
            **programs_segments(models["segments"]),
        }
        print(
            f"{name}: step segments {medians['segments']:.3f} s, op by op {medians['op_by_op']:.3f} s, torch eager "
            f"{medians['torch_eager']:.3f} s; first loss {first['segments'][0]:.6f} / {first['op_by_op'][0]:.6f} / "
            f"{first['torch_eager'][0]:.6f}; segments {rows[name].get('segments')}",
            flush=True,
        )
    write_results(
        args.out,
        {
            "what": __doc__.split("\n\n")[0],
            "machine": machine(),
            "config": {"batch": BATCH, "length": LENGTH, "microbatches": 2, "devices": 8, "steps": args.steps},
            "models": rows,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
