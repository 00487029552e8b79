"""What a check receives: the scenario, this rank's place, the run's options, and a lazily built model."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from moeverify import models
from moeverify.spec import timeouts

if TYPE_CHECKING:  # the runner hands a check its Scenario; nothing here runs scenario code
    from moeverify.spec.scenario import Scenario


@dataclasses.dataclass(kw_only=True)
class CheckContext:
    """Handed to every check on every rank.

    ``options`` holds the check options given on the command line (``subject``, ``replay_impl``, ...) merged
    over the scenario's own ``options``; each check reads its own through its options dataclass
    (``moeverify.spec.checks``). ``timeout_s`` is the run's per-scenario deadline (``--timeout``).
    """

    scenario: Scenario
    rank: int
    world_size: int
    backend: str
    options: dict[str, Any]
    timeout_s: float = timeouts.SCENARIO_S
    _built: Any = None

    def model(self):
        """The scenario's model built under its layout (``moeverify.models.build``), cached per scenario."""
        if self._built is None:
            self._built = models.build(self.scenario.model, self.scenario.layout, seed=self.scenario.seed)
        return self._built
