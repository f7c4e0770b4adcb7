"""A fast, readable Transformer language model and its training primitives (RMSNorm, RoPE,
SwiGLU, AdamW, also stepped during the backward (`OverlappedOptimizer`), checkpoints,
activation checkpointing, a fused LM-head + cross-entropy, trainer CLI `python -m lm_core.train`
and its typed `TrainConfig`).
"""

from lm_core.activation_ckpt import apply_activation_checkpointing
from lm_core.annotate import annotate, annotations_enabled, set_annotations
from lm_core.attention import available_backends, get_attention
from lm_core.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from lm_core.compiling import compile_block_forwards, compile_blocks
from lm_core.config import MODEL_SIZES, ModelConfig, get_config
from lm_core.data import document_offsets, get_batch, load_tokens, synthetic_tokens
from lm_core.flops import forward_flops, train_step_flops
from lm_core.fused_loss import fused_linear_cross_entropy
from lm_core.loss import cross_entropy
from lm_core.model import TransformerLM
from lm_core.optim import AdamW, clip_grad_norm, cosine_lr
from lm_core.optim_overlap import OverlappedOptimizer
from lm_core.train_config import TrainConfig

__version__ = "0.1.0"

__all__ = [
    "MODEL_SIZES",
    "AdamW",
    "ModelConfig",
    "OverlappedOptimizer",
    "TrainConfig",
    "TransformerLM",
    "__version__",
    "annotate",
    "annotations_enabled",
    "apply_activation_checkpointing",
    "available_backends",
    "clip_grad_norm",
    "compile_block_forwards",
    "compile_blocks",
    "cosine_lr",
    "cross_entropy",
    "document_offsets",
    "forward_flops",
    "fused_linear_cross_entropy",
    "get_attention",
    "get_batch",
    "get_config",
    "load_checkpoint",
    "load_tokens",
    "read_checkpoint",
    "save_checkpoint",
    "set_annotations",
    "synthetic_tokens",
    "train_step_flops",
]
