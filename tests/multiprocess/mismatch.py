"""Processes started with different configs (a bug in a launch script): every process must say so and stop."""

import os

import jmp as smp

smp.init({"microbatches": 1 + int(os.environ["RANK"])})
print("not reached", flush=True)
