"""The record of `python -m jspec.gpu_e2e`: rows run one by one under a time budget, the JSON
rewritten after each (a kill loses nothing), provenance, speedups, and the markdown tables."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jspec.memory import device_stats
from jspec.provenance import ROOT
from jspec.provenance import provenance as base_provenance

SECTIONS = ("setup", "autoregressive", "speculative", "cost_curve", "llama8b", "kernel_check")
LABELS = {"ngram": "n-gram", "eagle3": "EAGLE-3", "dflash": "DFlash", "d2sd": "D²SD"}


# ---------------------------------------------------------------------------------------------
# Recording


def provenance(argv: list[str], dtype: str) -> dict[str, Any]:
    """Where and how this run happened: `jspec.provenance.provenance` (machine, device, versions,
    the command line, git commit, XLA flags, time) plus the raw argv, whether the checkout had
    uncommitted changes (None where it has no .git) and $JSPEC_CACHE."""
    prov = base_provenance(dtype=dtype, argv=["-m", "jspec.gpu_e2e", *argv])
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                             capture_output=True, text=True, timeout=10)
        dirty = bool(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        dirty = None
    prov.update(argv=argv, git_dirty=dirty, jspec_cache=os.environ.get("JSPEC_CACHE"))
    return prov


@dataclasses.dataclass
class Recorder:
    """Runs rows one by one under the time budget; every row is written to the JSON at once."""

    doc: dict[str, Any]
    out: Path | None
    budget: float | None
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def write(self) -> None:
        """Rewrite the JSON atomically (a kill mid-write leaves the previous version)."""
        self.doc["status"]["elapsed_s"] = round(self.elapsed(), 3)
        if self.out is None:
            return
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=_jsonable))
        tmp.replace(self.out)

    def run(self, section: str, name: str, fn: Callable[[], dict[str, Any]],
            meta: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Run one row: fn() -> fields; an exception becomes the row's "error" and the run goes on.

        Returns the row, or None when the time budget stopped it from starting.
        """
        if self.budget is not None and self.elapsed() >= self.budget:
            self.doc["status"]["stopped_early"] = True
            self.doc["status"]["skipped"].append(f"{section}/{name}")
            self.write()
            return None
        row: dict[str, Any] = {"name": name, **(meta or {})}
        self.doc["status"]["running"] = f"{section}/{name}"  # a kill mid-row says which row
        self.write()
        before = device_stats()
        t = time.perf_counter()
        try:
            row.update(fn())
            row["error"] = None
        except Exception as e:  # a compile error, an OOM, a missing file: record and go on
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-3000:]
        row["seconds"] = round(time.perf_counter() - t, 3)
        row["memory"] = device_stats()
        row["memory_before"] = before
        self.doc[section].append(row)
        self.doc["status"]["running"] = None
        finish_speedups(self.doc)
        self.write()
        status = "ERROR " + row["error"][:160] if row["error"] else "ok"
        print(f"[{self.elapsed():7.1f}s] {section}/{name}: {status} ({row['seconds']:.1f}s)",
              flush=True)
        return row


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def finish_speedups(doc: dict[str, Any]) -> None:
    """Speedups of speculative rows over the autoregressive row of the same T and attention
    (and over the fastest autoregressive row of that T), overall and per prompt set."""
    ar = {(r["temperature"], r["attention_impl"]): r for r in doc["speculative"]
          if r["drafter"] == "autoregressive" and not r["error"]}
    for r in doc["speculative"]:
        if r["error"]:
            continue
        same = ar.get((r["temperature"], r["attention_impl"]))
        best = max((a["tokens_per_s"] for (t, _), a in ar.items() if t == r["temperature"]),
                   default=None)
        r["speedup"] = r["tokens_per_s"] / same["tokens_per_s"] if same else None
        r["speedup_vs_best_ar"] = r["tokens_per_s"] / best if best else None
        for s, v in r["per_set"].items():
            base = same["per_set"].get(s) if same else None
            v["speedup"] = v["tokens_per_s"] / base["tokens_per_s"] if base else None


