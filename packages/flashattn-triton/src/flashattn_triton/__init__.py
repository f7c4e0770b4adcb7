"""FlashAttention-2 forward and backward in plain PyTorch and in Triton, usable as a torch.compile-
friendly custom op.
"""

__version__ = "0.1.0"
