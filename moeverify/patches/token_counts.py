"""Expert-bias token counts of a held router call: the padding mask applied per token.

Legend of shape suffixes: T = tokens of one router call, E = experts.

A router with the aux-loss-free expert bias adds, on every routing call made with grad, the experts
each token was sent to into ``local_tokens_per_expert``; the bias update of the next optimizer step
reads those counts. Padding tokens must not count. megatron-core 0.19.2 masks its ``[T, E]`` routing
map with the flattened ``[T]`` padding mask, which lines the token mask up with the *expert* axis:
with T != E the call raises, and with T == E (as many tokens in the call as experts) expert ``e``
silently loses its counts whenever token ``e`` is padding, in every layer, with no error anywhere.

For the calls of routers a session holds (record, replay, and their recomputes), ``route`` lets
Megatron route with its own count switched off for that call (the router's ``enable_expert_bias``
gate) and adds the counts itself, token by token: the routed experts (after capacity dropping: the
routing map the call returns) of every non-padding token. Without a padding mask, or without expert
bias, Megatron's own code runs untouched. Routers no session holds keep megatron-core's behaviour.
"""

from __future__ import annotations

import torch

from moeverify.errors import EnvironmentProblem

_GATE = "enable_expert_bias"  # TopKRouter's own switch of the count (set in __init__ from the config)


def padding_mask_of(args: tuple, kwargs: dict):
    """The padding mask handed to ``TopKRouter.routing(logits, padding_mask=None)``, or None."""
    if kwargs and kwargs.get("padding_mask") is not None:
        return kwargs["padding_mask"]
    return args[0] if args else None


def route(original, router, logits, args: tuple, kwargs: dict):
    """``original(router, logits, *args, **kwargs)`` with the expert-bias counts taken per token."""
    padding = padding_mask_of(args, kwargs)
    attrs = router.__dict__
    if padding is None or not attrs.get(_GATE, False):
        if padding is not None and _GATE not in attrs and getattr(router, "local_tokens_per_expert", None) is not None:
            raise EnvironmentProblem(
                f"a {type(router).__name__} counts tokens per expert but has no {_GATE} "
                "attribute; router replay expects megatron-core 0.16-0.19's TopKRouter"
            )
        return original(router, logits, *args, **kwargs)
    counting = torch.is_grad_enabled()  # Megatron counts only calls made with grad (not log-prob passes)
    attrs[_GATE] = False
    try:
        probs_TE, map_TE = original(router, logits, *args, **kwargs)
    finally:
        attrs[_GATE] = True
    if counting:
        with torch.no_grad():
            valid_T1 = ~padding.reshape(-1, 1).to(map_TE.device)
            router.local_tokens_per_expert += (map_TE & valid_T1).sum(dim=0)
    return probs_TE, map_TE
