"""`lm_core.graph_priority.PriorityGraph` where it cannot run: each failure is a RuntimeError
naming its cause (`CudaGraphs` then warns and replays through torch). The launch itself is
checked on a GPU (`test_lm_graph_step_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

from lm_core import graph_priority


class _Graph:
    def raw_cuda_graph(self) -> int:
        return 1234


class _Driver:
    def __init__(self, rc: int) -> None:
        self.rc = rc
        self.flags = []

    def cuGraphInstantiateWithFlags(self, handle, graph, flags):  # noqa: N802 (the C name)
        self.flags.append(flags)
        return self.rc

    def cuGraphExecDestroy(self, handle):  # noqa: N802
        return 0


def test_a_torch_without_raw_graphs_is_named():
    with pytest.raises(RuntimeError, match="raw_cuda_graph"):
        graph_priority.PriorityGraph(object(), torch.device("cuda"))


def test_a_missing_driver_library_is_named(monkeypatch):
    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(graph_priority, "_driver", missing)
    with pytest.raises(RuntimeError, match=r"driver library could not be loaded.*libcuda"):
        graph_priority.PriorityGraph(_Graph(), torch.device("cuda"))


def test_a_driver_error_is_named_and_the_flag_is_node_priority(monkeypatch):
    driver = _Driver(rc=801)
    monkeypatch.setattr(graph_priority, "_driver", lambda: driver)
    with pytest.raises(RuntimeError, match=r"cuGraphInstantiateWithFlags failed.*801"):
        graph_priority.PriorityGraph(_Graph(), torch.device("cuda"))
    assert driver.flags == [8]  # CU_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
