"""Pallas kernels for jspec's hot spots, each with a same-signature pure-jnp reference.

- `pallas_kernels.tree_attention`: verification attention of T tree nodes to a shared cached
  prefix plus their ancestors (cascade form, online softmax).
- `pallas_kernels.relaxed_acceptance`: fused lossless / DIVERSED acceptance over vocabulary tiles.
- `python -m pallas_kernels.bench`: correctness and timing against the references.

Each has a TPU (Mosaic) kernel, which on CPU runs in interpret mode (`interpret=True`), and a
Mosaic GPU kernel (`kernel_mgpu.py`, Hopper: WGMMA/TMA for attention, split-vocabulary streaming
for acceptance) that the same entry point calls on a GPU backend.
"""

__all__: list[str] = []
