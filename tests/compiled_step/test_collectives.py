"""``collectives.collective_bytes``: each device's bytes sent, by kind, from a compiled program's HLO text."""

from __future__ import annotations

from jmp.compiled_step.collectives import collective_bytes

# XLA's spellings, as compiled programs write them: an async start's result is (inputs, outputs) but an
# all-reduce's (its outputs); groups explicit, as an iota, or as mesh axes; a while body with its trip count
HLO = """HloModule jit_step, is_scheduled=true

%body (p: (s32[], bf16[32,64])) -> (s32[], bf16[32,64]) {
  %ag = ((bf16[8,64]{1,0}), bf16[32,64]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[2,4]<=[8]
  %ar = (f32[128]{0}, f32[64]{0}) all-reduce-start(%a, %b), replica_groups=mesh['x'=2,'y'=4] {'x','y'}, to_apply=%add
}

%cond (p: (s32[], bf16[32,64])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[64,64]) -> f32[8,64] {
  %w = (s32[], bf16[32,64]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[8,64]{1,0} reduce-scatter(%a), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %cp = (f32[8,64]{1,0}, f32[8,64]{1,0}, u32[], u32[]) collective-permute-start(%rs), source_target_pairs={{0,1},{1,0}}
}
"""


def test_collective_bytes_count_a_loop_body_as_often_as_it_runs_and_each_devices_ring_share():
    sent = collective_bytes(HLO, 8, per_host=4)
    assert sent["all-gather"] == {"bytes": 3 * 32 * 64 * 2 * 3 / 4, "network_bytes": 0.0}  # groups of 4
    assert sent["all-reduce"] == {
        "bytes": 3 * (128 + 64) * 4 * 2 * 7 / 8,
        "network_bytes": 3 * (128 + 64) * 4 * 2 * 7 / 8,
    }
    assert sent["reduce-scatter"]["bytes"] == 8 * 64 * 4 * 7  # n - 1 times its result: 7/8 of its operand
    assert sent["collective-permute"]["bytes"] == 8 * 64 * 4 + 2 * 4  # the outputs half, scalars included
    assert sent["all-to-all"] == {"bytes": 0.0, "network_bytes": 0.0}
