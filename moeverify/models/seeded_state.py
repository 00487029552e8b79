"""Megatron-Bridge's loader and exporter reading seeded weights made on demand (``seeded``), not safetensors.

Version assumptions (megatron-bridge 0.6.2): ``PreTrainedCausalLM.state`` returns ``_state_dict_accessor`` once set
(otherwise it makes a ``SafeTensorsStateSource`` over the directory, which has no weights file here); the loader
(``load_hf_weights``) and ``export_hf_weights`` read tensors and keys only through that ``StateDict``'s source
(``load_tensors``, ``get_all_keys``). ``install`` checks the first and fails loudly when it no longer holds.
"""

from __future__ import annotations

from pathlib import Path

from megatron.bridge.models.hf_pretrained.state import StateDict, StateSource

from moeverify.errors import MoEVerifyError
from moeverify.models.seeded import SeededWeights


class SeededStateSource(StateSource):
    """A ``StateSource`` whose tensors are made when loaded (one at a time; nothing kept)."""

    def __init__(self, weights: SeededWeights) -> None:
        self.weights = weights
        self._keys = sorted(weights.names())
        self._known = frozenset(self._keys)

    def get_all_keys(self) -> list[str]:
        return self._keys

    def load_tensors(self, keys: list[str]) -> dict:
        return {key: self.weights.get_tensor(key) for key in keys if key in self._known}


def install(bridge, path: Path) -> None:
    """Make ``bridge`` read the seeded weights of ``path`` (a directory ``seeded.is_seeded``)."""
    pretrained = bridge.hf_pretrained
    if not hasattr(pretrained, "_state_dict_accessor"):
        raise MoEVerifyError(
            f"{type(pretrained).__name__} has no _state_dict_accessor: this Megatron-Bridge reads "
            "weights another way (moeverify assumes 0.6.2's PreTrainedCausalLM.state); seeded weights "
            "made on demand cannot be given to it"
        )
    source = SeededStateSource(SeededWeights(path))
    pretrained._state_dict_accessor = StateDict(source)
    if getattr(pretrained.state, "source", None) is not source:
        raise MoEVerifyError(
            f"{type(pretrained).__name__}.state does not return the accessor moeverify set: this "
            "Megatron-Bridge reads weights another way (moeverify assumes 0.6.2)"
        )
