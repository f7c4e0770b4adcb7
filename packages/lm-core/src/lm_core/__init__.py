"""A fast, readable Transformer language model and its training primitives (RMSNorm, RoPE, SwiGLU,
AdamW, checkpoints, trainer CLI).
"""

__version__ = "0.1.0"
