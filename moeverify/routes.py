"""Public face of ``moeverify.routing.routes`` (Routes, safe_routes): the name scripts import, kept while the code lives
in the ``routing`` package. At run time this module *is* that module (one object: attributes, monkeypatches and
isinstance agree); type checkers read the explicit re-exports below (``tests/unit/test_public_types.py``)."""

import sys
from typing import TYPE_CHECKING

__all__ = ["PROVENANCES", "Routes", "safe_routes", "validate_topk_ids"]

if TYPE_CHECKING:
    from moeverify.routing.routes import PROVENANCES as PROVENANCES
    from moeverify.routing.routes import Routes as Routes
    from moeverify.routing.routes import safe_routes as safe_routes
    from moeverify.routing.routes import validate_topk_ids as validate_topk_ids
else:
    from moeverify.routing import routes as _module

    sys.modules[__name__] = _module
