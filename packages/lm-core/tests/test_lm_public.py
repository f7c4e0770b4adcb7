"""The public names of lm_core (other packages and users code against them)."""

from __future__ import annotations

import lm_core

EXPECTED = {
    "AdamW",
    "MODEL_SIZES",
    "ModelConfig",
    "OverlappedOptimizer",
    "TrainConfig",
    "TransformerLM",
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
}


def test_exports():
    assert set(lm_core.__all__) == EXPECTED | {"__version__"}
    for name in lm_core.__all__:
        assert hasattr(lm_core, name), name


def test_module_paths_named_in_the_spec():
    from lm_core.activation_ckpt import apply_activation_checkpointing  # noqa: F401
    from lm_core.checkpoint import load_checkpoint, save_checkpoint  # noqa: F401
    from lm_core.compiling import compile_blocks  # noqa: F401
    from lm_core.data import get_batch  # noqa: F401
    from lm_core.flops import forward_flops, train_step_flops  # noqa: F401
    from lm_core.fused_loss import fused_linear_cross_entropy  # noqa: F401
    from lm_core.loss import cross_entropy  # noqa: F401
    from lm_core.model import MODEL_SIZES, ModelConfig, TransformerLM, get_config  # noqa: F401
    from lm_core.optim import AdamW, clip_grad_norm, cosine_lr  # noqa: F401
    from lm_core.optim_overlap import OverlappedOptimizer  # noqa: F401
    from lm_core.parallel import apply_tensor_parallel  # noqa: F401
    from lm_core.train import main, run  # noqa: F401
    from lm_core.train_config import TrainConfig  # noqa: F401
