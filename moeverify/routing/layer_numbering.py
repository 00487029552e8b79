"""Which layer a rollout array's layer column holds: the one rule, for ``Routes.from_rollout`` and the dump CLI.

A rollout engine's routes array ``[tokens, W, K]`` numbers its W layer columns one of two ways:

- ``"routers"``: one column per router, in the order of the ``layers`` the caller names (MoE decoder layers, then
  multi-token-prediction layers, numbered ``num_layers + i``);
- ``"decoder"``: one column per decoder layer, column ``c`` holding global layer ``c`` (dense layers included, as
  engines that size their buffer by the model's layer count write it); MoE columns are taken by layer number.

A width can fit both: a model with as many dense layers as MTP layers (one of each: GLM-4.5-Air, DeepSeek-V3
style with MTP) has as many routers as decoder layers. Read as routers, MoE layer 1 would replay the dense layer's
column. So whenever the width fits both readings and they take different columns, ``columns`` refuses and names
the argument that picks one; it never guesses. Where the decoder layer count is not given, the decoder reading is
possible whenever the layers at or after the width could be MTP layers numbered from it (a model of that many
decoder layers), so a router-numbered array of a model with dense layers needs the count (or the numbering).
"""

from __future__ import annotations

from collections.abc import Sequence

from moeverify.errors import MoEVerifyError

NUMBERINGS = ("routers", "decoder")


def moe_layers(*, num_layers: int, moe_layer_freq) -> tuple[int, ...]:
    """Global numbers of the MoE decoder layers (Megatron-Core 0.19's ``moe_layer_freq``: an int, every n-th layer
    from layer 0, or a 0/1 list of ``num_layers`` entries); ``ValueError`` for another form."""
    if isinstance(moe_layer_freq, int):
        return tuple(i for i in range(num_layers) if i % moe_layer_freq == 0)
    if isinstance(moe_layer_freq, (list, tuple)) and len(moe_layer_freq) == num_layers:
        return tuple(i for i, is_moe in enumerate(moe_layer_freq) if is_moe)
    raise ValueError(
        f"moe_layer_freq {moe_layer_freq!r}: expected an int or a list of {num_layers} 0/1 entries "
        "(megatron-core 0.19's forms)"
    )


def columns(
    width: int,
    *,
    layers: Sequence[int],
    num_layers: int | None,
    numbering: str | None,
    where: str,
    error: type[MoEVerifyError],
    pick: str,
    count: str,
) -> list[int]:
    """The array column of each of ``layers`` (in ``layers`` order), or ``error`` naming why not.

    Args:
        width: layer columns the array holds.
        layers: global numbers of the routers wanted (MoE layers, then MTP layers), in router column order.
        num_layers: decoder layers of the model (MTP layers not counted), or None when not known.
        numbering: ``"routers"``, ``"decoder"`` or None (inferred where only one reading fits).
        where: names the array in messages; ``pick``: the argument choosing a numbering, a template for its value
            (``'numbering="{}"'``, ``"--layer-numbering {}"``); ``count``: the argument giving the decoder count.
    """
    layers = [int(layer) for layer in layers]
    if numbering not in (None, *NUMBERINGS):
        raise error(f"{pick.format(numbering)}: not a numbering; one of {list(NUMBERINGS)}")
    as_routers = list(range(width))
    fits_routers = width == len(layers)
    fits_decoder = num_layers is not None and width == num_layers
    if numbering == "routers":
        if not fits_routers:
            raise error(
                f"{where} hold {width} layer column(s), not one per router: "
                f"{pick.format('routers')} needs {len(layers)} ({_named(layers)})"
            )
        return as_routers
    if numbering == "decoder":
        if num_layers is not None and width != num_layers:
            raise error(
                f"{where} hold {width} layer column(s), not one per decoder layer: "
                f"{pick.format('decoder')} needs {num_layers} (the model's decoder layers)"
            )
        return _decoder_columns(width, layers=layers, where=where, error=error)
    if fits_routers and not ambiguous(width, layers=layers, num_layers=num_layers):
        return as_routers
    if fits_routers:  # both readings fit, and they take different columns
        decoders = num_layers if fits_decoder else width
        known = "" if fits_decoder else f" if {[layer for layer in layers if layer >= width]} are MTP layers"
        raise error(
            f"{where}: {width} layer columns fit two numberings: one column per router ({len(layers)} "
            f"routers {_named(layers)}, column i is the i-th of them) and one column per decoder layer "
            f"({decoders} decoder layers{known}, column c is layer c, so layer {layers[0]} would read column "
            f"{layers[0]}, not 0). Refusing to guess: say which, {pick.format('routers')} or "
            f"{pick.format('decoder')}"
            + ("" if fits_decoder else f" (or give the model's decoder layer count, {count})")
        )
    if fits_decoder:
        return _decoder_columns(width, layers=layers, where=where, error=error)
    fits = f"{len(layers)} MoE layers" + (
        f" or {num_layers} decoder layers" if num_layers is not None else f" (pass {count} for an all-layer array)"
    )
    raise error(f"{where} hold {width} layer columns, which fits neither numbering: expected {fits}")


def ambiguous(width: int, *, layers: Sequence[int], num_layers: int | None) -> bool:
    """Whether ``width`` columns (or rows) fit both one per router and one per decoder layer, the two readings
    taking different columns. ``num_layers`` None: the decoder count is unknown, and any count that places the
    layers at or after ``width`` as MTP layers is possible."""
    layers = [int(layer) for layer in layers]
    if width != len(layers) or layers == list(range(width)):
        return False
    return width == num_layers if num_layers is not None else _mtp_tail(width, layers)


def _mtp_tail(width: int, layers: list[int]) -> bool:
    """Whether ``width`` decoder layers plus MTP layers could hold ``layers``: the layers at or after ``width``
    are ``width, width + 1, ...`` (MTP layers follow the decoder layers)."""
    tail = sorted(layer for layer in layers if layer >= width)
    return bool(tail) and tail == list(range(width, width + len(tail)))


def _decoder_columns(width: int, *, layers: list[int], where: str, error) -> list[int]:
    beyond = [layer for layer in layers if not 0 <= layer < width]
    if beyond:
        raise error(
            f"{where}: layer(s) {beyond} lie outside the {width} decoder layer columns (an MTP layer, "
            f"numbered after the decoder layers, has no column there; engines do not capture it): drop "
            f"them from the layers asked for"
        )
    return list(layers)


def _named(layers: list[int]) -> str:
    return str(layers) if len(layers) <= 12 else f"[{layers[0]}, ..., {layers[-1]}]"
