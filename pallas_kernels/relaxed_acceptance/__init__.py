"""Fused relaxed (lossless / DIVERSED) acceptance over vocabulary tiles: Pallas kernels for TPU
(Mosaic) and GPU (Mosaic GPU) + jnp reference."""

from pallas_kernels.relaxed_acceptance.kernel import (
    MIN_TEMPERATURE,
    RESIDUAL_EPS,
    Acceptance,
    relaxed_acceptance,
)
from pallas_kernels.relaxed_acceptance.reference import relaxed_acceptance_reference
from pallas_kernels.relaxed_acceptance.tuned_block_sizes import (
    INTERPRET_BLOCK_B,
    TUNED_BLOCK_V,
    pick_block_b,
    pick_block_v,
)

__all__ = ["INTERPRET_BLOCK_B", "MIN_TEMPERATURE", "RESIDUAL_EPS", "TUNED_BLOCK_V", "Acceptance",
           "pick_block_b", "pick_block_v", "relaxed_acceptance", "relaxed_acceptance_reference"]
