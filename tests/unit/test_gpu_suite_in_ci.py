"""The GPU suite (scenarios/gpu.yaml) against what CI runs on CPU ranks.

Every family the GPU suite replays on one rank is replayed on one rank by `make test`'s scenario files (a subcheck
that only a one-rank run reaches, as token_counts on GPT-OSS did, is then seen in CI first), and every replay
subcheck the GPU suite runs on it runs on one rank in `make test` or `make release`. The scenario files of each
target are read from the Makefile's recipes and the families from the scenario files: nothing here names a family.
"""

from __future__ import annotations

import re
import shlex

import pytest

from moeverify.spec.checks import CHECKS
from moeverify.spec.scenario import load

GPU_SUITE = "scenarios/gpu.yaml"


def recipe_scenario_files(repo_root, target: str) -> list[str]:
    """The scenario files the ``moeverify run`` commands of a Makefile target's recipe are given, in order."""
    lines = (repo_root / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"{re.escape(target)}\s*:", line))
    files = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        words = shlex.split(line.strip())
        if "moeverify" in words and "run" in words[words.index("moeverify") :]:
            rest = words[words.index("moeverify") + 1 :]
            files += [w for w in rest[rest.index("run") + 1 :] if w.endswith((".yaml", ".yml"))]
    return files


def one_rank_replays(repo_root, files: list[str]) -> dict[str, set[str]]:
    """``{family: replay subchecks run on one rank}`` over the scenarios of ``files`` that run on CPU ranks."""
    out: dict[str, set[str]] = {}
    # one file at a time: a target's runs may repeat a scenario's name (one run per file group)
    for s in (s for f in files for s in load([str(repo_root / f)])):
        if "replay" in s.checks and s.world_size == 1 and s.gpu_only is None:
            out.setdefault(s.family, set()).update(CHECKS["replay"].selected_subchecks(s.options)[0])
    return out


@pytest.fixture
def gpu_suite(repo_root) -> dict[str, set[str]]:
    got = {}
    for s in load([str(repo_root / GPU_SUITE)]):
        if "replay" in s.checks:
            assert s.world_size == 1, f"{s.name}: the GPU suite is one GPU, one rank"
            got.setdefault(s.family, set()).update(CHECKS["replay"].selected_subchecks(s.options)[0])
    assert got, f"{GPU_SUITE} replays no family"
    return got


def test_the_targets_scenario_files_are_read_from_the_makefile(repo_root):
    for target in ("test", "release"):
        files = recipe_scenario_files(repo_root, target)
        assert "scenarios/release.yaml" in files, (target, files)
        assert all((repo_root / f).is_file() for f in files), files
    assert recipe_scenario_files(repo_root, "test") != recipe_scenario_files(repo_root, "release")


def test_every_family_the_gpu_suite_replays_has_a_one_rank_replay_in_make_test(repo_root, gpu_suite):
    ci = one_rank_replays(repo_root, recipe_scenario_files(repo_root, "test"))
    missing = sorted(set(gpu_suite) - set(ci))
    assert not missing, (
        f"{GPU_SUITE} replays {missing} on one rank, `make test`'s scenario files "
        f"{recipe_scenario_files(repo_root, 'test')} do not: add a world_size 1 replay scenario "
        "(scenarios/families_ci.yaml)"
    )


def test_every_replay_subcheck_of_the_gpu_suite_runs_on_one_rank_in_make_test_or_make_release(repo_root, gpu_suite):
    ci = one_rank_replays(repo_root, recipe_scenario_files(repo_root, "test"))
    release = one_rank_replays(repo_root, recipe_scenario_files(repo_root, "release"))
    unseen = {
        family: sorted(subchecks - ci.get(family, set()) - release.get(family, set()))
        for family, subchecks in gpu_suite.items()
    }
    assert not {f: s for f, s in unseen.items() if s}, unseen


def test_the_rule_reads_a_scenario_file_as_the_runner_does(repo_root, tmp_path):
    """A file of one family's replay at two ranks and one family's at one rank, narrowed to two subchecks."""
    (tmp_path / "s.yaml").write_text(
        "scenarios:\n"
        "  - {family: qwen3_moe, world_size: 2, layout: {ep: 2}, checks: [replay]}\n"
        "  - {family: olmoe, world_size: 1, checks: [replay], options: {replay_subchecks: [drift, weights]}}\n"
        "  - {family: gpt_oss, world_size: 1, checks: [replay], gpu_only: on a GPU only}\n"
    )
    assert one_rank_replays(tmp_path, ["s.yaml"]) == {"olmoe": {"drift", "weights"}}
