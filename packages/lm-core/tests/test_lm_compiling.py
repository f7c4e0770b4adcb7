"""`compile_block_forwards`: each block's forward compiled, its module hooks left eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lm_core import TransformerLM, compile_block_forwards, get_config


def _model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(get_config("tiny", context_length=16))


def test_hooks_run_eagerly_around_one_compiled_graph_and_names_stay():
    """A forward pre-hook (where zero_shard.FSDP gathers weights) runs on every call, outside
    the graph; one graph serves every block after the first (which has no previous block's
    branch to add, `model.chain_block`), one the first; outputs and state-dict keys are the
    eager model's."""
    eager, model = _model(), _model()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    calls = []  # per call: was the hook being traced? (block.compile() in place: True)
    model.layers[0].register_forward_pre_hook(
        lambda module, args: calls.append(torch.compiler.is_compiling())
    )
    assert compile_block_forwards(model, backend=backend) is model
    tokens = torch.randint(0, 64, (2, 16))
    for _ in range(3):
        torch.testing.assert_close(model(tokens), eager(tokens), rtol=0, atol=0)
    assert calls == [False] * 3
    assert len(graphs) == 2
    assert list(model.state_dict()) == list(eager.state_dict())


def test_refuses_wrappers_and_other_models():
    with pytest.raises(TypeError, match="wrapper"):
        compile_block_forwards(torch.compile(_model()))
    with pytest.raises(TypeError, match="layers"):
        compile_block_forwards(nn.Linear(2, 2))
