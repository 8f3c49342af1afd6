"""The collectives of a compiled program, read from its HLO text (``compiled.as_text()``).

    counts = collective_counts(compiled.as_text(), num_devices=8)
    counts["all-gather"]   # {"instructions": 12, "operands": 12, "executed": 48,
                           #  "exact": True, "bytes": 25165824}

An async ``*-start``/``*-done`` pair counts once (as its start). The TPU compiler also runs a
collective as a chain of fusions (``AsyncCollectiveStart``, continuations that overlap it with
other work, ``AsyncCollectiveDone``), each holding a copy of it: it counts once, in the start's
fusion. A collective inside a loop body is one instruction; ``executed`` multiplies it by the
loops' known trip counts (a conditional's branches count once each; ``exact`` is False where a
loop without a known trip count holds one).
The TPU compiler writes a reduce-scatter as a fusion ``all-reduce-scatter`` (an all-reduce and a
slice): it counts as a reduce-scatter. ``bytes`` is what one device sends per step, as a
bidirectional ring moves it: ``(n - 1) / n`` of the whole array for an all-gather,
reduce-scatter or all-to-all over ``n`` devices, twice that for an all-reduce, the array for a
collective-permute.
"""

from __future__ import annotations

import functools
import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(")
# `%name = <type> opcode(`; a tuple type is parenthesized and may nest.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\(.*?\)|\S+)\s+([a-z][\w\-]*)\(")
_CALLED = re.compile(
    r"\b(body|condition|to_apply|calls|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
# A loop condition `counter < N` or `N > counter` (lax.scan and fori_loop count from 0): N
# trips. The TPU compiler leaves out the known_trip_count that the CPU's writes, and counts its
# collective matmuls' loops (windowed_dot_general) in unsigned integers.
_CONSTANT = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*[su](?:32|64)\[\]\S*\s+constant\((\d+)\)")
_BOUND = re.compile(
    r"^\s*ROOT\s+%?[\w.\-]+\s*=\s*pred\[\]\S*\s+compare\(%?([\w.\-]+),\s*%?([\w.\-]+)\),"
    r"\s*direction=(LT|GT)\b"
)
_ARRAY = re.compile(r"\b(pred|[subfc]\d+|bf16|f8\w*)\[([\d,]*)\]")
_LISTED_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_BITS = {"pred": 8, "bf16": 16}
# TPU: a fusion of an all-reduce and a dynamic slice that is the program's reduce-scatter.
_REDUCE_SCATTER_FUSION = "all-reduce-scatter"
# TPU: the collectives of an async chain carry its id; the chain's first fusion ends in its start.
_CHAINED = re.compile(r"\bchain_id=")
_CHAIN_START = 'custom_call_target="AsyncCollectiveStart"'


def collective_counts(hlo_text: str, num_devices: int = 1) -> dict[str, dict]:
    """Per opcode of :data:`COLLECTIVES`: ``instructions`` in the module, ``operands`` (arrays)
    they carry, ``executed`` per run of the entry computation, ``exact`` (see the module
    docstring) and ``bytes`` one device sends per run. ``num_devices`` is the group size of a
    collective whose ``replica_groups`` are empty (all devices)."""
    found = []  # (computation, opcode, operands, bytes sent per execution, in a chain)
    chain_starts = set()  # the computations that start an async chain
    callers: dict[str, list[tuple[str, int | str]]] = {}  # a trip count, or the condition's name
    constants: dict[str, int] = {}
    bounds: dict[str, int] = {}  # loop condition -> trip count
    computation, entry = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{") and "->" in line:
            computation = header.group(1)
            if line.startswith("ENTRY"):
                entry = computation
            continue
        if _CHAIN_START in line:
            chain_starts.add(computation)
        if constant := _CONSTANT.match(line):
            constants[constant.group(1)] = int(constant.group(2))
        if bound := _BOUND.match(line):  # `i < N`, or `N > i`
            left, right, direction = bound.groups()
            limit = right if direction == "LT" else left
            if limit in constants:
                bounds[computation] = constants[limit]
        match = _INSTRUCTION.match(line)
        if computation is None or match is None:
            continue
        result_type, opcode = match.groups()
        base = opcode.removesuffix("-start")
        group = _group_size(line, num_devices)
        if base == "all-reduce" and computation.startswith(_REDUCE_SCATTER_FUSION):
            base = "reduce-scatter"
            array_bytes = sum(_array_bytes(result_type))  # the whole array, before its slice
        elif base in COLLECTIVES:  # `-done` ends the same collective: not counted
            arrays = _array_bytes(result_type)
            if opcode.endswith("-start") and base != "all-reduce":
                arrays = arrays[len(arrays) // 2 :]  # (operands, results): the results
            array_bytes = sum(arrays) * (group if base == "reduce-scatter" else 1)
        else:
            array_bytes = None
        if array_bytes is not None:
            operands = _operand_count(line, match.end())
            sent = _sent_bytes(base, array_bytes, group)
            found.append((computation, base, operands, sent, bool(_CHAINED.search(line))))
        trip, condition = _TRIP_COUNT.search(line), _CONDITION.search(line)
        for kind, value in _CALLED.findall(line):
            factor = 1
            if opcode == "while" and kind in ("body", "condition"):
                factor = int(trip.group(1)) if trip else condition.group(1)
            for callee in re.findall(r"%?([\w.\-]+)", value):
                callers.setdefault(callee, []).append((computation, factor))

    @functools.cache
    def runs(name: str) -> tuple[int, bool]:
        if name == entry:
            return 1, True
        total, exact = 0, True
        for caller, factor in callers.get(name, []):
            if isinstance(factor, str):  # a loop without known_trip_count: its condition's bound
                factor = bounds.get(factor)
            count, caller_exact = runs(caller)
            total += count * (factor or 1)
            exact &= caller_exact and factor is not None
        return total, exact

    counts = {
        op: dict(instructions=0, operands=0, executed=0, exact=True, bytes=0) for op in COLLECTIVES
    }
    for name, op, operands, sent, chained in found:
        if chained and name not in chain_starts:
            continue  # a continuation or the end of a chain counted at its start
        count, exact = runs(name)
        counts[op]["instructions"] += 1
        counts[op]["operands"] += operands
        counts[op]["executed"] += count
        counts[op]["exact"] &= exact
        counts[op]["bytes"] += count * sent
    return counts


def _operand_count(line: str, start: int) -> int:
    """The operands of the instruction whose operand list opens at ``line[start - 1]``."""
    depth, end = 1, start
    while end < len(line) and depth:
        depth += {"(": 1, ")": -1}.get(line[end], 0)
        end += 1
    return line[start:end].count("%")


def _array_bytes(hlo_type: str) -> list[int]:
    """The bytes of each non-scalar array of an HLO type (``(f32[4,8]{1,0}, u32[])``)."""
    sizes = []
    for element, dims in _ARRAY.findall(hlo_type):
        if not dims:
            continue  # scalars: async contexts and counters, not data
        bits = _BITS.get(element) or int(re.match(r"[a-z]+(\d+)", element).group(1))
        sizes.append(math.prod(int(d) for d in dims.split(",")) * bits // 8)
    return sizes


def _group_size(line: str, num_devices: int) -> int:
    """How many devices take part in each group of the collective on ``line``."""
    if match := _LISTED_GROUPS.search(line):
        return len(match.group(1).split(","))
    if match := _IOTA_GROUPS.search(line):
        return int(match.group(1))
    if match := _MESH_GROUPS.search(line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", match.group(1)))
        return math.prod(int(sizes[axis]) for axis in re.findall(r"'(\w+)'", match.group(2)))
    return num_devices


def _sent_bytes(op: str, array_bytes: int, group: int) -> float:
    """Bytes one device sends in a bidirectional ring for a collective over ``group``
    devices whose whole array (gathered, reduced or exchanged) is ``array_bytes``."""
    if op == "collective-permute":
        return array_bytes
    share = (group - 1) / group
    return (2 if op == "all-reduce" else 1) * share * array_bytes
