"""Subjects of a user for test_export_refresh_default.py, loaded as ``path/stale_subject.py:NAME``.

``stale``: an exporter that caches what its first export converted and sends it again on every later export (the
``stale_conversion_cache`` mutant of ``moeverify/oracles/export/mutants.py``: a stale conversion cache; every
name, shape and position right, the weights the first step's forever). ``fresh``: the same exporter without the
cache (the reference sharded subject), the control.
"""

from moeverify.oracles.export.mutants import stale_conversion_cache
from moeverify.subjects import sharded


def stale(ctx):
    yield from stale_conversion_cache(ctx)


def fresh(ctx):
    yield from sharded(ctx)
