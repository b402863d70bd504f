"""Pallas kernels for jspec's hot spots, each with a same-signature pure-jnp reference.

- `pallas_kernels.tree_attention`: verification attention of T tree nodes to a shared cached
  prefix plus their ancestors (cascade form, online softmax).
- `pallas_kernels.relaxed_acceptance`: fused lossless / DIVERSED acceptance over vocabulary tiles.
- `python -m pallas_kernels.bench`: correctness and timing against the references.

Written for TPU (Mosaic); on CPU they run in interpret mode (`interpret=True`).
"""

__all__: list[str] = []
