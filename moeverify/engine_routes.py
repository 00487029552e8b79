"""Public face of ``moeverify.routing.engine_routes`` (the engine payload decoders): the name scripts import, kept while
the code lives in the ``routing`` package. This module *is* that module (one object: attributes, monkeypatches and
isinstance agree)."""

import sys

from moeverify.routing import engine_routes as _module

sys.modules[__name__] = _module
