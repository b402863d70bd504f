"""Table of the VAT ablation runs (scripts/vat_ablation_corpus.sh): the last held-out tau_sim and
acc@1 of runs/vabl-<variant>-s<seed>/log.jsonl per seed, each seed's change against base with
the same seed (paired: a seed fixes the initialisation, the batches and the held-out anchors),
their mean, and the mean tau_sim. `python scripts/vat_ablation_table.py [RUNS_DIR] [METRIC]`
(METRIC: a held-out field of the log, default heldout_tau_sim; e.g. heldout_tau_replay)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

VARIANTS = {"base": "base", "head": "+ verification head", "weight": "+ adaptive weighting",
            "both": "+ both (--vat)"}


def last_eval(log: Path) -> dict[str, float] | None:
    recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    held = [r for r in recs if "heldout_acc1" in r]
    return held[-1] if held else None


def main(root: Path, metric: str = "heldout_tau_sim") -> None:
    runs = {}
    for v in VARIANTS:
        for d in sorted(root.glob(f"vabl-{v}-s*")):
            ev = last_eval(d / "log.jsonl") if (d / "log.jsonl").is_file() else None
            if ev is not None:
                runs.setdefault(v, {})[d.name.rsplit("-s", 1)[1]] = ev
    seeds = sorted({s for r in runs.values() for s in r})
    base = runs.get("base", {})
    name = metric.removeprefix("heldout_")
    print("| variant | step | " + " | ".join(f"{name} seed {s} (vs base)" for s in seeds)
          + f" | mean {name} | mean change vs base | mean acc@1 |")
    print("|---" * (5 + len(seeds)) + "|")
    for v, label in VARIANTS.items():
        r = runs.get(v, {})
        if not r:
            continue
        tau = statistics.mean(e[metric] for e in r.values())
        acc = statistics.mean(e.get("heldout_acc1", float("nan")) for e in r.values())
        change = {s: r[s][metric] / base[s][metric] - 1
                  for s in r if s in base and v != "base"}
        cells = [(f"{r[s][metric]:.3f}" + (f" ({100 * change[s]:+.1f}%)"
                                                       if s in change else "")) if s in r else "-"
                 for s in seeds]
        vs = f"{100 * statistics.mean(change.values()):+.1f}%" if change else "-"
        step = max(e["step"] for e in r.values())
        print(f"| {label} | {step} | " + " | ".join(cells) + f" | {tau:.3f} | {vs} | {acc:.3f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs"), *sys.argv[2:3])
