"""How often an early exit after layer N agrees with SmolLM2-135M's own greedy token.

Runs the target greedily on HumanEval prompts 0-3 (96 new tokens, chat template), then applies
the final norm and LM head to every layer's hidden states over the generated positions (logit
lens) and prints the agreement with the full model's argmax per exit layer: the acceptance
rate an `early-exit:N` drafter can reach at its first drafted position (T=0).

    python scripts/early_exit_agreement.py
"""

import jax.numpy as jnp
import numpy as np

import jspec
from jspec.models.blocks import rms_norm
from jspec.models.cache import KVCache
from jspec.models.llama import forward, lm_logits
from jspec.prompts import humaneval

model = jspec.load_model("smollm2-135m")
cfg = model.config
layers = tuple(range(4, cfg.num_layers + 1, 2))
agree: dict[int, list[float]] = {n: [] for n in layers}
for row in humaneval()[:4]:
    ids = model.encode(row["text"])
    out = jspec.generate(model, np.asarray([ids], np.int32), max_new_tokens=96)
    seq = ids + [int(t) for t in np.asarray(out.tokens[0, : int(out.lengths[0])])]
    t = len(seq)
    fo = forward(cfg, model.weights, jnp.asarray([seq]), jnp.arange(t)[None],
                 KVCache.create(cfg, 1, t + 8), hidden_layers=layers)
    final = np.asarray(jnp.argmax(fo.logits[0], -1))[len(ids) - 1: t - 1]
    for j, n in enumerate(layers):
        h = rms_norm(fo.hidden[j], model.weights.final_norm, cfg.rms_eps)
        pred = np.asarray(jnp.argmax(lm_logits(cfg, model.weights, h)[0], -1))[len(ids) - 1: t - 1]
        agree[n].append(float(np.mean(pred == final)))
for n in layers:
    print(f"exit after layer {n:2d}: agreement {np.mean(agree[n]):.3f}")
