"""Pictures of benchmark and training results (matplotlib, the optional `plot` extra).

`plot_bench(res, OUT.png)` draws a bench result (`python -m jspec bench --plot OUT.png`, or
later from its JSON: `python -m jspec plot BENCH.json OUT.png`): acceptance by draft position
per drafter, speedup and τ against K (tree drafters: against the nodes verified per round),
the verification cost curve c(K), and tokens/s against batch size when the JSON has rows with
a `batch` (`python -m jspec.gpu_e2e`'s autoregressive rows). `plot_training(log.jsonl, OUT.png)`
draws a `python -m train eagle3|dflash` run: loss and held-out simulated τ per step;
`plot_aot(report, OUT.png)` a `python -m jspec aot` report: c(T) and HBM read per program.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jspec.errors import JspecError


def _pyplot() -> Any:
    try:
        import matplotlib  # noqa: PLC0415 (heavy optional dependency)
    except ImportError as e:
        raise JspecError("plotting needs matplotlib: pip install 'jspec[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _label(row: dict[str, Any]) -> str:
    v = row.get("verifier") or "lossless"
    extra = "" if v == "lossless" else f" {v}"
    dt = f" {row['dtype']}" if row.get("dtype") not in (None, "float32") else ""
    return f"{row['drafter']}{extra}{dt} T={row['temperature']:g}"


def _spec_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    spec = res.get("speculative") or {}
    return [r for r in spec.get("rows", []) if r.get("k") and "tau" in r]


def _x_of(row: dict[str, Any], tree_c: dict[str, Any]) -> tuple[float, str]:
    """(x position, kind): K for chains, nodes per round for trees, mean length for dynamic
    length policies (their k is the policy's spec string)."""
    k = row["k"]
    if isinstance(k, str):
        return float(row.get("mean_length") or 0.0), "dynamic"
    tree = tree_c.get(f"{row['drafter']}@{k}")
    if tree:
        return float(tree["nodes"]), "tree"
    return float(k), "chain"


def _batch_rows(obj: Any) -> Iterator[dict[str, Any]]:
    """Rows with a batch size and a tokens/s anywhere in a JSON document."""
    if isinstance(obj, dict):
        if "batch" in obj and isinstance(obj.get("tokens_per_s"), (int, float)):
            yield obj
        for v in obj.values():
            yield from _batch_rows(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _batch_rows(v)


def _cost_curves(res: dict[str, Any]) -> list[tuple[str, list[int], list[float]]]:
    base = res.get("baseline") or {}
    curves = []
    for key, label, field in (("jspec_c", "jspec float32", "c"),
                              ("jspec_c_bf16", "jspec bfloat16", "c"),
                              ("hf_c", "HF transformers float32", "ratio")):
        if key in base:
            pts = sorted((int(k), float(v)) for k, v in base[key][field].items())
            curves.append((label, [p[0] for p in pts], [p[1] for p in pts]))
    spec = res.get("speculative") or {}
    if not curves and spec.get("cost"):
        pts = sorted((int(k), float(v)) for k, v in spec["cost"]["c"].items())
        curves.append((f"jspec {spec.get('dtype', 'float32')}", [p[0] for p in pts],
                       [p[1] for p in pts]))
    return curves


def _title(res: dict[str, Any]) -> str:
    spec = res.get("speculative") or {}
    prov = res.get("provenance") or {}
    dev = prov.get("device_kind")
    if dev and prov.get("device_count", 1) > 1:
        dev = f"{prov['device_count']} x {dev}"
    where = ", ".join(str(x) for x in (
        dev, prov.get("cpu") and f"{prov['cpu']} ({prov.get('cpu_count')} cores)",
        prov.get("jax") and f"jax {prov['jax']}", prov.get("dtype")) if x)
    what = (f"{spec.get('prompts')}, {spec.get('new_tokens')} new tokens, "
            f"median of {spec.get('repeats')}" if spec else "baseline")
    return f"jspec bench: {what}" + (f"\n{where}" if where else "")


def plot_bench(res: dict[str, Any], out: str | Path) -> Path:
    """Draw a bench result (the dict `jspec.bench.main` writes as JSON) into a PNG.

    Returns:
      the path written. Panels without data in `res` are left out.
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 (matplotlib, optional)

    rows = _spec_rows(res)
    tree_c = (res.get("speculative") or {}).get("tree_c") or {}
    curves = _cost_curves(res)
    batch = list(_batch_rows(res))
    panels = []
    if rows:
        panels += ["accept", "speedup", "tau"]
    if curves or tree_c:
        panels.append("cost")
    if batch:
        panels.append("batch")
    if not panels:
        raise JspecError("nothing to plot: the JSON has no speculative rows, cost curve or "
                         "batch rows")
    ncol = min(3, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.6 * ncol, 4.2 * nrow), squeeze=False)
    flat = [a for r in axes for a in r]
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    markers = {"chain": "o", "tree": "s", "dynamic": "x"}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(_label(r), []).append(r)
    colors = {g: f"C{i % 10}" for i, g in enumerate(groups)}
    for ax, panel in zip(flat, panels, strict=False):
        if panel in ("accept", "speedup", "tau"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if panel == "accept":
            for g, rs in groups.items():
                r = max((x for x in rs if not isinstance(x["k"], str)), default=rs[0],
                        key=lambda x: len(x.get("accept_by_position") or []))
                acc = r.get("accept_by_position") or []
                if acc:
                    ax.plot(range(1, len(acc) + 1), acc, marker="o", color=colors[g],
                            label=f"{g} (K={r['k']})")
            ax.set(title="Acceptance by draft position", xlabel="draft position k",
                   ylabel="fraction of rounds accepting position k", ylim=(0, 1.02))
        elif panel in ("speedup", "tau"):
            field = "speedup_over_best_ar" if panel == "speedup" else "tau"
            for g, rs in groups.items():
                pts = sorted((*_x_of(r, tree_c), r.get(field) or r.get("speedup")) for r in rs)
                for kind in ("chain", "tree", "dynamic"):
                    sel = [(x, y) for x, k, y in pts if k == kind and y is not None]
                    if sel:
                        ax.plot([p[0] for p in sel], [p[1] for p in sel], marker=markers[kind],
                                color=colors[g], linestyle="-" if kind != "dynamic" else "none",
                                label=g if kind == "chain" or len(pts) == len(sel) else
                                f"{g} ({kind})")
            if panel == "speedup":
                ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle="--")
                ax.set(title="Speedup over the best autoregressive row",
                       xlabel="K drafted (chain) / tree nodes verified", ylabel="speedup")
            else:
                ax.set(title="τ: tokens per target forward", xlabel="K drafted (chain) / "
                       "tree nodes verified", ylabel="τ")
        elif panel == "cost":
            for label, ks, cs in curves:
                ax.plot(ks, cs, marker="o", label=label)
            for name, c in tree_c.items():
                ax.plot([c["nodes"]], [c["c"]], marker="s", linestyle="none",
                        label=f"{name} tree")
            ks = sorted({k for _, kk, _ in curves for k in kk}
                        | {int(c["nodes"]) for c in tree_c.values()} | {1})
            top = max([max(cs) for _, _, cs in curves] + [c["c"] for c in tree_c.values()])
            ax.plot(ks, ks, color="0.7", linewidth=0.8, linestyle=":",
                    label="c(K) = K (no batching gain)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks, [str(k) for k in ks])
            ax.set(title="Verification cost c(K) = t(K) / t(1)", xlabel="tokens per forward K",
                   ylabel="c(K)", ylim=(0.8, 1.25 * top))
        elif panel == "batch":
            series: dict[str, list[tuple[int, float]]] = {}
            for r in batch:
                tag = " ".join(str(r[k]) for k in ("engine", "attention_impl", "weights",
                                                   "dtype") if r.get(k)) or "tokens/s"
                series.setdefault(tag, []).append((int(r["batch"]), float(r["tokens_per_s"])))
            for tag, pts in series.items():
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=tag)
            ax.set(title="Throughput against batch size", xlabel="batch", ylabel="tokens/s",
                   xscale="log")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(_title(res), fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_training(log: str | Path, out: str | Path) -> Path:
    """Loss and held-out τ (simulated; greedy decoding replayed) per step of a `python -m
    train` run's log.jsonl; for a `train grpo` log (its records hold `reward`), the rollouts'
    reward (each step and its 10-step mean) instead of the surrogate loss, and their τ."""
    plt = _pyplot()
    recs = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    if not recs:
        raise JspecError(f"{log} holds no steps")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    # A fine-tune's step 0 holds only the held-out evaluation of the starting drafter.
    trained = [r for r in recs if "loss" in r]
    rl = all("reward" in r for r in trained)
    key = "reward" if rl else "loss"
    a.plot([r["step"] for r in trained], [r[key] for r in trained], linewidth=0.8,
           label="rollouts' reward" if rl else "training loss")
    if rl and len(trained) >= 10:
        ys = np.convolve([r["reward"] for r in trained], np.ones(10) / 10, mode="valid")
        a.plot([r["step"] for r in trained][9:], ys, linewidth=1.8, label="10-step mean")
    held = [r for r in recs if "heldout_loss" in r]
    if held:
        a.plot([r["step"] for r in held], [r["heldout_loss"] for r in held], marker="o",
               linewidth=1.5, label="held-out loss")
    a.set(title="Reward" if rl else "Loss", xlabel="step", ylabel=key)
    for key, label in (("tau_sim", "training batch (simulated)"),
                       ("heldout_tau_sim", "held-out (simulated)"),
                       ("heldout_tau_replay", "held-out (greedy decoding replayed)"),
                       ("tau", "rollouts (measured; train grpo)")):
        pts = [(r["step"], r[key]) for r in recs if key in r]
        if pts:
            b.plot([p[0] for p in pts], [p[1] for p in pts],
                   marker="o" if key.startswith("heldout") else None,
                   linewidth=0.8 if not key.startswith("heldout") else 1.5, label=label)
    b.set(title="τ (tokens per target forward)", xlabel="step", ylabel="τ")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"training run {Path(log).parent.name}", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_aot(rep: dict[str, Any], out: str | Path) -> Path:
    """A TPU report (`python -m jspec aot --plot OUT.png`, or its JSON): the modelled verify
    cost c(T) of chains and trees against the nodes per forward, and the HBM bytes each
    program reads per chip against the step's byte floor (all modelled)."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for tree, label in ((False, "chain"), (True, "tree")):
        pts = sorted((r["t"], r["c_modelled"]) for r in rep["programs"]
                     if r["tree"] == tree and r.get("c_modelled"))
        if pts:
            a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    a.set(title="verify cost c(T) (modelled)", xlabel="tokens per forward T",
          ylabel="forward time / AR step", xscale="log")
    rows = [r for r in rep["programs"] if r.get("ok")]
    names = [f"{'tree' if r['tree'] else 'chain'} {r['t']}" for r in rows]
    b.bar(range(len(rows)), [r["hbm_bytes_read"] / 1e9 for r in rows])
    b.axhline(rep["byte_floor_per_chip"] / 1e9, color="k", linestyle="--", label="byte floor")
    b.set_xticks(range(len(rows)), names, rotation=60, fontsize=7)
    b.set(title="HBM read per chip (modelled)", ylabel="GB")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{rep['model']} on {rep['topology']}, batch {rep['batch']}, context "
                 f"{rep['context']}, {rep.get('layers', 'unrolled')} layers", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(args: Any) -> int:
    """`python -m jspec plot BENCH.json OUT.png` (a training log.jsonl or a `jspec aot` report
    also works)."""
    src = Path(args.json)
    if not src.is_file():
        raise JspecError(f"{src} not found")
    if src.suffix == ".jsonl":
        path = plot_training(src, args.out)
    else:
        try:
            res = json.loads(src.read_text())
        except ValueError as e:
            raise JspecError(f"{src} is not JSON: {e}") from e
        path = plot_aot(res, args.out) if "byte_floor_per_chip" in res else plot_bench(
            res, args.out)
    print(f"wrote {path}")
    return 0
