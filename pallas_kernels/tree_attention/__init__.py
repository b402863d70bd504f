"""Tree-verification attention with a shared prefix (cascade form): Pallas kernel + jnp reference."""

from pallas_kernels.tree_attention.kernel import (
    MASK_VALUE,
    tree_attention,
    tree_attention_kernel,
    tree_attention_reference,
)
from pallas_kernels.tree_attention.tuned_block_sizes import TUNED_BLOCK_KV, pick_block_kv

__all__ = ["MASK_VALUE", "TUNED_BLOCK_KV", "pick_block_kv", "tree_attention", "tree_attention_kernel",
           "tree_attention_reference"]
