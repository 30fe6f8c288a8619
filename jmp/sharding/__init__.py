"""Parallel layouts on the ``("pp", "dp", "fsdp", "ep", "tp")`` mesh: sharding rules and pipeline schedules.

Built by the sharding and pipeline issues on top of ``jmp.torch_bridge``'s
converted modules, whose parameter paths equal torch ``state_dict`` keys so that
rules can be written with torch names.
"""
