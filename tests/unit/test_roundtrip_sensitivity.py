"""The roundtrip check's sensitivity (``moeverify.spec.bug_classes``' ``minimal``): on a tiny Qwen3-MoE, a bridge export
with one element one ulp off fails ``bitwise`` (naming the one element), and one with one tensor left out fails
``key_set`` (naming it); the unchanged export passes both."""

from __future__ import annotations

import types

import pytest

from moeverify.oracles import roundtrip
from moeverify.oracles.bits import bits
from moeverify.oracles.context import CheckContext
from moeverify.spec.layout import Layout
from moeverify.spec.models.ref import ModelRef

pytestmark = pytest.mark.usefixtures("patched_megatron_world")


def _ctx(monkeypatch, change=None) -> CheckContext:
    ctx = CheckContext(
        scenario=types.SimpleNamespace(model=ModelRef.builtin("qwen3_moe"), layout=Layout(), seed=0),
        rank=0,
        world_size=1,
        backend="cpu",
        options={},
    )
    bridge = ctx.model().bridge
    if change is not None:
        real = bridge.export_hf_weights
        monkeypatch.setattr(bridge, "export_hf_weights", lambda *a, **k: change(real(*a, **k)))
    return ctx


def _failed(tallies) -> dict[str, list[str]]:
    return {name: t.failures for name, t in tallies.items() if not t.passed}


def test_roundtrip_control_passes(monkeypatch):
    tallies = roundtrip.run(_ctx(monkeypatch))
    assert _failed(tallies) == {} and tallies["bitwise"].checked > 10


def test_roundtrip_bitwise_sees_one_ulp_in_one_element(monkeypatch):
    def one_ulp(stream):
        for i, (name, tensor) in enumerate(stream):
            if i == 0:
                tensor = tensor.clone()
                bits(tensor.view(-1))[0] ^= 1  # the lowest bit of element 0: one ulp
            yield name, tensor

    failed = _failed(roundtrip.run(_ctx(monkeypatch, one_ulp)))
    assert set(failed) == {"bitwise"} and len(failed["bitwise"]) == 1, failed
    assert " 1 of " in failed["bitwise"][0] and "elements differ: [0]" in failed["bitwise"][0], failed


def test_roundtrip_key_set_sees_one_tensor_never_exported(monkeypatch):
    failed = _failed(roundtrip.run(_ctx(monkeypatch, lambda s: ((n, t) for n, t in s if n != "model.norm.weight"))))
    assert failed == {"key_set": ["1 checkpoint name(s) never exported: ['model.norm.weight']"]}, failed
