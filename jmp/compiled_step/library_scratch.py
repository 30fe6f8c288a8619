"""The host memory a compiled XLA:CPU step's YNNPACK fusions allocate beside XLA's buffers, read from its protobufs.

A fusion that feeds a dot into further ops (the logits into log-softmax's max) runs as a slinky pipeline that
allocates for the call a packed copy of the weight (not always: an upper bound) and the dot's result in slabs of 64
rows (seen for GPT-2's and a Qwen2's logits); a plain dot works in XLA's buffers. Fusions run one at a time.

XLA places all of a program's temporaries in one block, each at an offset (its buffer assignment). A block malloc maps
afresh for each run is resident only in the pages written so far, so beside a fusion's scratch it holds what the
instructions scheduled before it wrote. Only the fields read here are declared (``xla/service/hlo.proto``).
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_SCHEMA = {  # the fields read, numbered as in hlo.proto: int64 unless a type follows the colon; * repeated
    "Location": "instruction_id=4",
    "LogicalBuffer": "id=1 defined_at=3:Location",
    "Assigned": "logical_buffer_id=1 offset=2 size=3",
    "Allocation": "size=2 is_entry_computation_parameter=5:bool maybe_live_out=7:bool assigned=9:Assigned*",
    "Assignment": "logical_buffers=1:LogicalBuffer* buffer_allocations=3:Allocation*",
    "Shape": "element_type=2 dimensions=3*",
    "Instruction": "opcode=2:string shape=3:Shape id=35 operand_ids=36* called_computation_ids=38* "
    "backend_config=43:bytes",
    "Computation": "instructions=2:Instruction* id=5 root_id=6",
    "Sequence": "instruction_ids=1*",
    "SequenceEntry": "key=1 value=2:Sequence",  # an entry of the map below
    "Schedule": "sequences=1:SequenceEntry*",
    "Module": "entry_computation_id=6 computations=3:Computation* schedule=7:Schedule",
}
_TYPES = {"": 3, "bool": 8, "string": 9, "bytes": 12}  # FieldDescriptorProto's types; others are messages (11)
_ITEMSIZE = {1: 1, 2: 1, 6: 1, 3: 2, 7: 2, 10: 2, 16: 2, 5: 8, 9: 8, 12: 8, 13: 0}  # PrimitiveType -> bytes (else 4)
_SLAB_ROWS = 64


def _message_classes() -> dict[str, type]:
    file = descriptor_pb2.FileDescriptorProto(name="jmp_hlo.proto", package="jmp_hlo", syntax="proto3")
    for message, fields in _SCHEMA.items():
        declared = file.message_type.add(name=message)
        for field in fields.split():
            named, _, kind = field.rstrip("*").partition(":")
            name, number = named.split("=")
            added = declared.field.add(name=name, number=int(number), type=_TYPES.get(kind, 11))
            added.label = 3 if field.endswith("*") else 1  # repeated, optional
            if kind not in _TYPES:
                added.type_name = f".jmp_hlo.{kind}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"jmp_hlo.{name}")) for name in _SCHEMA}


def library_scratch(compiled: Any, mapped: bool) -> int:
    """The most a YNNPACK fusion of ``compiled`` (a ``jax.stages.Compiled`` for XLA:CPU) adds to its temporaries:
    its scratch, or with the temporaries ``mapped`` afresh each run, what exceeds their pages unwritten by then."""
    classes, executable = _message_classes(), compiled.runtime_executable()
    module = classes["Module"].FromString(executable.hlo_modules()[0].as_serialized_hlo_module_proto())
    computations = {computation.id: computation for computation in module.computations}
    instructions = {i.id: i for computation in module.computations for i in computation.instructions}

    def size(instruction: Any) -> int:
        return math.prod(instruction.shape.dimensions) * _ITEMSIZE.get(instruction.shape.element_type, 4)

    scratch = {}
    for fusion in (i for i in instructions.values() if b'"kind":"__ynn_fusion"' in i.backend_config):
        body = computations[fusion.called_computation_ids[0]]
        dots = [i for i in body.instructions if i.opcode == "dot" and i.id != body.root_id]
        slabs = sum(
            int(size(dot) * min([1, *(_SLAB_ROWS / rows for rows in dot.shape.dimensions[:1])])) for dot in dots
        )
        scratch[fusion.id] = slabs + sum(size(instructions[o]) for dot in dots for o in dot.operand_ids[:2])
    if not (mapped and scratch):
        return max(scratch.values(), default=0)
    stats = executable.get_compiled_memory_stats()
    written = _written(classes["Assignment"].FromString(stats.serialized_buffer_assignment_proto), module, stats)
    return max(max(0, written(fusion) + bytes_ - stats.temp_size_in_bytes) for fusion, bytes_ in scratch.items())


def _written(assignment: Any, module: Any, stats: Any) -> Any:
    """Instruction id -> bytes of the temporaries written once it has run, in the program's schedule (a while loop's
    body and condition, each once, before the loop itself)."""
    sequences = {entry.key: entry.value.instruction_ids for entry in module.schedule.sequences}
    called = {i.id: i.called_computation_ids for computation in module.computations for i in computation.instructions}
    order: list[int] = []

    def visit(computation: int) -> None:
        for instruction in sequences[computation]:
            for callee in called[instruction]:
                if callee in sequences:
                    visit(callee)
            order.append(instruction)

    visit(module.entry_computation_id)
    position = {instruction: k for k, instruction in reversed(list(enumerate(order)))}  # its first run
    temporaries = next(
        a
        for a in assignment.buffer_allocations
        if a.size == stats.temp_size_in_bytes and not (a.is_entry_computation_parameter or a.maybe_live_out)
    )
    defined = {buffer.id: position.get(buffer.defined_at.instruction_id) for buffer in assignment.logical_buffers}
    spans = sorted((a.offset, a.offset + a.size, defined[a.logical_buffer_id]) for a in temporaries.assigned)

    def written(instruction: int) -> int:
        total, end, now = 0, 0, position.get(instruction, len(order))
        for start, stop, when in spans:
            if when is None or when <= now:  # a buffer defined outside the schedule counts as written
                total, end = total + max(0, stop - max(start, end)), max(end, stop)
        return total

    return written
