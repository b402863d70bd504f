"""The program every process of a `jspec.launch` group runs for tests/test_multiprocess.py.

Not collected by pytest (the name does not match test_*.py); the test imports its helpers (no
side effect on import). Each case joins the group first (`jspec.launch.initialize()`, from the
launcher's environment), builds a mesh over the devices of
every process, runs one piece of jspec, gathers what it produced to every process
(`jspec.sharding.to_host`) and, on process 0 only, writes it to an .npz that the test compares
with a single-process run. By hand:

    python -m jspec.launch -n 2 --devices 4 -- python tests/multiprocess_worker.py \
        generate /tmp/out.npz --drafters autoregressive,eagle3,dflash
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest, mesh_cases

import jax
import jax.numpy as jnp
import numpy as np
from conftest import pad_prompts, tiny_model  # (it also sets matmuls to "highest", as in tests)

import jspec
from jspec import launch, sharding

REAL_PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a list.",
                "Explain what a hash table is in one sentence.", "List three prime numbers."]
COLLECTIVE = re.compile(r" = (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                        r"collective-permute|collective-broadcast)(?:-start)?\(")
ITEMSIZE = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2,
            "s16": 2, "u16": 2}


def log(msg: str) -> None:
    print(msg, flush=True)


def save(path: str, arrays: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
    """Process 0 writes the gathered results; the others write nothing."""
    if jax.process_index() != 0:
        return
    np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})
    if meta is not None:
        Path(path).with_suffix(".json").write_text(json.dumps(meta, indent=1))


def collectives(hlo: str) -> dict[str, Any]:
    """Collective ops of a compiled program: count per kind and the largest result (bytes,
    a tuple result summed) per kind."""
    count: Counter[str] = Counter()
    largest: dict[str, int] = {}
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if m is None:
            continue
        shape, kind = m.groups()
        size = 0
        for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", shape):
            size += int(np.prod([int(d) for d in dims.split(",") if d])) * ITEMSIZE.get(dtype, 1)
        count[kind] += 1
        largest[kind] = max(largest.get(kind, 0), size)
    return {"count": dict(count), "largest_bytes": largest}


def _mesh(spec: str) -> jax.sharding.Mesh:
    return sharding.parse_mesh(spec)


# ----------------------------------------------------------------------------- generate
def _setup(model_kind: str, drafter_name: str) -> tuple[jspec.Model, Any]:
    if model_kind == "real":
        model = jspec.load_model("smollm2-135m")
        if drafter_name == "autoregressive":
            return model, None
        return model, jspec.load_drafter(f"smollm2-135m-{drafter_name}", target=model)
    from mesh_cases import _trained

    if drafter_name == "autoregressive":
        return tiny_model("mesh_gqa", seed=1), None
    return _trained(drafter_name)


def prompts_for(model_kind: str, model: jspec.Model) -> tuple[np.ndarray, np.ndarray]:
    if model_kind == "real":
        return pad_prompts([model.encode(p) for p in REAL_PROMPTS])
    from mesh_cases import PROMPTS

    return pad_prompts(PROMPTS)


def generate_kwargs(model_kind: str, drafter: Any, sampled: bool) -> dict[str, Any]:
    """The same arguments on both sides: greedy, or T = 1 with a fixed key."""
    kw: dict[str, Any] = {"max_new_tokens": 32 if model_kind == "real" else 16}
    if drafter is not None:
        kw.update(drafter=drafter, length=jspec.FixedLength(3))
    if sampled:
        kw.update(sampling=jspec.Sampling(temperature=1.0), key=jax.random.key(7))
    return kw


def case_generate(a: argparse.Namespace) -> None:
    out: dict[str, Any] = {}
    meta: dict[str, Any] = {"seconds": {}, "collectives": {}}
    for mesh_spec in a.meshes.split(","):
        mesh = _mesh(mesh_spec)
        for name in a.drafters.split(","):
            model, drafter = _setup(a.model, name)
            ids, lengths = prompts_for(a.model, model)
            placed = sharding.shard_model(model, mesh)
            placed_drafter = sharding.shard_drafter(drafter, mesh)
            for sampled in ([False, True] if a.sampled else [False]):
                tag = f"{mesh_spec}/{name}/{'t1' if sampled else 'greedy'}"
                kw = generate_kwargs(a.model, placed_drafter, sampled)
                if a.hlo:  # compile only, and list the program's collectives
                    fn = jax.jit(lambda m, d, i, n, kw=kw, mesh=mesh: jspec.generate(
                        m, i, n, mesh=mesh, **{**kw, "drafter": d}).tokens)
                    hlo = fn.lower(placed, placed_drafter, ids, lengths).compile().as_text()
                    meta["collectives"][tag] = collectives(hlo)
                    continue
                t0 = time.perf_counter()
                res = jspec.generate(placed, ids, lengths, mesh=mesh, **kw)
                tokens, n, accepted = sharding.to_host((res.tokens, res.lengths,
                                                        res.stats.accepted))
                meta["seconds"][tag] = round(time.perf_counter() - t0, 2)
                log(f"{tag}: {meta['seconds'][tag]} s (compile included); tokens sharded "
                    f"{res.tokens.sharding.spec}, fully addressable "
                    f"{res.tokens.is_fully_addressable}")
                out[f"{tag}/tokens"], out[f"{tag}/lengths"] = tokens, n
                out[f"{tag}/accepted"] = accepted
    save(a.out, out, meta)


# ----------------------------------------------------------------------------- training
def case_train_step(a: argparse.Namespace) -> None:
    """One AdamW step of train_step with the batch assembled from per-process rows."""
    from mesh_cases import _train_inputs

    from train import drafters as tr

    mesh = _mesh(a.mesh)
    cfg, params, frozen, batch, tx = _train_inputs(a.kind)
    b = len(batch.lens)
    rows = sharding.process_rows(mesh, b)
    # This process keeps only its rows: the others' are dropped before anything is placed.
    local = jax.tree.map(lambda v: v[rows], batch)
    del batch
    log(f"process {jax.process_index()} supplies rows {rows.tolist()} of {b}")
    placed = tr.shard_for_training(mesh, cfg, params, tx.init(params), frozen)
    gbatch = sharding.place_rows(local, mesh, b)
    assert gbatch.tokens.shape[0] == b and not gbatch.tokens.is_fully_addressable
    statics = dict(kind=a.kind, cfg=cfg, tx=tx, vat_head=True, vat_weight=True, mesh=mesh)
    if a.hlo:  # compile only, and list the program's collectives
        hlo = tr.train_step.lower(*placed, gbatch, **statics).compile().as_text()
        save(a.out, {}, {"collectives": {f"train_step/{a.kind}": collectives(hlo)}})
        return
    t0 = time.perf_counter()
    p2, s2, m2 = tr.train_step(*placed, gbatch, **statics)
    p2, s2, loss = sharding.to_host((p2, s2, m2["loss"]))
    log(f"train step {a.kind}: {time.perf_counter() - t0:.2f} s (compile included)")
    out = {f"param/{k}": v for k, v in p2.items()}
    out.update({f"opt/{i}": x for i, x in enumerate(jax.tree.leaves(s2))})
    out["loss"] = loss
    save(a.out, out)


# ----------------------------------------------------------------------------- failures
def case_die(a: argparse.Namespace) -> None:
    """All processes run one cross-process collective; then process `a.rank` exits with status
    3 and the others go on issuing collectives that can no longer complete."""
    mesh = _mesh("2x4")
    x = sharding.place_rows(np.ones((4, 8), np.float32), mesh, 8)
    total = jax.jit(lambda v: jnp.sum(v))  # rows over data: an all-reduce across processes
    log(f"first sum {float(sharding.to_host(total(x)))}")
    if jax.process_index() == a.rank:
        log("exiting with status 3")
        os._exit(3)
    t0 = time.perf_counter()
    for _ in range(10_000):
        total(x).block_until_ready()
    log(f"NOT STOPPED: the collectives went on for {time.perf_counter() - t0:.1f} s")


CASES = {"generate": case_generate, "train-step": case_train_step, "die": case_die}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("out", nargs="?", default=os.devnull)
    p.add_argument("--model", choices=("tiny", "real"), default="tiny")
    p.add_argument("--meshes", default="2x4")
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--drafters", default="autoregressive,eagle3,dflash")
    p.add_argument("--sampled", action="store_true", help="also T = 1 with a fixed key")
    p.add_argument("--kind", default="dflash")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--hlo", action="store_true", help="record the compiled programs' collectives")
    a = p.parse_args()
    launch.initialize()  # before anything touches a device
    log(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} of "
        f"{jax.device_count()} devices")
    CASES[a.case](a)


if __name__ == "__main__":
    main()
