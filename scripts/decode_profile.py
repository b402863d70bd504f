"""Where a batched decode step's time goes, by source operation (docs/BENCHMARKS.md, issue 18).

    python scripts/decode_profile.py BATCH SLOTS DTYPE        e.g. 64 256 bfloat16

The loop of `scripts/decode_step.py` (8 greedy one-token steps over a cache of SLOTS slots filled
to half) under `jax.profiler.trace`; every XLA:CPU thunk of the trace is attributed to the jax
operation it came from (the `op_name` of the optimized HLO, dumped to a temporary directory, with
the layer number folded), and the time per step is printed per (thunk kind, operation). Thunks
that run once per call (outside the loop) are in the sums too, divided by 8; run it on an idle
machine (another process on the 2 cores doubles every number).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="jspec-hlo-")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}"
                           " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_loop")

import jax  # noqa: E402  (XLA_FLAGS must be set before jax starts)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_step import STEPS, decode_loop  # noqa: E402

# Trace events that are the runtime's own spans around the thunks, not thunks.
SKIP = ("Thunk", "Slinky", "PjRt", "Pjit", "Handle", "Parse", "Allocate", "RefManager", "while")


def main(batch: int, slots: int, dtype: str) -> None:
    loop, args = decode_loop(batch, slots, dtype)
    jax.block_until_ready(loop(*args))
    trace_dir = tempfile.mkdtemp(prefix="jspec-trace-")
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready(loop(*args))
    with open(glob.glob(f"{DUMP}/*jit_loop.cpu_after_optimizations.txt")[0]) as f:
        hlo = f.read()
    op_of = {m.group(1): m.group(2) for m in re.finditer(
        r"%([\w.\-]+) = [^\n]*?metadata=\{op_name=\"([^\"]+)\"", hlo)}
    with gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]) as f:
        trace = json.load(f)
    per = collections.Counter()
    for e in trace["traceEvents"]:
        name = e.get("name", "")
        if e.get("ph") != "X" or name.startswith(("$", "end:")) or any(s in name for s in SKIP):
            continue
        op = re.sub(r"layer_\d+", "layer_N", op_of.get(name, "(no op_name: a copy or convert XLA inserted)"))
        op = op.replace("jit(loop)/while/body/closed_call/", "")
        per[(name.split(".")[0], op)] += e["dur"]
    total = sum(per.values())
    print(f"batch {batch}, {slots} slots, {dtype}: {total / STEPS / 1000:.1f} ms of thunks a step")
    for (kind, op), us in per.most_common(16):
        print(f"{us / STEPS / 1000:8.2f} ms  {100 * us / total:5.1f}%  {kind:26s} {op[:80]}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
