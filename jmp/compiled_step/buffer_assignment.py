"""Which bytes of a compiled XLA program's temporaries are written by the time each instruction has run.

XLA places all of a program's temporaries in one allocation, each at an offset (its buffer assignment). A block that
malloc maps afresh for each run is resident only in the pages written so far, so a peak reached mid-program (a
library's scratch beside the temporaries) sees part of it. The program's buffer assignment and scheduled module come
as protobufs (``xla/service/hlo.proto``); only the fields read here are declared.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_SCHEMA = {  # the fields read, numbered as in hlo.proto: int64 unless a type follows the colon; * repeated
    "Location": "instruction_id=4",
    "LogicalBuffer": "id=1 defined_at=3:Location",
    "Assigned": "logical_buffer_id=1 offset=2 size=3",
    "Allocation": "size=2 is_entry_computation_parameter=5:bool maybe_live_out=7:bool assigned=9:Assigned*",
    "Assignment": "logical_buffers=1:LogicalBuffer* buffer_allocations=3:Allocation*",
    "Instruction": "name=1:string id=35 called_computation_ids=38*",
    "Computation": "instructions=2:Instruction*",
    "Sequence": "instruction_ids=1*",
    "SequenceEntry": "key=1 value=2:Sequence",  # an entry of the map below
    "Schedule": "sequences=1:SequenceEntry*",
    "Module": "entry_computation_id=6 computations=3:Computation* schedule=7:Schedule",
}
_TYPES = {"": 3, "bool": 8, "string": 9}  # FieldDescriptorProto's int64, bool and string; others are messages (11)


@functools.cache
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


def temporaries_written(compiled: Any) -> Callable[[str], int]:
    """For a ``jax.stages.Compiled``: the bytes of its temporaries allocation written once the named instruction
    has run, in the program's schedule (a while loop's body and condition, each once, before the loop itself)."""
    classes = _message_classes()
    executable = compiled.runtime_executable()
    stats = executable.get_compiled_memory_stats()
    assignment = classes["Assignment"].FromString(stats.serialized_buffer_assignment_proto)
    module = classes["Module"].FromString(executable.hlo_modules()[0].as_serialized_hlo_module_proto())
    sequences = {entry.key: entry.value.instruction_ids for entry in module.schedule.sequences}
    instructions = {i.id: i for computation in module.computations for i in computation.instructions}
    order: list[int] = []

    def visit(computation: int) -> None:
        for instruction in sequences[computation]:
            for callee in instructions[instruction].called_computation_ids:
                if callee in sequences:
                    visit(callee)
            order.append(instruction)

    visit(module.entry_computation_id)
    position = {instruction: k for k, instruction in reversed(list(enumerate(order)))}  # the first run
    temporaries = next(
        a
        for a in assignment.buffer_allocations
        if a.size == stats.temp_size_in_bytes and not (a.is_entry_computation_parameter or a.maybe_live_out)
    )
    defined = {buffer.id: position.get(buffer.defined_at.instruction_id) for buffer in assignment.logical_buffers}
    spans = sorted((a.offset, a.offset + a.size, defined[a.logical_buffer_id]) for a in temporaries.assigned)
    at = {instructions[i].name: k for i, k in position.items()}

    def written(name: str) -> int:
        total, end, now = 0, 0, at.get(name, len(order))
        for start, stop, when in spans:
            if when is None or when <= now:  # a buffer defined outside the schedule counts as written
                total, end = total + max(0, stop - max(start, end)), max(end, stop)
        return total

    return written
