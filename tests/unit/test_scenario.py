"""Scenario files: the format, and every way a file can be wrong (each with its message)."""

from __future__ import annotations

import hashlib
import textwrap

import pytest

from moeverify.errors import UsageError
from moeverify.models import families as model_families
from moeverify.spec.layout import Layout
from moeverify.spec.scenario import group_by_world_size, load, scenario_from_dict, scenario_to_dict

CHECKS = ("roundtrip", "export", "replay", "hf_parity")
FAMILIES = {name: model_families.family_shape(name) for name in model_families.FAMILIES}


def _write(tmp_path, text: str, name: str = "s.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _load(tmp_path, text: str, **kwargs):
    return load([_write(tmp_path, text)], checks=CHECKS, families=FAMILIES, **kwargs)


def test_load_explicit_scenario_builds_named_scenario(tmp_path):
    (s,) = _load(
        tmp_path,
        """
        scenarios:
          - {family: qwen3_moe, world_size: 4, layout: {pp: 2, ep: 2}, checks: [export], seed: 3,
             options: {subject: sharded}}
    """,
    )
    assert s.name == "qwen3_moe/pp2-ep2-dp2"
    assert (s.layout, s.world_size, s.checks, s.seed) == (Layout(pp=2, ep=2), 4, ("export",), 3)
    assert s.options == {"subject": "sharded"} and s.gpu_only is None
    assert s.source.endswith("s.yaml:3")


def test_load_defaults_apply_and_entries_override(tmp_path):
    a, b = _load(
        tmp_path,
        """
        defaults: {world_size: 2, checks: [roundtrip], options: {subject: bridge}}
        scenarios:
          - {family: qwen2, layout: {tp: 2}}
          - {family: qwen2, layout: {pp: 2}, checks: [export], options: {replay_impl: native}}
    """,
    )
    assert (a.world_size, a.checks, a.options) == (2, ("roundtrip",), {"subject": "bridge"})
    assert b.checks == ("export",)
    assert b.options == {"subject": "bridge", "replay_impl": "native"}


def test_load_matrix_dense_families_skip_expert_layouts(tmp_path):
    got = _load(
        tmp_path,
        """
        defaults: {checks: [roundtrip], moe_checks: [replay]}
        matrix:
          - families: [qwen2, qwen3_moe]
            world_size: 2
            layouts: [{tp: 2, sp: moe}, {ep: 2}, {etp: 2}, {pp: 2, world_size: 4, gpu_only: needs NCCL}]
    """,
    )
    by_name = {s.name: s for s in got}
    assert sorted(by_name) == sorted(
        [
            "qwen2/tp2",
            "qwen3_moe/tp2-sp",
            "qwen3_moe/ep2-dp2",
            "qwen3_moe/etp2-dp2",
            "qwen2/pp2-dp2",
            "qwen3_moe/pp2-dp2",
        ]
    )
    assert by_name["qwen2/tp2"].checks == ("roundtrip",)
    assert by_name["qwen3_moe/tp2-sp"].checks == ("roundtrip", "replay")
    assert by_name["qwen2/pp2-dp2"].gpu_only == "needs NCCL" and by_name["qwen2/pp2-dp2"].world_size == 4


def test_load_release_file_has_the_release_matrix(repo_root):
    got = load([str(repo_root / "scenarios/release.yaml")], checks=CHECKS, families=FAMILIES)
    names = {s.name for s in got}
    moe_layouts = [
        "tp2-sp",
        "pp2",
        "pp2-vpp2",
        "ep2-dp2",
        "etp2-dp2",
        "cp2",
        "ep2-dp4",
        "pp2-ep2-dp2",
        "tp2-pp2-sp",
        "tp2-pp2-ep2-sp-dp2",
    ]
    dense_layouts = ["tp2", "pp2", "pp2-vpp2", "cp2", "tp2-pp2"]
    expected = {f"{f}/{l}" for f in ("qwen3_moe", "deepseek_v3") for l in moe_layouts}
    expected |= {f"{f}/{l}" for f in ("qwen2", "qwen2_tied") for l in dense_layouts}
    expected |= {f"deepseek_v2/{l}" for l in moe_layouts[:8]}  # 2 and 4 ranks
    expected |= {f"{f}/pp2-ppfirst1" for f in ("qwen2", "qwen3_moe", "deepseek_v3")}  # uneven pipeline
    expected.add(f"qwen3_moe/pp2-pplayout{hashlib.sha1(b'E|tt|t|tL').hexdigest()[:8]}-vpp2")  # pp_layout
    parity = {f"{f}/tp1" for f in ("qwen2", "qwen2_tied", "qwen3_moe", "deepseek_v3", "deepseek_v2")}
    assert names == expected | parity
    # MoE families also run, once on one rank, the replay subchecks that build their own 1-rank model
    moe_parity = {f"{f}/tp1" for f in ("qwen3_moe", "deepseek_v3", "deepseek_v2")}
    assert {s.name: (s.checks, s.world_size) for s in got if s.name in parity} == {
        n: (("hf_parity", "replay") if n in moe_parity else ("hf_parity",), 1) for n in parity
    }
    # replay is left out of one MoE scenario, with its reason in release.yaml
    no_replay = {"deepseek_v3/tp2-pp2-sp"}
    for s in got:
        if s.name in parity:
            continue
        moe = FAMILIES[s.family].is_moe and s.name not in no_replay
        want = ("roundtrip", "export", "replay") if moe else ("roundtrip", "export")
        assert s.checks == want, s.name
    assert {s.world_size for s in got if s.name.endswith("tp2-pp2-ep2-sp-dp2")} == {8}


def test_load_families_matrix_runs_every_bridge_family_but_where_a_finding_stops_it(repo_root):
    got = {
        s.name: s for s in load([str(repo_root / "scenarios/families_matrix.yaml")], checks=CHECKS, families=FAMILIES)
    }
    families = (
        "glm4_moe",
        "glm4_moe_lite",
        "olmoe",
        "minimax_m2",
        "gpt_oss",
        "ernie45_moe",
        "qwen3_next",
        "qwen3_5_moe",
        "qwen3_next_mtp",
        "deepseek_v3_mtp",
        "kimi_k2",
    )
    layouts = ["tp1", "tp2-sp", "pp2", "pp2-vpp2", "ep2-dp2", "etp2-dp2", "cp2", "ep2-dp4", "pp2-ep2-dp2"]
    expected = {f"{f}/{l}" for f in families for l in layouts if f != "gpt_oss"}
    expected |= {f"gpt_oss/{l}" for l in layouts if l not in ("tp2-sp", "etp2-dp2")} | {"gpt_oss/tp2-etp1-sp"}
    expected |= {"deepseek_v3_mtp/pp2-ppfirst1"}  # MTP with three MoE layers on an uneven last stage
    expected |= {"kimi_k2/pp2-ppfirst1"}  # the dense first layer alone on stage 0
    expected |= {"deepseek_v3_wide/tp1", "deepseek_v3_wide/ep2-dp2"}  # top-8 of 64 in groups, expert bias
    assert set(got) == expected
    findings = {
        "ernie45_moe/tp1": ("roundtrip", "export", "replay"),  # F3: no hf_parity
        "olmoe/tp2-sp": ("roundtrip", "export"),
    }  # F5: no replay under TP
    for name, s in got.items():
        want = findings.get(name) or (
            ("roundtrip", "export", "hf_parity", "replay")
            if name.endswith("/tp1")
            else ("roundtrip", "export", "replay")
        )
        assert s.checks == want, name
    ci = load([str(repo_root / "scenarios/families_ci.yaml")], checks=CHECKS, families=FAMILIES)
    release = {s.name for s in load([str(repo_root / "scenarios/release.yaml")], checks=CHECKS, families=FAMILIES)}
    assert ci and all(s.name in got and s.name not in release for s in ci)


def test_load_smoke_file_is_small_and_valid(repo_root):
    got = load([str(repo_root / "scenarios/smoke.yaml")], checks=CHECKS, families=FAMILIES)
    assert 0 < len(got) <= 6
    assert max(s.world_size for s in got) <= 2
    assert [s.name for s in got if "roundtrip" not in s.checks or "export" not in s.checks] == []
    moe = [s for s in got if FAMILIES[s.family].is_moe]
    assert moe and [s.name for s in moe if "replay" not in s.checks] == []


def test_load_production_slice_is_qwen3_30b_width_at_one_layer_ep1_and_ep2_replay_on_one_rank(repo_root):
    got = load([str(repo_root / "scenarios/production_cpu.yaml")])
    assert [(s.layout, s.world_size, s.checks) for s in got] == [
        (Layout(), 1, ("roundtrip", "export", "replay")),
        (Layout(ep=2), 2, ("roundtrip", "export")),
    ]
    for s in got:
        assert s.model.path == str(repo_root / "bench" / "qwen3_30b_a3b.json")
        assert dict(s.model.overrides) == {"num_hidden_layers": 1}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("scenarioz: []", r"s\.yaml: unknown top-level key\(s\) \['scenarioz'\]"),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [roundtrip], colour: red}",
            r"s\.yaml:2: unknown scenario key\(s\) \['colour'\]",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [roundtrip], layout: {tq: 2}}",
            r"s\.yaml:2: unknown layout key\(s\) \['tq'\]",
        ),
        (
            "scenarios:\n  - {family: llama, world_size: 1, checks: [roundtrip]}",
            r"s\.yaml:2: unknown family 'llama'; known families: qwen2, qwen2_tied",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [rondtrip]}",
            r"s\.yaml:2: scenario qwen2/tp1: unknown check 'rondtrip'; "
            r"known checks: export, hf_parity, replay, roundtrip",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [export, export]}",
            r"check\(s\) \['export'\] listed twice",
        ),
        ("scenarios:\n  - {family: qwen2, world_size: 1, checks: export}", r"checks must be a list of check names"),
        (
            "scenarios:\n  - {family: qwen2, world_size: 3, layout: {tp: 2}, checks: [export]}",
            r"s\.yaml:2: scenario qwen2/tp2: invalid layout: world_size 3 is not divisible by tp\*pp\*cp = 2\*1\*1 = 2",
        ),
        (
            "scenarios:\n  - {family: qwen3_moe, world_size: 2, layout: {tp: 2}, checks: [export]}",
            r"scenario qwen3_moe/tp2: invalid layout: MoE with tp 2 > 1 needs sp",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 2, layout: {ep: 2}, checks: [export]}",
            r"invalid layout: ep 2 > 1 needs an MoE model",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 2, layout: {pp: 2, vpp: 3}, checks: [export]}",
            r"num_layers 4 is not divisible by pp\*vpp = 2\*3 = 6",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, layout: {tp: 0}, checks: [export]}",
            r"s\.yaml:2: invalid layout: tp must be a positive integer, got 0",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 16, layout: {tp: 2}, checks: [export]}",
            r"scenario qwen2/tp2-dp8: world_size 16 exceeds the 8 ranks this machine can run",
        ),
        ("scenarios:\n  - {family: qwen2, checks: [export]}", r"world_size is missing"),
        ("scenarios:\n  - {family: qwen2, world_size: 1}", r"scenario qwen2/tp1: checks is missing"),
        (
            "scenarios:\n  - {family: qwen2, world_size: 0, checks: [export]}",
            r"world_size must be an integer >= 1, got 0",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [export], seed: -1}",
            r"seed must be an integer in \[0, 2147483647\], got -1",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [export], gpu_only: ''}",
            r"gpu_only must be a reason \(non-empty string\) or null",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [export], options: {subjct: bridge}}",
            r"unknown option 'subjct'; known options: subject, lockstep_timeout, refresh, receiver, replay_impl, "
            r"router_variants, replay_subchecks",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [export], options: {replay_impl: vllm}}",
            r"option replay_impl: replay implementation 'vllm' is not moeverify, native, verl, package.module:attr",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [export], options: {subject: nocolon}}",
            r"option subject: subject 'nocolon' is not bridge, sharded, gather, verl, package.module:attr or "
            r"path/to/file.py:attr",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [export], options: {subject: 'missing.py:f'}}",
            r"subject 'missing.py:f': file missing.py does not exist",
        ),
        (
            "scenarios:\n"
            "  - {family: qwen2, world_size: 1, checks: [replay], options: {replay_subchecks: [drift, nope]}}",
            r"option replay_subchecks: unknown replay subchecks \['nope'\]; known: equivalence, drift",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [replay], options: {replay_recompute: 3}}",
            r"option replay_recompute: expected a non-empty list of recompute modes",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [replay], options: {replay_batch: 0}}",
            r"option replay_batch: expected a whole number >= 1, got 0",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [replay], options: {router_variants: [zzz]}}",
            r"option router_variants: unknown router variant",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [roundtrip, replay]}",
            r"s\.yaml:2: scenario qwen2/tp1: check replay runs on MoE routers; qwen2 is a dense model",
        ),
        (
            "scenarios:\n  - {family: qwen3_moe, world_size: 1, checks: [replay], options: {replay_seq_len: 10000000}}",
            r"option replay_seq_len: expected at most 131072 tokens \(128k\), got 10000000",
        ),
        ("version: true\nscenarios:\n  - {family: qwen2, world_size: 1, checks: [export]}", r"version True is not"),
        ("version: 1.0\nscenarios:\n  - {family: qwen2, world_size: 1, checks: [export]}", r"version 1\.0 is not"),
        ("scenarios: {family: qwen2}", r"scenarios must be a list of mappings"),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: []}",
            r"checks is empty: a scenario must run at least one",
        ),
        (
            "scenarios:\n  - {family: qwen2, world_size: 1, checks: [export], seed: 99999999999999999999}",
            r"seed must be an integer in \[0, 2147483647\], got 99999999999999999999",
        ),
        (
            "scenarios:\n  - {family: qwen3_moe, world_size: 3, layout: {cp: 3}, checks: [replay]}",
            r"sequence of 16 tokens is not divisible by 2 \* cp = 6",
        ),
        (
            "scenarios:\n  - {family: qwen3_moe, world_size: 2, checks: [roundtrip, hf_parity]}",
            r"s\.yaml:2: scenario qwen3_moe/\S+: "
            r"hf_parity runs on one rank with the default layout .*not at world_size 2: "
            r"put hf_parity in a world_size 1 scenario",
        ),
        (
            "matrix:\n  - {families: [qwen3_moe], world_size: 2, checks: [roundtrip], moe_checks: [hf_parity], "
            "layouts: [{ep: 2}]}",
            r"scenario qwen3_moe/ep2-dp2: hf_parity runs on one rank .*not at world_size 2, layout "
            r"ep2-dp2",
        ),
        ("scenarios:\n  - qwen2", r"scenario must be a mapping, got str"),
        ("version: 2\nscenarios: []", r"version 2 is not supported; this moeverify reads version 1"),
        ("defaults: {checks: [export]}", r"no 'scenarios' or 'matrix' section"),
        ("scenarios: []", r"the file defines no scenario"),
        ("defaults: {checks: [export], family: qwen2}\nscenarios: []", r"unknown defaults key\(s\) \['family'\]"),
        ("defaults: {checks: [nope]}\nscenarios: []", r"unknown check 'nope'"),
        ("matrix:\n  - {families: [], layouts: [{}]}", r"s\.yaml:2: matrix block needs families"),
        ("matrix:\n  - {families: [qwen2], world_size: 1, checks: [export]}", r"matrix block needs layouts"),
        (
            "matrix:\n  - {families: [qwen2], world_size: 1, checks: [export], layouts: [{tp: 1, seed: 2}]}",
            r"unknown matrix layout key\(s\) \['seed'\]",
        ),
        (
            "matrix:\n  - {families: [qwen2, mixtral], world_size: 1, checks: [export], layouts: [{}]}",
            r"unknown family 'mixtral'",
        ),
    ],
)
def test_load_bad_file_raises_usage_error(tmp_path, text, match):
    with pytest.raises(UsageError, match=match):
        _load(tmp_path, text)


