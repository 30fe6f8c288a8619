"""Tiny, deterministic pretraining data in the SMP v2 script's ``gpt_jsonl`` format.

``GPTDataPipeline`` (``shared-scripts/data/pipelines/gpt_data_pipeline.py``) reads every ``*.json.gz`` file
(``--zipped_data 1``, the default) directly in ``--training_dir`` / ``--test_dir``, sorted by name, one file per
dataset: gzip'd text, one JSON object per line, ``{"input_ids": [...], "attention_mask": [...]}``. The script
asserts on its first batch that a sequence is ``--max_context_width`` tokens long (longer ones would be cropped
at a ``np.random`` offset), so every row here is exactly ``seq_len`` tokens, with an all-ones mask. The tokens
follow a noisy affine recurrence mod ``vocab`` so that a tiny model's loss goes down. Same arguments, same bytes:
a fixed seed and gzip with mtime 0. No download, no tokenizer: the script reads token ids.

``python tests/vendored/smp_v2/make_data.py OUT [--vocab V] [--seq-len L] ...`` writes
``OUT/train/train_00.json.gz ...`` and ``OUT/test/test_00.json.gz``.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np


def token_rows(rng: np.random.Generator, rows: int, seq_len: int, vocab: int) -> np.ndarray:
    """``rows`` sequences: x[t+1] = (a * x[t] + b) mod vocab, with a tenth of the tokens replaced by noise."""
    a = rng.integers(1, 8, size=(rows, 1))
    b = rng.integers(0, vocab, size=(rows, 1))
    x = np.empty((rows, seq_len), dtype=np.int64)
    x[:, :1] = rng.integers(0, vocab, size=(rows, 1))
    for t in range(1, seq_len):
        x[:, t : t + 1] = (a * x[:, t - 1 : t] + b) % vocab
    noise = rng.random((rows, seq_len)) < 0.1
    x[noise] = rng.integers(0, vocab, size=int(noise.sum()))
    return x


def write_json_gz(path: Path, rows: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"input_ids": r.tolist(), "attention_mask": [1] * len(r)}) + "\n" for r in rows)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(lines.encode())


def make_data(
    out: Path,
    vocab: int = 128,
    seq_len: int = 32,
    train_files: int = 2,
    train_rows: int = 32,
    test_rows: int = 16,
    seed: int = 1234,
) -> tuple[Path, Path]:
    """Write the train and test folders under ``out``; returns their paths."""
    rng = np.random.default_rng(seed)
    train, test = Path(out) / "train", Path(out) / "test"
    for i in range(train_files):
        write_json_gz(train / f"train_{i:02d}.json.gz", token_rows(rng, train_rows, seq_len, vocab))
    write_json_gz(test / "test_00.json.gz", token_rows(rng, test_rows, seq_len, vocab))
    return train, test


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--train-files", type=int, default=2)
    parser.add_argument("--train-rows", type=int, default=32)
    parser.add_argument("--test-rows", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    a = parser.parse_args()
    train, test = make_data(a.out, a.vocab, a.seq_len, a.train_files, a.train_rows, a.test_rows, a.seed)
    print(f"wrote {train} and {test}")


if __name__ == "__main__":
    main()
