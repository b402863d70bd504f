"""`python -m train`: drafter and verifier-weight training for jspec.

Data: `datagen` (the target's own answers and hidden states), `featurize`, `magpie`; shared
setup and batching in `data` and `batches`. Drafters: `recipes` (what differs per kind),
`losses`, `update` (the optimizer step, mesh placement), `evaluation` (held-out replay τ),
`loop` (Optax, Orbax resume), `drafters` (the `eagle3` / `dflash` run; flags in
`drafter_cli`), `d2sd`; verifier weights: `diversed`, `qtemp`; `export`, `aot`.
"""
