"""The TE placeholder is served to megatron-bridge's one importer only, and never seen by megatron-core."""

import subprocess
import sys

import pytest
from waiting import CHILD_S

SCRIPT = r"""
import importlib.util, sys
from moeverify.runtime.bridge_import import import_bridge, real_te_available
assert not real_te_available()
bridge = import_bridge()
assert [m for m in sys.modules if m.startswith("transformer_engine")] == [], "placeholder leaked"
import megatron.bridge.peft.lora_layers as lora
assert lora.te.__class__.__name__ == "_PlaceholderModule"
from megatron.core.extensions import transformer_engine as core_te
try:
    import transformer_engine  # megatron-core and everyone else still see no TE
except ImportError:
    pass
else:
    raise AssertionError("transformer_engine importable after import_bridge")
from megatron.bridge import AutoBridge
print("OK")
"""


@pytest.mark.timing
def test_bridge_import_scopes_te_placeholder_to_lora_layers():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=CHILD_S)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