def _f(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _mib(row: dict[str, Any]) -> str:
    peak = (row.get("memory") or {}).get("peak_bytes_in_use")
    return _f(None if peak is None else peak / 2**20, ".0f")


def markdown(doc: dict[str, Any]) -> str:
    """The JSON's rows as markdown tables (errors listed at the end)."""
    out: list[str] = []

    def table(title: str, header: list[str], rows: list[list[str]]) -> None:
        if not rows:
            return
        out.extend([f"\n### {title}\n", "| " + " | ".join(header) + " |",
                    "|" + "---|" * len(header)])
        out.extend("| " + " | ".join(r) + " |" for r in rows)

    ok = [r for r in doc["autoregressive"] if not r["error"]]
    table("Autoregressive (greedy, EOS ignored, prefill subtracted)",
          ["batch", "attention", "weights", "decode tokens/s", "end-to-end tokens/s",
           "peak MiB"],
          [[str(r["batch"]), r["attention_impl"], r["weights"], _f(r["tokens_per_s"], ".1f"),
            _f(r["end_to_end_tokens_per_s"], ".1f"), _mib(r)] for r in ok])
    ok = sorted((r for r in doc["speculative"] if not r["error"]),
                key=lambda r: (r["temperature"], r["attention_impl"], r["drafter"] != "autoregressive",
                               r["drafter"], r["k"] or 0))
    sets = list(dict.fromkeys(s for r in ok for s in r["per_set"]))
    table("Speculative decoding (lossless, batch 1)",
          ["T", "attention", "drafter", "K", "tokens/s", "speedup", "vs best AR", "τ",
           *[f"τ {s}" for s in sets], "peak MiB"],
          [[f"{r['temperature']:g}", r["attention_impl"], LABELS.get(r["drafter"], r["drafter"]),
            str(r["k"]) if r["k"] else "–", _f(r["tokens_per_s"], ".1f"),
            _f(r.get("speedup"), ".2f", "×"), _f(r.get("speedup_vs_best_ar"), ".2f", "×"),
            _f(r["tau"]), *[_f(r["per_set"].get(s, {}).get("tau")) for s in sets], _mib(r)]
           for r in ok])
    for section, title in (("cost_curve", "Verify cost, target"),
                           ("llama8b", "Verify cost, {shape} shape, {layers} layers, random weights")):
        rows = [r for r in doc[section] if not r["error"] and "points" in r]
        if rows and section == "llama8b":
            title = title.format(shape=rows[0]["shape"], layers=rows[0]["layers"])
        for kind, key in (("chain", "K"), ("tree", "nodes")):
            sub = [r for r in rows if r.get("mask", r.get("kind")) == kind]
            cols = list(dict.fromkeys(p[key] for r in sub for p in r["points"]))
            table(f"{title}: c({key}) = t({'K+1 tokens' if kind == 'chain' else 'tree'}) / t(1), "
                  f"fill {sub[0]['fill'] if sub else ''}",
                  ["attention", "t(1) ms", *[f"{key}={c}" for c in cols]],
                  [[r["attention_impl"], _f(r["ms_1"], ".3f"),
                    *[_f(next((p["c"] for p in r["points"] if p[key] == c), None)) for c in cols]]
                   for r in sub])
    ok = [r for r in doc["kernel_check"] if not r["error"]]
    table("Pallas tree attention inside the forward vs XLA",
          ["model", "nodes", "fill", "max abs err (logits)", "rel err", "argmax agree"],
          [[r["model"], str(r["nodes"]), str(r["fill"]), _f(r["max_abs_err"], ".3g"),
            _f(r["rel_err"], ".3g"), _f(r["argmax_agree"], ".3f")] for r in ok])
    errs = [(s, r) for s in SECTIONS for r in doc[s] if r["error"]]
    table("Errors", ["section", "row", "error"],
          [[s, r["name"], r["error"][:200].replace("|", "/").replace("\n", " ")]
           for s, r in errs])
    st = doc["status"]
    out.append(f"\n{doc['provenance']['device_kind']} × {doc['provenance']['device_count']}, "
               f"jax {doc['provenance']['jax']}, {doc['config']['dtype']}; "
               f"{st['elapsed_s']:.0f} s; stopped early: {st['stopped_early']}"
               + (f" ({len(st['skipped'])} rows not started)" if st["skipped"] else ""))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Command line
