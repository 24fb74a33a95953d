"""The kernels the model families call, and the one place that chooses them for the platform.

Model files call `causal_attention` (with a `TokenMask`), `dense` and `project` and read as the math; what runs
is chosen here from the mesh's devices and $JTRAINER_ATTENTION: Pallas' splash attention on TPUs
(`splash_attention`), cuDNN's fused attention on GPUs, XLA's or a CPU-friendly blocked formulation on CPUs
(`attention`), and on CPUs a matmul whose weight gradient runs at GEMM speed (`dense`).
"""

from jtrainer.models.kernels.attention import TokenMask, causal_attention, causal_mask, implementation
from jtrainer.models.kernels.dense import cpu_backend, dense, dense_dot_general, dense_transposed, project

__all__ = [
    "TokenMask",
    "causal_attention",
    "causal_mask",
    "cpu_backend",
    "dense",
    "dense_dot_general",
    "dense_transposed",
    "implementation",
    "project",
]
