"""Public face of ``moeverify.spec.layout`` (Layout): the name scripts import, kept while the code lives in
the ``spec`` package. At run time this module *is* that module (one object: attributes, monkeypatches and
isinstance agree); type checkers read the explicit re-exports below (``tests/unit/test_public_types.py``)."""

import sys
from typing import TYPE_CHECKING

__all__ = ["Layout", "ModelShape", "parse_layout_name"]

if TYPE_CHECKING:
    from moeverify.spec.layout import Layout as Layout
    from moeverify.spec.layout import ModelShape as ModelShape
    from moeverify.spec.layout import parse_layout_name as parse_layout_name
else:
    from moeverify.spec import layout as _module

    sys.modules[__name__] = _module
