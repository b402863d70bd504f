"""`python -m pallas_kernels.bench`: correctness of each kernel against its jnp reference, and the
time of the kernel next to the XLA path (the reference, compiled by XLA), at realistic sizes.

On an accelerator it runs the kernels compiled (interpret=False) at realistic sizes: 32 query
heads (8 KV heads), head_dim 128, bfloat16, prefixes of 4k-32k tokens, 16-64 tree nodes; a
152k vocabulary for the acceptance kernel. A kernel that fails to lower is reported as such and
the script goes on. On CPU (or with --small) it runs small sizes in interpret mode: correctness
only, since interpret-mode timings say nothing about device speed. One short script: a few
minutes on a device, well under a minute on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.relaxed_acceptance import relaxed_acceptance, relaxed_acceptance_reference
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference
from pallas_kernels.tree_attention.kernel_mgpu import default_splits, tree_attention_mgpu


def _time_ms(fn: Any, args: tuple, kwargs: dict, repeats: int, burst: int = 1) -> tuple[Any, float]:
    """(output, median ms per call) after one warm-up call that compiles.

    Each of `repeats` measurements dispatches `burst` calls back to back and waits once, so on a
    device (burst > 1) the host's per-call dispatch overlaps the device work and the number is
    the device time per call rather than Python overhead.
    """
    out = jax.block_until_ready(fn(*args, **kwargs))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(burst):
            res = fn(*args, **kwargs)
        jax.block_until_ready(res)
        times.append(1000 * (time.perf_counter() - t0) / burst)
    return out, statistics.median(times)


def _binary_tree(t: int) -> np.ndarray:
    return np.asarray([-1] + [(i - 1) // 2 for i in range(1, t)], np.int32)


def _tree(kind: str, b: int, t: int, rng: np.random.Generator) -> jax.Array | None:
    """Parents: "binary" (shared), "chain" (None: causal), "random" (per row, roots included)."""
    if kind == "binary":
        return jnp.asarray(_binary_tree(t))
    if kind == "chain":
        return None
    par = np.stack([[-1] + [int(rng.integers(-1, i)) for i in range(1, t)] for _ in range(b)])
    return jnp.asarray(par.astype(np.int32))


def attention_configs(small: bool, backend: str) -> list[dict[str, Any]]:
    if small and backend == "gpu":  # correctness sweep of the Mosaic GPU kernel (bf16/f16 only)
        return [dict(b=2, t=8, h=8, kv=2, hd=64, prefix=200, s=256, dtype="bfloat16", tree="binary"),
                dict(b=3, t=16, h=4, kv=1, hd=128, prefix=500, s=512, dtype="float16",
                     tree="chain"),
                dict(b=3, t=13, h=12, kv=4, hd=128, prefix=300, s=384, dtype="bfloat16",
                     tree="random"),
                dict(b=2, t=1, h=8, kv=8, hd=64, prefix=1000, s=1024, dtype="bfloat16",
                     tree="chain"),
                dict(b=1, t=64, h=32, kv=8, hd=128, prefix=2000, s=2048, dtype="bfloat16",
                     tree="random")]
    if small:
        return [dict(b=2, t=8, h=8, kv=2, hd=64, prefix=200, s=256, dtype="float32", tree="binary"),
                dict(b=3, t=16, h=4, kv=1, hd=128, prefix=500, s=512, dtype="bfloat16",
                     tree="random")]
    return [dict(b=1, t=t, h=32, kv=8, hd=128, prefix=p, s=p + 128, dtype="bfloat16",
                 tree="binary") for p in (4096, 16384, 32768) for t in (16, 64)]


def acceptance_configs(small: bool, backend: str) -> list[dict[str, Any]]:
    if small:
        cfgs = [dict(b=4, k=4, v=4096, temperature=t, w=w, one_hot=False, dtype="float32")
                for t in (1.0, 0.0) for w in (0.8, None)]
        cfgs += [dict(b=3, k=5, v=5000, temperature=t, w=None, one_hot=True, dtype="bfloat16")
                 for t in (1.0, 0.0)]
        return cfgs if backend == "gpu" else cfgs[:2]
    return [dict(b=b, k=8, v=151_936, temperature=t, w=0.8, one_hot=False, dtype="float32")
            for b in (1, 8) for t in (1.0, 0.0)]


def bench_attention(cfg: dict[str, Any], interpret: bool, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    b, t, h, kv, hd, s = cfg["b"], cfg["t"], cfg["h"], cfg["kv"], cfg["hd"], cfg["s"]
    dt = jnp.dtype(cfg["dtype"])
    lengths = np.full((b,), cfg["prefix"], np.int32)
    lengths[0] = max(0, cfg["prefix"] - 37)  # ragged rows
    if b >= 3:
        lengths[-1] = 0  # a row with an empty prefix: the nodes see only the tree
    kc = rng.standard_normal((b, s, kv, hd), np.float32)
    vc = rng.standard_normal((b, s, kv, hd), np.float32)
    for i, n in enumerate(lengths):
        kc[i, n:] = np.nan  # junk beyond each row's length must never be read
        vc[i, n:] = np.nan
    kc, vc = kc.swapaxes(1, 2), vc.swapaxes(1, 2)  # the cache layout [B, KV, S, hd]
    args = (jnp.asarray(rng.standard_normal((b, t, h, hd)), dt), jnp.asarray(kc, dt),
            jnp.asarray(vc, dt), jnp.asarray(lengths),
            jnp.asarray(rng.standard_normal((b, t, kv, hd)), dt),
            jnp.asarray(rng.standard_normal((b, t, kv, hd)), dt), _tree(cfg.get("tree", "binary"), b, t, rng))
    burst = 1 if interpret else 50
    ref, ref_ms = _time_ms(tree_attention_reference, args, {}, repeats, burst)
    out, ms = _time_ms(tree_attention, args, {"interpret": interpret}, repeats, burst)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    tol = {"bfloat16": 2e-2, "float16": 4e-3}.get(dt.name, 2e-5)  # outputs are O(1)
    return dict(cfg, kernel_ms=ms, xla_ms=ref_ms, max_abs_err=err, ok=bool(err <= tol))


def bench_acceptance(cfg: dict[str, Any], interpret: bool, repeats: int) -> dict[str, Any]:
    b, k, v, temp = cfg["b"], cfg["k"], cfg["v"], cfg["temperature"]
    keys = jax.random.split(jax.random.key(0), 6)
    base = 2.0 * jax.random.normal(keys[0], (b, k + 1, v))
    z = (base + 0.5 * jax.random.normal(keys[1], (b, k + 1, v))).astype(cfg.get("dtype", "float32"))
    q = None if cfg.get("one_hot") else jax.nn.softmax(base[:, :k], axis=-1)
    x = jax.random.categorical(keys[2], base[:, :k]).astype(jnp.int32)
    # Where the target's argmax is drafted (greedy accepts), with one slot left undrafted.
    x = x.at[:, 0].set(jnp.argmax(z[:, 0], axis=-1).astype(jnp.int32))
    valid = jnp.ones((b, k), bool).at[-1, k // 2].set(False)
    u = jax.random.uniform(keys[3], (b, k))
    g = jax.random.gumbel(keys[4], (b, v))
    w = None if cfg.get("w") is None else jnp.full((b,), cfg["w"])
    args = (z, x, q, valid, w, u, g)
    burst = 1 if interpret else 50
    ref, ref_ms = _time_ms(relaxed_acceptance_reference, args, {"temperature": temp}, repeats,
                           burst)
    out, ms = _time_ms(relaxed_acceptance, args, {"temperature": temp, "interpret": interpret},
                       repeats, burst)
    same = bool(jnp.all(out.n_accepted == ref.n_accepted) & jnp.all(out.next_token == ref.next_token))
    err = float(jnp.max(jnp.abs(out.accept_prob - ref.accept_prob)))
    return dict(cfg, kernel_ms=ms, xla_ms=ref_ms, tokens_identical=same, max_prob_err=err,
                mean_n=float(jnp.mean(ref.n_accepted)), ok=same and err <= 1e-5)


def sweep_attention_gpu(repeats: int) -> list[dict[str, Any]]:
    """Time the Mosaic GPU tree kernel over (block_kv, num_splits) at the realistic sizes: what
    the GPU tuning table (`pick_block_kv_gpu`, `default_splits`) is read from."""
    rows = []
    for cfg in attention_configs(False, "gpu"):
        rng = np.random.default_rng(0)
        b, t, h, kv, hd, s = cfg["b"], cfg["t"], cfg["h"], cfg["kv"], cfg["hd"], cfg["s"]
        dt = jnp.dtype(cfg["dtype"])
        args = (jnp.asarray(rng.standard_normal((b, t, h, hd)), dt),
                jnp.asarray(rng.standard_normal((b, kv, s, hd)), dt),
                jnp.asarray(rng.standard_normal((b, kv, s, hd)), dt),
                jnp.full((b,), cfg["prefix"], jnp.int32),
                jnp.asarray(rng.standard_normal((b, t, kv, hd)), dt),
                jnp.asarray(rng.standard_normal((b, t, kv, hd)), dt),
                jnp.broadcast_to(jnp.asarray(_binary_tree(t)), (b, t)))
        nq = -(-t * (h // kv) // 64)
        for bk in (64, 128):
            base = default_splits(b * kv * nq, s // bk)
            for splits in sorted({1, max(1, base // 2), base, min(s // bk, 2 * base)}):
                row = dict(cfg, block_kv=bk, num_splits=splits, default=splits == base)
                try:
                    _, row["kernel_ms"] = _time_ms(tree_attention_mgpu, args, dict(
                        sm_scale=hd ** -0.5, block_kv=bk, num_splits=splits), repeats, 50)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def run(small: bool, repeats: int, only: str | None = None) -> dict[str, Any]:
    backend = jax.default_backend()
    interpret = backend == "cpu"
    small = small or interpret
    res: dict[str, Any] = {"backend": backend, "device": jax.devices()[0].device_kind,
                           "jax": jax.__version__, "interpret": interpret, "small": small,
                           "tree_attention": [], "relaxed_acceptance": []}
    for name, configs, fn in (("tree_attention", attention_configs(small, backend), bench_attention),
                              ("relaxed_acceptance", acceptance_configs(small, backend),
                               bench_acceptance)):
        if only and name != only:
            continue
        for cfg in configs:
            try:
                row = fn(cfg, interpret, repeats)
            except Exception as e:  # a lowering failure on this backend is a result, not a crash
                traceback.print_exc(file=sys.stderr)
                row = dict(cfg, ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            res[name].append(row)
            print(json.dumps(row), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pallas_kernels.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true",
                   help="small sizes (automatic on CPU, where the kernels run in interpret mode)")
    p.add_argument("--repeats", type=int, default=None,
                   help="measurements per case (median; default 5 on a device, each of 50 calls "
                        "dispatched back to back; 1 call on CPU)")
    p.add_argument("--only", choices=("tree_attention", "relaxed_acceptance"),
                   help="run one kernel's cases only")
    p.add_argument("--sweep", action="store_true",
                   help="GPU only: time the tree kernel over (block_kv, num_splits) instead")
    p.add_argument("--json-out", type=Path, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if jax.default_backend() == "cpu" else 5)
    t0 = time.perf_counter()
    if args.sweep:
        if jax.default_backend() != "gpu":
            p.error("--sweep times the Mosaic GPU kernel: it needs a GPU")
        rows = sweep_attention_gpu(repeats)
        if args.json_out:
            args.json_out.write_text(json.dumps(rows, indent=1))
        return 0
    res = run(args.small, repeats, args.only)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    ok = all(r["ok"] for k in ("tree_attention", "relaxed_acceptance") for r in res[k])
    mode = "interpret mode: timings are not device speed" if res["interpret"] else "compiled"
    print(f"backend {res['backend']} ({res['device']}), {mode}; all correct: {ok}; "
          f"{res['seconds']} s")
    if args.json_out:
        args.json_out.write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
