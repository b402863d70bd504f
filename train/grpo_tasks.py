"""The arithmetic tasks of `python -m train grpo` and their reward, computed on the device.

Tasks. The shipped arithmetic word problems (`jspec.prompts.math_problems`: six templates, one
to three operations, exact integer answers) are too hard for SmolLM2-135M-Instruct to learn
from: measured at T = 1 on 64 problems it answers 1.5-5% of them in any prompt format tried
(docs/RL.md). GRPO learns nothing from groups whose rewards are all 0, so the default task is
each problem's *first operation* ("first"), stated bare with its left-hand side already written
in the assistant's turn ("What is 27 + 12?" / "27 + 12 ="): about 30% correct at the start.
"full" keeps each problem's whole computation and its shipped answer ("(41 - 14) / 3 =").

Reward. 1 when the last number of the completion equals the answer, exactly as
`jspec.tasks.math_correct` reads it (the regex `-?\\d[\\d,]*(?:\\.\\d+)?`, commas dropped, a
trailing ".0" dropped), else 0. It runs inside the jitted RL step as a `lax.scan` over the
completion's tokens with a per-token class table (digit 0-9, comma, point, minus, other) built
once from the tokenizer: SmolLM2's tokenizer writes every digit as its own token, so a number is
a run of digit tokens. The host check (`math_correct` on the decoded text) is logged beside it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.errors import JspecError
from jspec.inputs import bucket_prompts
from jspec.prompts import math_problems

COMMA, POINT, MINUS, OTHER = 10, 11, 12, 13  # token classes; 0-9 are the digits
_CAP = 10 ** 8  # a longer number saturates here (no answer is that large)

# Per template (a word that names it): its first operation and its whole computation.
_TEMPLATES = (
    ("apples", "{a} + {b}", "{a} + {b} - {c}"),
    ("pencils", "{a} * {b}", "{a} * {b} - {c}"),
    ("pages", "{a} * {b}", "{a} * {b} + {c}"),
    ("km", "{a} * {b}", "{a} * {b} + {c}"),
    ("candies", "{a} - {c}", "({a} - {c}) // {b}"),
    ("notebooks", "{a} * {b}", "{c} - {a} * {b}"),
)


@dataclasses.dataclass(frozen=True)
class Tasks:
    """A task set, encoded once: every prompt right-padded to one width (one compile)."""

    ids: np.ndarray  # i32[T, W] chat prompt + the assistant's "EXPR =", right-padded
    lens: np.ndarray  # i32[T]
    answers: np.ndarray  # i32[T]
    texts: tuple[str, ...]  # the expressions, for logs


def expression(text: str, task: str) -> tuple[str, int]:
    """(the bare expression, its exact value) of a shipped word problem; task "first" | "full"."""
    a, b, c = (int(x) for x in re.findall(r"\d+", text)[:3])
    for word, first, full in _TEMPLATES:
        if f" {word}" in text:
            expr = (first if task == "first" else full).format(a=a, b=b, c=c)
            return expr.replace("//", "/"), int(eval(expr))  # our own digits
    raise JspecError(f"not a shipped arithmetic template: {text[:60]!r}")


def arithmetic_tasks(model: Any, n: int = 600, seed: int = 0, task: str = "first") -> Tasks:
    """`n` tasks from `jspec.prompts.math_problems(n, seed)`, encoded with `model`'s chat
    template. For task "full" the value equals the shipped answer (checked)."""
    if task not in ("first", "full"):
        raise JspecError(f"task must be 'first' or 'full', got {task!r}")
    rows = math_problems(n, seed)
    exprs, ids, answers = [], [], []
    for r in rows:
        expr, value = expression(r["text"], task)
        if task == "full" and str(value) != r["answer"]:
            raise JspecError(f"{expr} = {value}, but the shipped answer is {r['answer']}")
        exprs.append(expr)
        answers.append(value)
        ids.append(model.encode(f"What is {expr}?") + model.encode(f"{expr} =", chat=False))
    padded, lens = bucket_prompts(ids)
    return Tasks(padded, lens, np.asarray(answers, np.int32), tuple(exprs))


def token_classes(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """i32[V]: each token's class for `answer_reward` (0-9 a digit, COMMA, POINT, MINUS,
    OTHER). Refuses a tokenizer that merges digits (the scan reads one digit per token)."""
    cls = np.full(vocab_size, OTHER, np.int32)
    for tok, i in tokenizer.get_vocab().items():
        if i >= vocab_size:
            continue
        s = tok.replace("Ġ", " ")
        if len(s) == 1 and s in "0123456789":
            cls[i] = int(s)
        elif s == ",":
            cls[i] = COMMA
        elif s == ".":
            cls[i] = POINT
        elif s in ("-", " -"):
            cls[i] = MINUS
        elif re.search(r"[0-9][0-9]", s):
            raise JspecError(f"token {tok!r} holds several digits: the reward reads one a token")
    return cls


def answer_reward(tokens: jax.Array, answers: jax.Array, classes: jax.Array) -> jax.Array:
    """f32[B]: 1 where the last number of each completion equals its answer.

    Args:
      tokens: i32[B, N] completions, -1 after each row's end (and its EOS is "other").
      answers: i32[B] the exact integer answers.
      classes: i32[V] from `token_classes`.
    """
    cls = jnp.where(tokens >= 0, jnp.asarray(classes)[jnp.maximum(tokens, 0)], OTHER).T  # [N, B]
    zero = jnp.zeros(tokens.shape[:1], jnp.int32)
    false = zero.astype(bool)
    # The number being read: value, sign, integer digits, a leading 0, fraction digits, a
    # nonzero one among them; `last` is the same for the last number read.
    num = dict(val=zero - 1, neg=false, ilen=zero, lead0=false, flen=zero, fnz=false)
    # mode: 0 outside a number, 1 in its integer part, 2 just after its ".", 3 in its fraction
    init = dict(mode=zero, minus=false, cur=num, last=num)

    def scan(c: dict[str, Any], x: jax.Array) -> tuple[dict[str, Any], None]:
        cur, mode = c["cur"], c["mode"]
        digit = x <= 9
        start = digit & (mode == 0)
        whole = digit & (mode == 1)
        frac = digit & (mode >= 2)
        cur = dict(
            val=jnp.where(start, x, jnp.where(whole, jnp.minimum(cur["val"] * 10 + x, _CAP),
                                               cur["val"])),
            neg=jnp.where(start, c["minus"], cur["neg"]),
            ilen=jnp.where(start, 1, cur["ilen"] + whole),
            lead0=jnp.where(start, x == 0, cur["lead0"]),
            flen=jnp.where(start, 0, cur["flen"] + frac),
            fnz=jnp.where(start, False, cur["fnz"] | (frac & (x != 0))))
        mode = jnp.select([digit & (mode <= 1), digit, (x == COMMA) & (mode == 1),
                           (x == POINT) & (mode == 1)], [1, 3, 1, 2], 0)
        last = jax.tree.map(lambda a, b: jnp.where(digit, a, b), cur, c["last"])
        return dict(mode=mode, minus=x == MINUS, cur=cur, last=last), None

    c, _ = jax.lax.scan(scan, init, cls)
    last = c["last"]
    # "12.0" reads as 12 (math_correct drops a trailing ".0"); "12.5", "12.00", "012" are not
    # 12 (it compares the strings).
    whole = (last["flen"] == 0) | ((last["flen"] == 1) & ~last["fnz"])
    plain = ~last["neg"] & ~(last["lead0"] & (last["ilen"] > 1))
    ok = (last["val"] >= 0) & plain & whole & (last["val"] == answers)
    return ok.astype(jnp.float32)
