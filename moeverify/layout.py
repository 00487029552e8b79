"""Public face of ``moeverify.spec.layout`` (Layout): the name scripts import, kept while the code lives in
the ``spec`` package. This module *is* that module (one object: attributes, monkeypatches and isinstance agree)."""

import sys

from moeverify.spec import layout as _module

sys.modules[__name__] = _module