def test_load_malformed_yaml_names_file_and_line(tmp_path):
    with pytest.raises(UsageError, match=r"s\.yaml:3: malformed YAML"):
        _load(tmp_path, "scenarios:\n  - family: qwen2\n  world_size: 1\n  - checks: []\n")


def test_load_duplicate_yaml_key_names_line(tmp_path):
    with pytest.raises(UsageError, match=r"s\.yaml:3: duplicate key 'family'"):
        _load(tmp_path, "scenarios:\n  - family: qwen2\n    family: qwen2_tied\n    world_size: 1\n")


def test_load_empty_file_is_rejected(tmp_path):
    with pytest.raises(UsageError, match=r"s\.yaml: file is empty"):
        _load(tmp_path, "")


def test_load_missing_file_is_rejected(tmp_path):
    with pytest.raises(UsageError, match=r"nope\.yaml: cannot read scenario file"):
        load([str(tmp_path / "nope.yaml")], checks=CHECKS, families=FAMILIES)


def test_load_duplicate_names_in_one_file_name_both_places(tmp_path):
    with pytest.raises(
        UsageError, match=r"s\.yaml:4: scenario qwen2/tp2: duplicate name; first defined at .*s\.yaml:3"
    ):
        _load(
            tmp_path,
            """
            scenarios:
              - {family: qwen2, world_size: 2, layout: {tp: 2}, checks: [export]}
              - {family: qwen2, world_size: 2, layout: {tp: 2}, checks: [roundtrip]}
        """,
        )


