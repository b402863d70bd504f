"""Pallas kernels for jspec's hot spots (tree-verification attention, fused relaxed acceptance).

No kernel has landed yet: jspec runs on its pure-JAX paths (`jspec.models.llama`,
`jspec.verify`). Each kernel will arrive as a subpackage with a same-signature jnp reference.
"""

__all__: list[str] = []
