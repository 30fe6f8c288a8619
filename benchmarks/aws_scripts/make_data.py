"""Tiny, deterministic pretraining data in the format AWS's SMP example scripts read.

The SMP v1 scripts' ``GPTPretrainingDataset`` (gpt2/ and flan-t5/ share it) reads every ``*.json.gz`` file
(``--zipped_data 1``, the default) of ``--training_dir`` / ``--test_dir``: gzip'd text, one JSON object per line,
``{"input_ids": [...], "attention_mask": [...]}`` of token ids, cropped at random to ``--max_context_width``
when longer; the SMP v2 script's ``gpt_jsonl`` format is the same. Here every row is exactly ``seq_len`` long
(so no crop, no randomness in reading) with an all-ones mask, and the tokens follow a noisy affine recurrence mod
``vocab`` so that a tiny model's loss goes down. Same arguments, same bytes: a fixed seed and gzip with mtime 0. No
download, no tokenizer: the scripts read token ids.

``python -m benchmarks.aws_scripts.make_data OUT [--vocab V] [--seq-len L] ...`` writes ``OUT/train/train_00.json.gz
...`` and ``OUT/test/test_00.json.gz``.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np


def token_rows(rng: np.random.Generator, rows: int, seq_len: int, vocab: int) -> np.ndarray:
    """``rows`` sequences: x[t+1] = (a * x[t] + b) mod vocab, with a few tokens replaced by noise."""
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
    vocab: int = 256,
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
    parser.add_argument("--vocab", type=int, default=256)
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
