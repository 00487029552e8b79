"""``moeverify.runner.probe``: a user's plugin loaded for real in a child Python before any rank starts."""

from __future__ import annotations

import pytest

from moeverify.errors import UsageError
from moeverify.runner import probe, select

pytestmark = pytest.mark.timing  # child processes


def test_probe_loads_a_good_plugin_and_skips_builtins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.py").write_text("print('noise: moeverify-probe:')\ndef factory(ctx=None):\n    return 1\n")
    probe.probe("good.py:factory", what="subject")  # relative to the working directory, as the ranks resolve it
    probe.probe("json:dumps", what="subject")
    probe.probe("bridge", what="subject", builtins={"bridge": "moeverify.subjects:bridge"})


def test_probe_retries_after_the_bridge_import_only_on_an_import_error(monkeypatch):
    calls = []

    def child(spec, *, what, bridge):
        calls.append(bridge)
        if spec == "needs_bridge:f":
            return None if bridge else {"error": "no module named 'transformer_engine'", "import_error": True}
        return {"error": f"{what} {spec!r}: raised RuntimeError", "import_error": False}

    monkeypatch.setattr(probe, "_child", child)
    probe.probe("needs_bridge:f", what="subject")
    assert calls == [False, True]
    calls.clear()
    with pytest.raises(UsageError, match=r"^subject 'broken:f': raised RuntimeError$"):
        probe.probe("broken:f", what="subject")
    assert calls == [False]


def test_probe_a_plugin_that_imports_megatron_bridge_is_loaded_as_a_rank_loads_it(tmp_path):
    """A rank has imported Megatron-Bridge (TE-free where Transformer Engine is absent) before it loads a plugin:
    a plugin importing ``megatron.bridge`` must not be refused because a bare import of it fails."""
    (tmp_path / "uses_bridge.py").write_text("import megatron.bridge\ndef factory(ctx=None):\n    return 1\n")
    probe.probe(f"{tmp_path}/uses_bridge.py:factory", what="subject")


def test_probe_plugins_names_each_user_plugin_once(tmp_path, monkeypatch):
    from moeverify.spec.layout import Layout
    from moeverify.spec.scenario import Scenario

    seen = []
    monkeypatch.setattr(probe, "probe", lambda spec, *, what, builtins: seen.append((spec, what)))
    scenarios = [
        Scenario(
            family="qwen3_moe",
            layout=Layout(),
            world_size=1,
            checks=("export", "replay"),
            options={"subject": "mine.py:f"},
        ),
        Scenario(family="qwen2", layout=Layout(), world_size=1, checks=("export",)),
    ]
    said = []
    select.probe_plugins(scenarios, {"replay_impl": "impl.py:g"}, say=lambda *a, **k: said.append(a[0]))
    assert seen == [("mine.py:f", "subject"), ("impl.py:g", "replay implementation")]
    assert said == [
        "loading subject mine.py:f as a rank would, before any rank starts ...",
        "loading replay implementation impl.py:g as a rank would, before any rank starts ...",
    ]


def test_probe_calls_a_replay_implementations_factory_and_checks_what_it_returns(tmp_path):
    # both reached a rank before: the factory is called only there (exit 1, not a usage error)
    (tmp_path / "impl.py").write_text(
        "from moeverify.oracles.replay.impls import MoeverifyReplay\n"
        "def good():\n    return MoeverifyReplay()\n"
        "def not_impl():\n    return object()\n"
        "def raises():\n    raise RuntimeError('factory boom')\n"
    )
    what = "replay implementation"
    probe.probe(f"{tmp_path}/impl.py:good", what=what)
    with pytest.raises(UsageError, match=r"impl\.py:not_impl' returned object, expected a ReplayImpl"):
        probe.probe(f"{tmp_path}/impl.py:not_impl", what=what)
    with pytest.raises(UsageError, match=r"impl\.py:raises': its factory raised RuntimeError: factory boom"):
        probe.probe(f"{tmp_path}/impl.py:raises", what=what)
