"""``moeverify.integrations.verl_engine`` without verl: what it reads from a batch laid out as verl 0.9.1 lays it out
(plain tensors: a jagged batch's values and offsets), and the checks that refuse another verl. verl's own engine
running through the integration: ``test_verl_actor_r3.py`` (``make release``)."""

from __future__ import annotations

import pytest
import torch

from moeverify.errors import UsageError
from moeverify.integrations import verl_engine as ve
from moeverify.patches import rollout_source

W, K = 2, 2


def batch(samples):
    """samples: ``(prompt, response mask, routed rows)`` -> the keyword arguments of ``requests_of``: tokens and
    routes concatenated (jagged), the response mask right-padded, the attention mask of the left/right padded
    batch; routes ``[pos, pos + 1]`` on routed rows (distinct ids), zeros after."""
    tokens, routes, lengths = [], [], [0]
    r = max(len(m) for _, m, _ in samples)
    p = max(prompt for prompt, _, _ in samples)
    response_BR = torch.zeros(len(samples), r, dtype=torch.long)
    attention_BS = torch.zeros(len(samples), p + r, dtype=torch.long)
    for i, (prompt, mask, rows) in enumerate(samples):
        n = prompt + len(mask)
        tokens.append(torch.arange(n) + 10 * i)
        routed = torch.zeros(n, W, K, dtype=torch.long)
        routed[:rows] = torch.stack([torch.arange(rows), torch.arange(rows) + 1], dim=1)[:, None, :]
        routes.append(routed)
        lengths.append(lengths[-1] + n)
        response_BR[i, : len(mask)] = torch.tensor(mask)
        attention_BS[i, p - prompt : p + len(mask)] = 1
    return dict(
        tokens_N=torch.cat(tokens),
        offsets=torch.tensor(lengths),
        routes_NWK=torch.cat(routes),
        response_mask_BR=response_BR,
        attention_mask_BS=attention_BS,
    )


def test_verl_integration_tokens_after_the_last_generation_declared_native():
    samples = [
        (3, [1, 1, 1], 5),  # single turn: the last token's row unfilled (the engine never fed it back)
        (2, [1, 1, 0, 0, 1, 0, 0], 6),  # ends in a tool's output: its rows and the last generated token's zero
        (2, [1, 1, 0, 0, 1, 1], 7),  # ends in a generation: tool tokens mid-trajectory were routed (prefill)
        (3, [0, 0], 0),  # nothing generated: nothing declared
    ]
    sequences, routes, native = ve.requests_of(**batch(samples))
    assert [s.numel() for s in sequences] == [6, 9, 8, 5]
    split = torch.split(batch(samples)["routes_NWK"], [6, 9, 8, 5])
    assert all(torch.equal(r, b) for r, b in zip(routes, split, strict=True))
    assert [n.nonzero().flatten().tolist() for n in native] == [[5], [6, 7, 8], [7], []]


def test_verl_integration_route_after_the_last_generation_refused():
    kwargs = batch([(2, [1, 1, 0, 0], 3)])
    kwargs["routes_NWK"][4] = torch.tensor([1, 2])  # a tool token past the last generation holds a route
    with pytest.raises(UsageError, match=r"sample 0: position 4 holds a route, after the sample's last generated"):
        ve.requests_of(**kwargs)
    kwargs = batch([(2, [1, 1], 3), (1, [1], 1)])
    kwargs["attention_mask_BS"][1, 0] = 1  # a mask that is not the batch's
    with pytest.raises(UsageError, match=r"attention_mask counts \[4, 3\] tokens per sample, input_ids hold \[4, 2\]"):
        ve.requests_of(**kwargs)


def test_verl_integration_versions_per_sample(monkeypatch):
    assert ve.versions_of(None, 3) == [0, 0, 0]  # no max_global_steps: the batch is one version
    assert ve.versions_of([None, None], 2) == [0, 0]
    assert ve.versions_of([4, 3], 2) == [4, 3]
    assert ve.versions_of(torch.tensor([2, 2]), 2) == [2, 2]
    assert ve.versions_of(7, 2) == [7, 7]
    for values, message in (
        ([1, None], r"max_global_steps=None: each sample's version must be an integer >= 0"),
        ([1, -1], r"max_global_steps=-1"),
        ([True, 1], r"max_global_steps=True"),
        ([1, 2, 3], r"3 max_global_steps values for 2 samples"),
        ([1, 2, 3], r"one batch holds samples of 3 versions \[1, 2, 3\], in-job R3 keeps 2: raise "),
    ):
        samples = 2 if "values for" in message else len(values)
        with pytest.raises(UsageError, match=message):
            ve.versions_of(values, samples)
    monkeypatch.setenv(rollout_source.KEEP_ENV, "3")
    assert ve.versions_of([1, 2, 3], 3) == [1, 2, 3]


def test_verl_integration_another_verl_refused():
    ve.check_version("0.9.1")
    with pytest.raises(UsageError, match=r"verl 0.10.0 is installed; the integration reads verl 0.9.1's Megatron"):
        ve.check_version("0.10.0")

    class Engine:
        def forward_backward_batch(self, data, loss_function, forward_only=False, extra=None): ...

    with pytest.raises(UsageError, match=r"MegatronEngine.forward_backward_batch takes \('self', 'data', "):
        ve.check_signature(Engine, "MegatronEngine", "forward_backward_batch", ve.HOOKS[0][2])
    with pytest.raises(UsageError, match=r"forward_step takes None"):
        ve.check_signature(Engine, "MegatronEngineWithLMHead", "forward_step", ve.HOOKS[1][2])
