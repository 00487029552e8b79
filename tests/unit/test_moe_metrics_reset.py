"""A model build starts megatron-core's process-global MoE metrics tracker afresh (``models.builder``)."""

import torch

from moeverify.models.builder import _fresh_moe_metrics


def test_a_build_after_a_smaller_model_gets_a_tracker_sized_by_its_own_routers():
    from megatron.core.transformer.moe import moe_logging

    old = moe_logging.get_moe_metrics_tracker()
    old.record("load_balancing_loss", torch.ones(()), layer_number=1, num_layers=4)  # a 4-router model
    old.clear()  # megatron's own reset keeps the size: a fifth router would index past it
    assert old.metrics["load_balancing_loss"].values.numel() == 4
    _fresh_moe_metrics()
    new = moe_logging.get_moe_metrics_tracker()
    assert new is not old and not new.metrics
    new.record("load_balancing_loss", torch.ones(()), layer_number=5, num_layers=5)  # an MTP router after 4 layers
    assert new.metrics["load_balancing_loss"].values.tolist() == [0, 0, 0, 0, 1]
    moe_logging.destroy_moe_metrics_tracker()
