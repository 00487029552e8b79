"""Public face of ``moeverify.routing.views`` (which tokens and layers a rank's routers see), plus the function
form of ``Routes.to_local`` / ``Routes.to_global`` that scripts call as ``views.to_local(routes, layout, ...)``.
The code lives in the ``routing`` package: ``views`` does the layout math and never sees a ``Routes``."""

from moeverify.routing.routes import Routes
from moeverify.routing.views import (
    RankCoords,
    all_rank_coords,
    chunk_layers,
    job_layout,
    layers_of,
    megatron_coords,
    rank_coords,
    sequence_positions,
    token_index,
    word_rows,
)

__all__ = [
    "RankCoords",
    "all_rank_coords",
    "chunk_layers",
    "job_layout",
    "layers_of",
    "megatron_coords",
    "rank_coords",
    "sequence_positions",
    "to_global",
    "to_local",
    "token_index",
    "word_rows",
]


def to_local(global_routes: Routes, layout, **where) -> Routes:
    """``global_routes.to_local(layout, coords=, seq_len=, batch=, num_layers=, zigzag=True)``."""
    return global_routes.to_local(layout, **where)


to_global = Routes.to_global
