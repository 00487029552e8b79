"""Public face of ``moeverify.routing.engine_routes`` (the engine payload decoders): the name scripts import, kept while
the code lives in the ``routing`` package. At run time this module *is* that module (one object: attributes,
monkeypatches and isinstance agree); type checkers read the explicit re-exports below
(``tests/unit/test_public_types.py``)."""

import sys
from typing import TYPE_CHECKING

__all__ = [
    "FILL",
    "NUMBERINGS",
    "SGLANG_READ",
    "WIRE_DTYPES",
    "EngineRoutes",
    "decode",
    "from_megatron",
    "from_sglang",
    "from_transformers",
    "from_trtllm",
    "from_vllm",
    "sglang_ids_physical",
    "splice",
]

if TYPE_CHECKING:
    from moeverify.routing.engine_routes import FILL as FILL
    from moeverify.routing.engine_routes import NUMBERINGS as NUMBERINGS
    from moeverify.routing.engine_routes import SGLANG_READ as SGLANG_READ
    from moeverify.routing.engine_routes import WIRE_DTYPES as WIRE_DTYPES
    from moeverify.routing.engine_routes import EngineRoutes as EngineRoutes
    from moeverify.routing.engine_routes import decode as decode
    from moeverify.routing.engine_routes import from_megatron as from_megatron
    from moeverify.routing.engine_routes import from_sglang as from_sglang
    from moeverify.routing.engine_routes import from_transformers as from_transformers
    from moeverify.routing.engine_routes import from_trtllm as from_trtllm
    from moeverify.routing.engine_routes import from_vllm as from_vllm
    from moeverify.routing.engine_routes import sglang_ids_physical as sglang_ids_physical
    from moeverify.routing.engine_routes import splice as splice
else:
    from moeverify.routing import engine_routes as _module

    sys.modules[__name__] = _module
