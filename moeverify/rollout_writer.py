"""Public face of ``moeverify.routing.rollout_writer`` (RolloutWriter, mark_complete): the name scripts import, kept
while the code lives in the ``routing`` package. At run time this module *is* that module (one object: attributes,
monkeypatches and isinstance agree); type checkers read the explicit re-exports below
(``tests/unit/test_public_types.py``)."""

import sys
from typing import TYPE_CHECKING

__all__ = [
    "FORMAT",
    "MARKER",
    "NUMBERINGS",
    "VERSION",
    "RolloutWriter",
    "complete_steps",
    "mark_complete",
    "read_marker",
    "step_dir",
]

if TYPE_CHECKING:
    from moeverify.routing.rollout_writer import FORMAT as FORMAT
    from moeverify.routing.rollout_writer import MARKER as MARKER
    from moeverify.routing.rollout_writer import NUMBERINGS as NUMBERINGS
    from moeverify.routing.rollout_writer import VERSION as VERSION
    from moeverify.routing.rollout_writer import RolloutWriter as RolloutWriter
    from moeverify.routing.rollout_writer import complete_steps as complete_steps
    from moeverify.routing.rollout_writer import mark_complete as mark_complete
    from moeverify.routing.rollout_writer import read_marker as read_marker
    from moeverify.routing.rollout_writer import step_dir as step_dir
else:
    from moeverify.routing import rollout_writer as _module

    sys.modules[__name__] = _module
