"""Public face of ``moeverify.routing.rollout_writer`` (RolloutWriter, mark_complete): the name scripts import, kept
while the code lives in the ``routing`` package. This module *is* that module (one object: attributes, monkeypatches and
isinstance agree)."""

import sys

from moeverify.routing import rollout_writer as _module

sys.modules[__name__] = _module