def test_load_duplicate_names_across_files(tmp_path):
    text = "scenarios:\n  - {family: qwen2, world_size: 1, checks: [export]}\n"
    paths = [_write(tmp_path, text, "a.yaml"), _write(tmp_path, text, "b.yaml")]
    with pytest.raises(
        UsageError, match=r"b\.yaml:2: scenario qwen2/tp1: duplicate name; first defined at .*a\.yaml:2"
    ):
        load(paths, checks=CHECKS, families=FAMILIES)


def test_load_max_world_size_is_a_parameter(tmp_path):
    with pytest.raises(UsageError, match=r"world_size 2 exceeds the 1 ranks"):
        _load(tmp_path, "scenarios:\n  - {family: qwen2, world_size: 2, checks: [export]}", max_world_size=1)


def test_group_by_world_size_orders_worlds_and_keeps_file_order(tmp_path):
    got = _load(
        tmp_path,
        """
        defaults: {checks: [export]}
        scenarios:
          - {family: qwen2, world_size: 4, layout: {tp: 2}}
          - {family: qwen2, world_size: 1}
          - {family: qwen2_tied, world_size: 4, layout: {pp: 2}}
    """,
    )
    groups = group_by_world_size(got)
    assert list(groups) == [1, 4]
    assert [s.name for s in groups[4]] == ["qwen2/tp2-dp2", "qwen2_tied/pp2-dp2"]


def test_scenario_dict_round_trip_is_identity(repo_root):
    for s in load([str(repo_root / "scenarios/release.yaml")], checks=CHECKS, families=FAMILIES):
        assert scenario_from_dict(scenario_to_dict(s)) == s


def test_load_non_utf8_file_names_file_line_and_byte(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_bytes(b"scenarios:\n  - {family: qwen2, world_size: 1, checks: [export]} # \xff\n")
    with pytest.raises(UsageError, match=r"s\.yaml:2: not UTF-8 text \(byte 0xff at offset 66\)"):
        load([str(path)])


def test_load_control_characters_and_deep_nesting_are_refused_naming_the_file(tmp_path):
    # both raised from inside PyYAML before: a ReaderError at the loader's construction, a RecursionError
    path = tmp_path / "s.yaml"
    path.write_bytes(b"version: 1\nscenarios:\n  - {family: qwen2, world_size: 1,\n     checks: [export]}\x00\n")
    with pytest.raises(UsageError, match=r"s\.yaml:4: not YAML text: character U\+0000 at offset \d+"):
        load([str(path)])
    path.write_text("scenarios: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(UsageError, match=r"s\.yaml: malformed YAML: nested deeper than a scenario file can be read"):
        load([str(path)])
