"""Shared unit-test fixtures."""

import pytest

from moeverify.layout import Layout


@pytest.fixture(scope="module")
def patched_megatron_world():
    """A 1-rank cpu+gloo world with megatron's parallel state set and the router-replay patch applied."""
    from moeverify import runtime
    from moeverify.patches import router_replay as rr

    runtime.init("cpu")
    with runtime.parallel(Layout(), seed=0):
        rr.apply()
        try:
            yield
        finally:
            rr.revert()
