"""HBM traffic of a compiled TPU program, read from its optimized HLO (modelled).

`cost_analysis()["bytes accessed"]` sums the operands and outputs of every instruction in any
memory space: a weight that XLA prefetches into VMEM (`copy-start`/`slice-start` to `S(1)`) is
counted when copied and again when the fusion reads the VMEM copy, so it overstates what a step
reads from HBM (an 8B decode step on 8 v5e chips: 3.5x its weights). Here each top-level
instruction of the entry computation counts only the bytes of its operands and outputs that
live in HBM (memory space 0): the async copy reads a weight from HBM once, the fusion's read of
the VMEM copy is free. A Mosaic kernel's own DMAs inside the call are not visible: its HBM
operands count as read once (jspec's attention kernel reads one layer of a stacked cache).
A while loop (scanned layers) counts its body once per trip.

Flops come from the same walk: the matmuls only (`dot`, and `convolution`, which is how the TPU
compiler emits them), 2 x output elements x contracted elements, inside fusions, a while body
once per trip, a conditional's costliest branch. `cost_analysis()["flops"]` counts a while body
once whatever its trip count (scanned layers: one layer), so it is not used. Elementwise work
(norms, rope, softmax, activations) is left out, a Mosaic kernel's (jspec's attention) too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_SPACE = re.compile(r"S\((\d+)\)")
# Instructions that move no data of their own.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "iota"}


def _arrays(type_str: str) -> list[tuple[float, int]]:
    """(bytes, memory space) of each array in an HLO type (a tuple lists several)."""
    out = []
    for dt, dims, layout in _ARRAY.findall(type_str):
        if dt not in DTYPE_BYTES:
            if dt.startswith("f8"):
                size = 1
            else:
                continue
        else:
            size = DTYPE_BYTES[dt]
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        m = _SPACE.search(layout or "")
        out.append((n * size, int(m.group(1)) if m else 0))
    return out


def _dims(type_str: str) -> list[int]:
    """The dimensions of the (first) array of an HLO type."""
    m = _ARRAY.search(type_str)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _matmul_flops(typ: str, op: str, operands: list[str], rest: str, types: dict[str, str],
                  outer: dict[str, str] | None = None) -> float:
    """2 x output elements x contracted elements of a `dot` (its `lhs_contracting_dims`) or a
    `convolution` (the kernel's input features x the window positions that land on the input,
    not on padding: the TPU compiler writes some projections as a padded window); 0 for any
    other op. Operand types from `types`, else `outer`."""
    if op not in ("dot", "convolution") or len(operands) < 2:
        return 0.0
    if outer is not None:
        types = {o: types.get(o) or outer[o] for o in operands[:2]}
    out = math.prod(_dims(typ))
    if op == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        lhs = _dims(types[operands[0]])
        k = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m else 1
    else:
        m = re.search(r"dim_labels=([^_]*)_([^-]*)->([\w]*)", rest)
        if not m:
            raise ValueError(f"convolution without dim_labels: {rest[:200]}")
        lhs_l, rhs_l, out_l = m.groups()
        lhs, rhs, outd = _dims(types[operands[0]]), _dims(types[operands[1]]), _dims(typ)
        out = math.prod(d for d, c in zip(outd, out_l, strict=True) if not c.isdigit())
        k = rhs[rhs_l.index("i")]
        w = re.search(r"window=\{([^}]*)\}", rest)
        win = dict(kv.split("=", 1) for kv in (w.group(1).split() if w else []))
        for d in range(sum(c.isdigit() for c in out_l)):  # window fields: 'x' between dims
            pad, stride, base, dil = (int(win[key].split("x")[d].split("_")[0]) if key in win
                                      else dflt for key, dflt in (("pad", 0), ("stride", 1),
                                                                  ("lhs_dilate", 1),
                                                                  ("rhs_dilate", 1)))
            k *= _window_positions(lhs[lhs_l.index(str(d))], outd[out_l.index(str(d))],
                                   rhs[rhs_l.index(str(d))], pad, stride, base, dil)
    return 2.0 * out * k


def _window_positions(n: int, o: int, k: int, pad_lo: int, stride: int, base_dil: int,
                      win_dil: int) -> int:
    """(output position, window position) pairs of one spatial dim of a convolution that read
    an input element (not padding, not a hole of a dilated input)."""
    count = 0
    last = (n - 1) * base_dil  # the last input element in the dilated input
    for w in range(k):
        off = w * win_dil - pad_lo  # the input position output 0 reads through window pos w
        if base_dil == 1:  # the outputs i with 0 <= i * stride + off <= last
            lo = -(off // stride) if off < 0 else 0  # ceil(-off / stride)
            hi = min(o - 1, (last - off) // stride) if last >= off else -1
            count += max(0, hi - lo + 1)
        else:
            count += sum(1 for i in range(o)
                         if 0 <= i * stride + off <= last and (i * stride + off) % base_dil == 0)
    return count


def _fused_flops(comp: str, comps: dict[str, list[tuple[str, str, str, list[str], str]]]
                 ) -> float:
    """Matmul flops of one run of fused computation `comp`, nested fusions included."""
    body = comps.get(comp, [])
    types = {ins[0]: ins[1] for ins in body}
    flops = 0.0
    for _, typ, op, operands, rest in body:
        flops += _matmul_flops(typ, op, operands, rest, types)
        called = re.search(r"calls=%([\w.\-]+)", rest)
        if called:
            flops += _fused_flops(called.group(1), comps)
    return flops


def _hbm(type_str: str) -> float:
    return sum(b for b, space in _arrays(type_str) if space == 0)


def _instructions(hlo: str) -> Iterator[tuple[str, bool, tuple[str, str, str, list[str], str]]]:
    """(computation name, is ROOT, (name, type, opcode, operand names, rest of line)) of every
    instruction ("ENTRY" for the entry computation)."""
    current = None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line) if current is not None else None
        if m:
            name, typ, op, rest = m.groups()
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            yield current, line.lstrip().startswith("ROOT "), (name, typ, op, operands, rest)


def computations(hlo: str) -> tuple[dict[str, list[tuple[str, str, str, list[str], str]]],
                                     dict[str, str]]:
    """Every computation's instructions as (name, type, opcode, operand names, rest of line),
    by computation name ("ENTRY" for the entry), and the ROOT opcode of each."""
    comps: dict[str, list[tuple[str, str, str, list[str], str]]] = {}
    roots: dict[str, str] = {}
    for comp, is_root, ins in _instructions(hlo):
        comps.setdefault(comp, []).append(ins)
        if is_root:
            roots[comp] = ins[2]
    return comps, roots


_WINDOWED = {"dynamic-slice", "slice", "gather"}


def _fusion_reads(comp: str, comps: dict[str, list[tuple[str, str, str, list[str], str]]]
                  ) -> dict[int, float | None]:
    """Per parameter index of fused computation `comp`: the bytes read when every use of it is
    a slice / dynamic-slice / gather (only those windows are read), also through a nested
    fusion that uses it so; None when read whole."""
    body = comps.get(comp, [])
    params = {name: int(re.search(r"parameter\((\d+)\)", "parameter(" + rest).group(1))
              for name, _, op, _, rest in body if op == "parameter"}
    users: dict[str, list[float | None]] = {p: [] for p in params}
    for _, typ, op, operands, rest in body:
        nested = re.search(r"calls=%([\w.\-]+)", rest) if op == "fusion" else None
        inner = _fusion_reads(nested.group(1), comps) if nested else {}
        for pos, o in enumerate(operands):
            if o not in users:
                continue
            if op in _WINDOWED:
                users[o].append(float(sum(b for b, _ in _arrays(typ))))
            else:
                users[o].append(inner.get(pos))
    return {idx: (sum(us) if us and all(u is not None for u in us) else None)  # type: ignore[misc]
            for p, idx in params.items() for us in [users[p]]}


def hbm_traffic(hlo: str) -> dict[str, float]:
    """Modelled HBM bytes read and written by one run of the ENTRY computation, its matmul
    flops (`flops`: dots and convolutions, see the module's doc) and the compiler's summed
    `estimated_cycles` (all NaN for a program with a data-dependent loop). A
    conditional counts its costliest branch (an upper bound), a call its computation, a
    while loop (scanned layers) its body once
    per trip (the trip count read from its condition's bound); its own operands and results
    move nothing. A fusion whose root is a scatter or dynamic-update-slice updates its first
    operand in place: only its other operands are read, and as much is written. A fusion
    operand used only through slices / dynamic-slices / gathers inside the fusion counts as
    those windows. A conditional's flops are its branches' largest (maybe another branch)."""
    comps, roots = computations(hlo)
    types = {ins[0]: ins[1] for body in comps.values() for ins in body}
    try:
        read, written, cycles, flops = _traffic("ENTRY", comps, roots, types)
    except UnknownTripCount:  # a data-dependent loop (a whole `generate`): no per-run bytes
        read = written = cycles = flops = math.nan
    return {"hbm_read_bytes": read, "hbm_written_bytes": written,
            "hbm_bytes": read + written, "estimated_cycles": cycles, "flops": flops}


class UnknownTripCount(ValueError):
    """A while loop whose bound is not a constant."""


def trip_count(cond: list[tuple[str, str, str, list[str], str]]) -> int:
    """The trip count of a while loop from its condition computation: the bound of its
    `counter < N` compare (jax's scan and fori_loop count from 0)."""
    consts = [int(m.group(1)) for _, typ, op, _, rest in cond
              if op == "constant" and typ.startswith("s32[]")
              for m in [re.search(r"^\s*(-?\d+)\)", rest)] if m]
    if not consts:
        raise UnknownTripCount("while loop without a constant bound: trip count unknown")
    return max(consts)


def _traffic(comp: str, comps: dict[str, list[tuple[str, str, str, list[str], str]]],
             roots: dict[str, str], types: dict[str, str]
             ) -> tuple[float, float, float, float]:
    """(bytes read, bytes written, estimated cycles, matmul flops) of one run of `comp`."""
    read = written = cycles = flops = 0.0
    local = {ins[0]: ins[1] for ins in comps.get(comp, [])}
    for name, typ, op, operands, rest in comps.get(comp, []):
        c = re.search(r'"estimated_cycles":"(\d+)"', rest)
        cycles += int(c.group(1)) if c else 0
        flops += _matmul_flops(typ, op, operands, rest, local, types)
        if op == "fusion":
            flops += _fused_flops(re.search(r"calls=%([\w.\-]+)", rest).group(1), comps)
        if op in _FREE:
            continue
        if op == "while":
            body = re.search(r"body=%([\w.\-]+)", rest).group(1)
            cond = re.search(r"condition=%([\w.\-]+)", rest).group(1)
            n = trip_count(comps.get(cond, []))
            r, w, cy, f = _traffic(body, comps, roots, types)
            read, written, cycles, flops = (read + n * r, written + n * w, cycles + n * cy,
                                            flops + n * f)
            continue
        if op in ("conditional", "call"):  # the branch that moves the most (an upper bound)
            names = re.findall(r"(?:branch_computations=\{|true_computation=|"
                               r"false_computation=|to_apply=)([^}]*)", rest)
            subs = [x.strip().lstrip("%") for n in names for x in n.split(",")]
            subs = [x.split()[0] for x in subs if x]
            costs = [_traffic(c, comps, roots, types) for c in subs if c in comps]
            if costs:
                r, w, cy, _ = max(costs, key=lambda x: x[0] + x[1])
                read, written, cycles = read + r, written + w, cycles + cy
                flops += max(x[3] for x in costs)
                continue
        if op.endswith("-done"):  # the result of an async copy: written where it lands
            written += _hbm(typ)
            continue
        if op in ("slice-start", "slice", "dynamic-slice"):  # only the slice is read
            arrays = _arrays(typ)
            part = arrays[1] if op == "slice-start" and len(arrays) > 1 else arrays[0]
            read += part[0]
            written += part[0] if op != "slice-start" and part[1] == 0 else 0.0
            continue
        if op == "dynamic-update-slice":  # in place: only the update moves
            upd = types.get(operands[1], "") if len(operands) > 1 else ""
            read += _hbm(upd)
            written += sum(b for b, _ in _arrays(upd)) if _hbm(typ) else 0.0
            continue
        called = re.search(r"calls=%([\w.\-]+)", rest)
        body = comps.get(called.group(1), []) if called else []
        windows = _fusion_reads(called.group(1), comps) if op == "fusion" else {}
        per_operand = []
        for i, o in enumerate(operands):
            full = _hbm(types.get(o, ""))
            w = windows.get(i)
            if op == "custom-call" and name.startswith("tree_attention"):
                # jspec's attention kernel given a stacked cache [L, B, KV, S, hd] reads the
                # tiles of one layer (its index maps), at most 1/L of the stack.
                dims = _dims(types.get(o, ""))
                w = full / dims[0] if len(dims) == 5 else None
            per_operand.append(min(full, w) if (w is not None and full) else full)
        if op == "scatter" or (called and roots.get(called.group(1)) in ("scatter",
                                                                        "dynamic-update-slice")):
            # In place: the other operands are read (where in HBM) and written into the
            # buffer (when it lives in HBM), wherever they came from.
            read += sum(per_operand[1:])
            if _hbm(typ):
                written += sum(sum(b for b, _ in _arrays(types.get(o, ""))) for o in operands[1:])
            continue
        read += sum(per_operand)
        if not op.endswith("-start"):
            written += _hbm(typ)
    return read, written, cycles, flops
