"""Pipeline schedules as tables: what each stage does at each tick of the compiled program.

At every tick each stage does at most one unit of work: ``FORWARD`` a microbatch, or ``BACKWARD`` one
(pull its output cotangent back through the stage; on the last stage the loss gives that cotangent). A
stage's result reaches its neighbour at the next tick (one ``ppermute`` per direction per tick).

- ``simple``: every stage runs all its forwards, then all its backwards (GPipe). A stage keeps the inputs
  of every microbatch until its backward: memory grows with ``microbatches``.
- ``interleaved``: one-forward-one-backward (1F1B). Stage *s* runs at most ``pp - s`` forwards ahead of its
  backwards, so it holds at most ``pp + 1`` microbatches (its next input may arrive while it holds
  ``pp``), however many microbatches there are.

Both take the textbook ``2 (M + pp - 1)`` ticks for ``M`` microbatches, idle ``(pp - 1) / (M + pp - 1)``
of the stage-ticks. ``active_microbatches`` lowers either bound: a stage then starts a forward only while
fewer than that many of its microbatches await their backward.
"""

from __future__ import annotations

import dataclasses

import numpy as np

IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Schedule:
    action: np.ndarray  # [ticks, pp]: IDLE / FORWARD / BACKWARD
    microbatch: np.ndarray  # [ticks, pp]: which microbatch the action works on (0 when idle)
    received_forward: np.ndarray  # [ticks, pp]: microbatch whose stage input arrives now (-1: none)
    received_backward: np.ndarray  # [ticks, pp]: microbatch whose output cotangent arrives now (-1: none)
    slots: int  # microbatches a stage holds at once (its inputs and cotangents)

    @property
    def ticks(self) -> int:
        return self.action.shape[0]

    @property
    def bubble(self) -> float:
        """Fraction of stage-ticks spent idle."""
        return float(np.mean(self.action == IDLE))


def build(kind: str, stages: int, microbatches: int, backward: bool = True, active: int | None = None) -> Schedule:
    """The schedule of ``kind`` ("simple" or "interleaved") for ``stages`` x ``microbatches``.

    ``active`` (SMP's ``active_microbatches``) caps the microbatches a stage has started and not finished,
    so at most that many are in flight at once (None: the schedule's own bound).
    """
    if kind not in ("simple", "interleaved"):
        raise ValueError(f"unknown pipeline schedule {kind!r}; use 'simple' or 'interleaved'")
    pp, m_total = stages, microbatches
    last = pp - 1
    next_f = [0] * pp
    next_b = [0] * pp
    have_input = [set(range(m_total))] + [set() for _ in range(pp - 1)]
    have_ct: list[set[int]] = [set() for _ in range(pp)]
    rows, span = [], 1
    arrived_f, arrived_b = [-1] * pp, [-1] * pp
    while True:
        done = next_b if backward else next_f
        if all(n == m_total for n in done):
            break
        action, micro = [IDLE] * pp, [0] * pp
        for s in range(pp):
            can_f = next_f[s] < m_total and next_f[s] in have_input[s]
            can_b = backward and next_b[s] < next_f[s] and next_b[s] in have_ct[s]
            limit = m_total if kind == "simple" or not backward else pp - s
            if backward and active is not None:
                limit = min(limit, active)
            can_f = can_f and next_f[s] - next_b[s] < limit
            prefer_b = kind == "interleaved"
            if can_b and (prefer_b or not can_f):
                action[s], micro[s] = BACKWARD, next_b[s]
            elif can_f:
                action[s], micro[s] = FORWARD, next_f[s]
        rows.append((action, micro, arrived_f, arrived_b))
        arrived_f, arrived_b = [-1] * pp, [-1] * pp
        for s in range(pp):
            if action[s] == FORWARD:
                next_f[s] += 1
                if s < last:
                    have_input[s + 1].add(micro[s])
                    arrived_f[s + 1] = micro[s]
                else:  # the loss gives the last stage its output cotangent
                    have_ct[s].add(micro[s])
            elif action[s] == BACKWARD:
                next_b[s] += 1
                if s > 0:
                    have_ct[s - 1].add(micro[s])
                    arrived_b[s - 1] = micro[s]
        for s in range(pp):  # microbatches a stage holds: arrived (or, at stage 0, started), not yet finished
            low = next_b[s] if backward else next_f[s]
            held = [m for m in have_input[s] if m >= low] if s else list(range(low, next_f[s] + 1))
            held = [m for m in held if m < m_total]
            if held:
                span = max(span, max(held) - min(held) + 1)
        if len(rows) > 4 * (m_total + pp) + 8:
            raise RuntimeError(f"pipeline schedule {kind} did not finish ({pp} stages, {m_total} microbatches)")
    action, micro, rf, rb = (np.array([r[i] for r in rows], np.int32) for i in range(4))
    return Schedule(action, micro, rf, rb, min(span, m_total))
