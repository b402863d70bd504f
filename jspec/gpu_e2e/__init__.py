"""End to end on a GPU (issue 21): every speed number of jspec's decoding in one process.

Sections of the JSON (`--out FILE`, rewritten after every row, so a kill loses nothing):
  * `setup`: loading the target, the drafters and the prompt sets (one row each).
  * `autoregressive`: greedy tokens/s of SmolLM2-135M at batch 1, 16, 64 (`jspec.bench.decode_tps`:
    EOS ignored, compile excluded, prefill subtracted), per `attention_impl`.
  * `speculative`: lossless speculative decoding (`jspec.Lossless()`) on held-out HumanEval,
    GSM8K and MT-Bench prompts (the first `--prompts-per-set` of each held-out range in
    `train.datagen.SPLITS`), batch 1, one prompt at a time (as `jspec bench`): n-gram, EAGLE-3,
    DFlash at `--ks`, D²SD at its block; T = 0 and 1; "xla" and "pallas" attention. tokens/s,
    τ (`out.stats.mean_accepted()`), speedup over the autoregressive row of the same
    temperature and attention in the same run, and over the faster autoregressive row.
  * `cost_curve`: c(K) = t(K+1 tokens) / t(1) of the target and c(tree) = t(T nodes) / t(1) for
    binary trees of `--tree-sizes` nodes (`jspec.cost.cost_curve`), per attention impl.
  * `llama8b`: the same curves on a random-weight model of Llama-3-8B's shape (`--llama-layers`
    of its 32 layers), weights made directly in `--dtype` on the device.
  * `kernel_check`: the forward through the Pallas tree-attention kernel against the XLA path
    (same weights, a random-filled cache, a tree of the largest `--tree-sizes` nodes): logits
    error and argmax agreement, on both models.
Every row holds the device's memory statistics after it (`peak_bytes_in_use` is the process's
running peak: a row shows its own peak only where it raised it; null where the backend reports
none) and, if it failed, `"error"` (the run goes on). `--time-budget` stops starting new rows.
Rows run in priority order (batch-1 autoregressive, then T = 0 speculative rows at one K, the
cost curves, the 8B-shape model, the other batches, T = 1, the other Ks) so that a budget cut
drops the least needed.

    python -m jspec.gpu_e2e --out $OUT/gpu_e2e.json --time-budget 480     # on a GPU
    python -m jspec.gpu_e2e --tiny --out /tmp/gpu_e2e_tiny.json           # CPU dry run

Modules: `models` (random-weight models and drafters of a shape, --tiny's stand-ins), `report`
(the JSON recorder, provenance, markdown tables), `run` (the rows, their order, the command
line). (Until 2026-12-07 this was scripts/gpu_e2e.py.)
"""
