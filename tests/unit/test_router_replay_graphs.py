"""CUDA-graph capture and router replay: refused where the model was built to capture its layers, not where a config
was switched to ``cuda_graph_impl="local"`` after the build (Megatron-LM's RL loop does so around every rollout;
nothing is captured then). 1 CPU rank, a real megatron-core TopKRouter."""

from __future__ import annotations

import pytest
import torch
from seeded_router import seeded_router

from moeverify.errors import UsageError
from moeverify.patches import router_replay as rr

pytestmark = pytest.mark.usefixtures("patched_megatron_world")


def test_local_graphs_refused_only_where_the_model_holds_graph_managers():
    router = seeded_router(hidden=16, experts=8, topk=2, seed=0, layer=1, num_layers=2)
    chunk = torch.nn.ModuleDict({"router": router})
    rr.refuse_config(router, 0, disable_fusion=False)  # no graphs in the config
    router.config.cuda_graph_impl = "local"  # switched after the build: no layer holds a graph manager
    try:
        assert rr.graphs_built([chunk]) is False
        rr.refuse_config(router, 0, disable_fusion=False, graphs=rr.graphs_built([chunk]))
        with pytest.raises(UsageError, match=r"layer 0: CUDA-graph capture \(cuda_graph_impl='local'\)"):
            rr.refuse_config(router, 0, disable_fusion=False)  # the model unknown: judged from the config
        holder = torch.nn.Module()
        holder.cudagraph_manager = object()  # what megatron-core's layers carry when built to capture
        chunk["layer"] = holder
        assert rr.graphs_built([chunk]) is True
        with pytest.raises(UsageError, match=r"CUDA-graph capture"):
            rr.refuse_config(router, 0, disable_fusion=False, graphs=True)
        router.config.cuda_graph_impl = "transformer_engine"  # Transformer Engine's graphs: captured after build
        with pytest.raises(UsageError, match=r"cuda_graph_impl='transformer_engine'"):
            rr.refuse_config(router, 0, disable_fusion=False, graphs=False)
    finally:
        router.config.cuda_graph_impl = "none"
