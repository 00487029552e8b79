"""Worker pieces that run without torchrun: result validation and the RSS probe."""

from __future__ import annotations

import pytest

from moeverify.oracles.results import Tally
from moeverify.runner.worker import _tallies, peak_rss_mb


def test_tallies_accepts_dict_of_tally():
    tallies = {"bitwise": Tally()}
    assert _tallies(tallies, "roundtrip") is tallies


@pytest.mark.parametrize("bad", [None, [Tally()], {"bitwise": {"passed": True}}])
def test_tallies_rejects_other_results_naming_the_check(bad):
    with pytest.raises(TypeError, match=r"check 'roundtrip' must return dict\[str, Tally\], got "):
        _tallies(bad, "roundtrip")


def test_peak_rss_mb_is_this_process_in_megabytes():
    before = peak_rss_mb()
    blob = bytearray(64 * 1024 * 1024)
    blob[::4096] = b"x" * len(blob[::4096])  # touch every page
    assert peak_rss_mb() >= before and peak_rss_mb() > 60
