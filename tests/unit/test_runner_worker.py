"""Worker pieces that run without torchrun: result validation and the RSS probe."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from waiting import CHILD_S

from moeverify.oracles.results import Tally
from moeverify.runner.worker import _tallies


def test_tallies_accepts_dict_of_tally():
    tallies = {"bitwise": Tally()}
    assert _tallies(tallies, "roundtrip") is tallies


@pytest.mark.parametrize("bad", [None, [Tally()], {"bitwise": {"passed": True}}])
def test_tallies_rejects_other_results_naming_the_check(bad):
    with pytest.raises(TypeError, match=r"check 'roundtrip' must return dict\[str, Tally\], got "):
        _tallies(bad, "roundtrip")


@pytest.mark.timing
def test_peak_rss_mb_is_this_process_in_megabytes():
    # A fresh process, then 256 MiB touched page by page: its own peak must rise by about 256 in the unit
    # reported. A value in KiB or bytes, or a peak inherited from the parent (ru_maxrss), is far off.
    code = textwrap.dedent("""
        from moeverify.runner.worker import peak_rss_mb
        before = peak_rss_mb()
        blob = bytearray(256 * 1024 * 1024)
        blob[::4096] = b"x" * len(blob[::4096])
        print(peak_rss_mb() - before)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_S, check=True)
    assert 200 <= float(out.stdout) <= 300, out.stdout  # below 256 where the import peaked above its final size
