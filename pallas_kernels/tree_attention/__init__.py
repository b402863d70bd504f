"""Tree-verification attention with a shared prefix (cascade form): Pallas kernels for TPU (Mosaic)
and GPU (Mosaic GPU) + jnp reference."""

from pallas_kernels.tree_attention.kernel import (
    MASK_VALUE,
    tree_attention,
    tree_attention_kernel,
    tree_attention_reference,
)
from pallas_kernels.tree_attention.kernel_mgpu import gpu_kernel_supports, tree_attention_mgpu
from pallas_kernels.tree_attention.tuned_block_sizes import (
    TUNED_BLOCK_KV,
    pick_block_kv,
    pick_block_kv_gpu,
)

__all__ = ["MASK_VALUE", "TUNED_BLOCK_KV", "gpu_kernel_supports", "pick_block_kv",
           "pick_block_kv_gpu", "tree_attention", "tree_attention_kernel", "tree_attention_mgpu",
           "tree_attention_reference"]
