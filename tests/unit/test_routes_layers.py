"""``Routes.from_rollout``'s ``layers``: global layer numbers, each once, ascending (router column order), or refused
naming the entry; a layer given twice would fold two columns into one layer's routes."""

from __future__ import annotations

import numpy as np
import pytest

from moeverify.errors import RouteError
from moeverify.routing.routes import Routes

E, K = 8, 2


def _ids(columns: int, tokens: int = 3):
    return np.zeros((tokens, columns, K), dtype=np.int64) + np.arange(K)


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ([0, 0], r"^layers=\[0, 0\]: layer 0 is given twice \(entries 0 and 1\); expected each MoE layer once$"),
        ([1, 3, 1], r"^layers=\[1, 3, 1\]: layer 1 is given twice \(entries 0 and 2\)"),
        (
            [3, 1],
            r"^layers=\[3, 1\]: entry 1 \(1\) comes after 3; expected the layers ascending, in router column order "
            r"\(MoE layers, then MTP layers\): \[1, 3\]$",
        ),
        ([0, -1], r"^layers=\[0, -1\]: entry 1 is -1; expected a global layer number \(an int >= 0\)$"),
        ([0, 1.0], r"entry 1 is 1\.0; expected a global layer number"),
        ([True, 2], r"entry 0 is True; expected a global layer number"),
        ([], r"^layers=\[\]: expected at least one global layer number"),
        ("01", r"^layers='01': expected a sequence of global layer numbers"),
        (3, r"^layers=3: expected a sequence of global layer numbers"),
    ],
)
def test_from_rollout_refuses_bad_layer_lists(layers, match):
    columns = len(layers) if isinstance(layers, list | str) else 1
    with pytest.raises(RouteError, match=match):
        Routes.from_rollout(_ids(max(columns, 1)), layers=layers, num_experts=E)
    with pytest.raises(RouteError, match=match):  # the several-requests form too
        Routes.from_rollout([_ids(max(columns, 1))], layers=layers, num_experts=E, lengths=[3])


def test_from_rollout_layers_of_any_integer_type_in_column_order_pass():
    routes = Routes.from_rollout(_ids(2), layers=np.array([1, 3]), num_experts=E, numbering="routers")
    assert routes.layers == (1, 3)
    assert Routes.from_rollout(_ids(2), layers=(np.int32(0), 2), num_experts=E, num_layers=4).layers == (0, 2)


def test_from_rollout_route_cut_short_is_named_not_out_of_range():
    # -1 in some slots of a real token's row (a variable top-k engine): not a capture gap, not an EPLB slot
    import pytest
    import torch

    from moeverify.errors import RouteError
    from moeverify.routing.routes import Routes

    ids = torch.tensor([[[0, 1]], [[2, -1]], [[3, 4]]])
    with pytest.raises(
        RouteError,
        match=r"token 1 MoE column 0: route \[2, -1\] has -1 \(not captured\) in 1 of its "
        r"2 slots \(1 such row\(s\)\): a variable top-k",
    ):
        Routes.from_rollout(ids, layers=[0], num_experts=8)
