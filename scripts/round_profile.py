"""Where a batch-1 speculative round's time goes, by named scope and operation (issue 19).

    python scripts/round_profile.py [SPEC] [K] [DTYPE] [PROMPTS]
    e.g. python scripts/round_profile.py smollm2-135m-eagle3+ngram:look=4 2 bfloat16 humaneval:0-2

One warm-up `jspec.generate` per prompt, then each prompt once more under `jax.profiler.trace`;
every XLA:CPU thunk is attributed to the jax operation it came from (the optimized HLO's
`op_name`, layer numbers folded) and summed per round (autoregressive: per token). Prints the
wall time per round next to the thunk time, per scope (prefill / draft / verify / accept /
commit) and the top operations; `SHOW_OTHER=1` also lists the thunks XLA inserted (no op_name),
`TEMPERATURE=1` samples. Run it on an idle machine.
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
import time

DUMP = tempfile.mkdtemp(prefix="jspec-hlo-")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}"
                           " --xla_dump_hlo_as_text")

import jax  # noqa: E402  (XLA_FLAGS must be set before jax starts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec.prompts import load_prompt_set  # noqa: E402

SKIP = ("Thunk", "Slinky", "PjRt", "Pjit", "Handle", "Parse", "Allocate", "RefManager", "while")
SCOPES = ("prefill", "draft", "verify", "accept", "commit")


def main(spec: str, k: int, dtype: str, prompts: str) -> None:
    model = jspec.load_model("smollm2-135m", dtype=dtype)
    kw: dict = {"max_new_tokens": 96}
    if os.environ.get("TEMPERATURE"):
        kw["sampling"] = jspec.Sampling(temperature=float(os.environ["TEMPERATURE"]))
        kw["key"] = jax.random.key(0)
    if spec != "none":
        kw["drafter"] = jspec.load_drafter(spec, target=model)
        kw["length"] = jspec.FixedLength(k)
    rows = [model.encode(r["text"]) for r in load_prompt_set(prompts)]
    for ids in rows:
        jax.block_until_ready(jspec.generate(model, jnp.asarray([ids]), **kw).tokens)
    trace_dir = tempfile.mkdtemp(prefix="jspec-trace-")
    rounds = tokens = 0
    wall = 0.0
    with jax.profiler.trace(trace_dir):
        for ids in rows:
            t0 = time.perf_counter()
            out = jspec.generate(model, jnp.asarray([ids]), **kw)
            jax.block_until_ready(out.tokens)
            wall += time.perf_counter() - t0
            n = int(np.asarray(out.lengths)[0])
            tokens += n
            rounds += int(np.asarray(out.stats.rounds)[0]) if spec != "none" else n
    op_of = {}
    for path in glob.glob(f"{DUMP}/*cpu_after_optimizations.txt"):
        with open(path) as f:
            op_of.update({m.group(1): m.group(2) for m in re.finditer(
                r"%([\w.\-]+) = [^\n]*?metadata=\{op_name=\"([^\"]+)\"", f.read())})
    with gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]) as f:
        trace = json.load(f)
    per, scope = collections.Counter(), collections.Counter()
    for e in trace["traceEvents"]:
        name = e.get("name", "")
        if e.get("ph") != "X" or name.startswith(("$", "end:")) or any(s in name for s in SKIP):
            continue
        op = re.sub(r"layer_\d+", "layer_N", op_of.get(name, "(no op_name)"))
        parts = op.split("/")
        sc = next((p for p in parts if p in SCOPES), "other")
        scope[sc] += e["dur"]
        per[(name.split(".")[0], "/".join(p for p in parts if not p.startswith(("jit(", "while",
                                                                             "closed_call"))))] += e["dur"]
    total = sum(per.values())
    r = max(rounds, 1)
    print(f"{spec} K {k} {dtype} {prompts}: {tokens} tokens, {rounds} rounds (tau "
          f"{tokens / r:.2f}), wall {1000 * wall / r:.1f} ms a round incl. prefill, "
          f"thunks {total / r / 1000:.1f} ms a round")
    for sc, us in scope.most_common():
        print(f"  {sc:8s} {us / r / 1000:7.2f} ms a round  {100 * us / total:5.1f}%")
    if os.environ.get("SHOW_OTHER"):
        hlo_line = {}
        for path in glob.glob(f"{DUMP}/*cpu_after_optimizations.txt"):
            with open(path) as f:
                for line in f:
                    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
                    if m:
                        hlo_line[m.group(1)] = m.group(2)[:160]
        other, count = collections.Counter(), collections.Counter()
        for e in trace["traceEvents"]:
            name = e.get("name", "")
            if e.get("ph") == "X" and name in hlo_line and name not in op_of:
                other[name] += e["dur"]
                count[name] += 1
        for name, us in other.most_common(12):
            print(f"{us / r / 1000:8.2f} ms  {count[name]:5d}x  {name}: {hlo_line[name]}")
    for (kind, op), us in per.most_common(30):
        print(f"{us / r / 1000:8.2f} ms  {100 * us / total:5.1f}%  {kind:22s} {op[-100:]}")


if __name__ == "__main__":
    defaults = ["smollm2-135m-eagle3+ngram:look=4", "2", "bfloat16", "humaneval:0-2"]
    a = sys.argv[1:] + defaults[len(sys.argv) - 1:]
    main(a[0], int(a[1]), a[2], a[3])
