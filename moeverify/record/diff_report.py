"""The result of comparing two routings (``diff.diff`` / ``diff.diff_stream``): per-layer, per-token and
per-sequence figures, the JSON record of ``moeverify dump diff --json`` (keys in docs/dumps.md) and its tables.

A *router* is one MoE layer's routing of one token; it *differs* when the two sides' top-k expert SETS
differ (order-insensitive). Legend: N = tokens (all micro-batches), L = MoE layers, K = top-k, E = experts,
B = heatmap buckets.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffReport:
    """Result of ``diff`` / ``diff_stream``; ``to_json()`` is the record ``moeverify dump diff --json`` writes
    (keys in docs/dumps.md)."""

    layers: tuple[int, ...]
    tokens: int
    num_experts: int
    topk: int
    exact_L: torch.Tensor  # int64: tokens whose top-k sets are identical
    overlap_L: torch.Tensor  # int64: sum over tokens of |A ∩ B|
    load_a_LE: torch.Tensor  # int64 tokens per expert
    load_b_LE: torch.Tensor
    differing_N: torch.Tensor  # int16: routers (layers) of the token whose sets differ
    first_N: torch.Tensor  # int16: index into ``layers`` of the token's first differing router, -1: none
    missed_N: torch.Tensor  # int32: experts of A not in B, over all layers
    microbatch_tokens: tuple[int, ...] = ()  # tokens per micro-batch; token N of the report is in that order
    sequence_tokens: tuple[tuple[int, ...], ...] | None = None  # per micro-batch: tokens of each sequence, in order
    sequence_extra: tuple[dict, ...] | None = None  # per sequence: more JSON fields (rollout: what was set apart)
    exact_NL: torch.Tensor | None = None  # in-memory ``diff`` only: bool, sets identical
    overlap_NL: torch.Tensor | None = None  # in-memory ``diff`` only: uint8 |A ∩ B|
    bucket_differ_LB: torch.Tensor | None = None  # ``diff_stream`` only: differing routers per token bucket

    # -- per layer ---------------------------------------------------------------------------------
    @property
    def agreement_L(self) -> torch.Tensor:
        if not self.tokens:
            return torch.ones(len(self.layers))
        return self.exact_L.double().div(self.tokens).float()

    @property
    def overlap_at_k_L(self) -> torch.Tensor:
        if not self.tokens:
            return torch.ones(len(self.layers))
        return self.overlap_L.double().div(self.tokens * self.topk).float()

    # -- per token ---------------------------------------------------------------------------------
    @property
    def diverging_N(self) -> torch.Tensor:
        return self.differing_N > 0

    @property
    def tokens_diverging_any_layer(self) -> float:
        return float(self.diverging_N.sum()) / self.tokens if self.tokens else 0.0

    @property
    def routers_differing(self) -> int:
        """Differing routers over all tokens and layers."""
        return int(self.differing_N.sum(dtype=torch.int64))

    @property
    def routers_differing_per_token(self) -> float:
        """Mean over tokens of how many of its ``L`` routers differ."""
        return self.routers_differing / self.tokens if self.tokens else 0.0

    @property
    def routers_differing_share(self) -> float:
        """Differing routers / all ``N * L`` routers (``1 - agreement_all_layers``)."""
        cells = self.tokens * len(self.layers)
        return self.routers_differing / cells if cells else 0.0

    def tokens_by_routers_differing(self) -> dict[int, int]:
        """``{n: tokens with exactly n differing routers}`` (counts of zero omitted)."""
        counts = torch.bincount(self.differing_N.to(torch.int64), minlength=1)
        return {n: int(c) for n, c in enumerate(counts.tolist()) if c}

    def first_divergent_layer(self) -> dict[int, int]:
        """``{layer: tokens whose first divergent layer it is}`` (layers with zero omitted)."""
        first = self.first_N[self.first_N >= 0].to(torch.int64)
        counts = torch.bincount(first, minlength=len(self.layers))
        return {self.layers[i]: int(c) for i, c in enumerate(counts.tolist()) if c}

    def worst_tokens(self, n: int = 10) -> list[dict]:
        """Tokens with most experts missed over all layers.

        Each is ``{token, microbatch, token_in_microbatch, missed, layers_diverging}``; ``token`` counts
        over the micro-batches in order.
        """
        if not self.tokens:
            return []
        values, idx = self.missed_N.topk(min(n, self.tokens))
        layers_N = self.differing_N[idx]
        starts = torch.tensor([0, *self.microbatch_tokens]).cumsum(0)[:-1] if self.microbatch_tokens else None
        out = []
        for t, v, c in zip(idx.tolist(), values.tolist(), layers_N.tolist(), strict=True):
            if v <= 0:
                continue
            mb = int(torch.searchsorted(starts, t, right=True)) - 1 if starts is not None else 0
            offset = int(starts[mb]) if starts is not None else 0
            out.append(
                {"token": t, "microbatch": mb, "token_in_microbatch": t - offset, "missed": v, "layers_diverging": c}
            )
        return out

    # -- per sequence ------------------------------------------------------------------------------
    def sequences(self) -> list[dict] | None:
        """One record per sequence (request), in order; None when the sequences are not known.

        Each is ``{sequence, microbatch, sequence_in_microbatch, tokens, tokens_diverging,
        tokens_diverging_any_layer, routers_differing, routers_differing_per_token, first_divergent_layer}``
        (shares and means are None for a sequence with no compared token; ``first_divergent_layer`` is the
        global layer number, None when no token diverges), plus ``sequence_extra``'s fields.
        """
        if self.sequence_tokens is None:
            return None
        where = [(mb, b) for mb, seqs in enumerate(self.sequence_tokens) for b in range(len(seqs))]
        counts_S = torch.tensor([n for seqs in self.sequence_tokens for n in seqs], dtype=torch.int64)
        seq_N = torch.repeat_interleave(torch.arange(counts_S.numel()), counts_S)
        width = len(self.layers)
        diverging_S = torch.zeros(counts_S.numel(), dtype=torch.int64).index_add_(
            0, seq_N, self.diverging_N.to(torch.int64)
        )
        routers_S = torch.zeros(counts_S.numel(), dtype=torch.int64).index_add_(
            0, seq_N, self.differing_N.to(torch.int64)
        )
        first_N = self.first_N.to(torch.int64)
        first_S = torch.full((counts_S.numel(),), width, dtype=torch.int64).scatter_reduce_(
            0, seq_N, torch.where(first_N >= 0, first_N, width), "amin"
        )
        out = []
        for s, ((mb, b), n, d, r, f) in enumerate(
            zip(where, counts_S.tolist(), diverging_S.tolist(), routers_S.tolist(), first_S.tolist(), strict=True)
        ):
            rec = {
                "sequence": s,
                "microbatch": mb,
                "sequence_in_microbatch": b,
                "tokens": n,
                "tokens_diverging": d,
                "tokens_diverging_any_layer": d / n if n else None,
                "routers_differing": r,
                "routers_differing_per_token": r / n if n else None,
                "first_divergent_layer": self.layers[f] if f < width else None,
            }
            if self.sequence_extra is not None:
                rec.update(self.sequence_extra[s])
            out.append(rec)
        return out

    # -- plots -------------------------------------------------------------------------------------
    def bucket_disagreement(self, buckets: int = 64) -> torch.Tensor:
        """``[L, buckets]`` fraction of tokens with differing sets, tokens cut in contiguous buckets.

        A streamed report keeps the buckets it was built with (``diff_stream(buckets=)``); asking it for
        another count raises ``ValueError``.
        """
        buckets = max(1, min(buckets, self.tokens))
        edges = bucket_edges(self.tokens, buckets)
        if self.exact_NL is None:
            if self.bucket_differ_LB is None or self.bucket_differ_LB.shape[1] != buckets:
                held = None if self.bucket_differ_LB is None else self.bucket_differ_LB.shape[1]
                raise ValueError(
                    f"this streamed report holds {held} token buckets per layer, not {buckets}: "
                    f"pass buckets={held} or stream with diff_stream(buckets={buckets})"
                )
            sums = self.bucket_differ_LB.t().double()
        else:
            cum_NL = torch.cat([torch.zeros(1, len(self.layers)), (~self.exact_NL).float().cumsum(dim=0)])
            sums = cum_NL[edges[1:]] - cum_NL[edges[:-1]]
        return (sums / (edges[1:] - edges[:-1]).clamp(min=1)[:, None]).t().float()

    # -- output ------------------------------------------------------------------------------------
    def to_json(self, *, worst: int = 10) -> dict:
        agreement, overlap = self.agreement_L.tolist(), self.overlap_at_k_L.tolist()
        load_delta = self.load_b_LE - self.load_a_LE
        layers = {
            str(layer): {
                "agreement": agreement[i],
                "overlap_at_k": overlap[i],
                "tokens": self.tokens,
                "load_a": self.load_a_LE[i].tolist(),
                "load_b": self.load_b_LE[i].tolist(),
                "load_max_abs_delta": int(load_delta[i].abs().max()) if self.num_experts else 0,
            }
            for i, layer in enumerate(self.layers)
        }
        diverging = int(self.diverging_N.sum())
        sequences = self.sequences()
        return {
            "layers": layers,
            "tokens": self.tokens,
            "num_experts": self.num_experts,
            "topk": self.topk,
            "tokens_diverging_any_layer": self.tokens_diverging_any_layer,
            "agreement_all_layers": 1.0 - self.routers_differing_share,
            "first_divergent_layer": {str(k): v for k, v in self.first_divergent_layer().items()},
            "worst_tokens": self.worst_tokens(worst),
            "routers_per_token": len(self.layers),
            "routers_differing": self.routers_differing,
            "routers_differing_per_token": self.routers_differing_per_token,
            "routers_differing_share": self.routers_differing_share,
            "routers_differing_per_diverging_token": self.routers_differing / diverging if diverging else 0.0,
            "tokens_by_routers_differing": {str(k): v for k, v in self.tokens_by_routers_differing().items()},
            "sequences": sequences,
            "sequences_diverging": None if sequences is None else sum(1 for s in sequences if s["tokens_diverging"]),
        }

    def table(self):
        """A ``rich`` table: one row per layer."""
        from rich.table import Table  # lazy: rich

        table = Table(
            title=f"routing diff: {self.tokens} tokens, top-{self.topk} of {self.num_experts}, "
            f"{self.tokens_diverging_any_layer:.2%} diverge in >= 1 layer; "
            f"{self.routers_differing_per_token:.4f} of {len(self.layers)} routers differ per token "
            f"({self.routers_differing_share:.4%} of routers)"
        )
        for col in ("layer", "agreement", "overlap@k", "tokens first diverging here", "max |load delta|"):
            table.add_column(col, justify="right")
        first = self.first_divergent_layer()
        agreement, overlap = self.agreement_L.tolist(), self.overlap_at_k_L.tolist()
        delta = (self.load_b_LE - self.load_a_LE).abs()
        for i, layer in enumerate(self.layers):
            style = None if agreement[i] == 1.0 else "red"
            table.add_row(
                str(layer),
                f"{agreement[i]:.4%}",
                f"{overlap[i]:.4f}",
                str(first.get(layer, 0)),
                str(int(delta[i].max())) if self.num_experts else "0",
                style=style,
            )
        return table

    def sequence_table(self, n: int = 10):
        """A ``rich`` table of the ``n`` sequences that diverge most; None when the sequences are not known."""
        from rich.table import Table  # lazy: rich
        from rich.text import Text  # lazy: rich (request ids and extra fields are the dump's own text: never markup)

        sequences = self.sequences()
        if sequences is None:
            return None
        diverging = [s for s in sequences if s["tokens_diverging"]]
        diverging.sort(
            key=lambda s: (-s["tokens_diverging_any_layer"], -s["routers_differing_per_token"], s["sequence"])
        )
        extra = [k for k in (self.sequence_extra[0] if self.sequence_extra else {}) if k != "request"]
        table = Table(
            title=f"per sequence: {len(diverging)} of {len(sequences)} diverge"
            + (f"; the {min(n, len(diverging))} that diverge most" if diverging else "")
        )
        for col in (
            "sequence",
            "mb",
            "tokens",
            "diverging >= 1 layer",
            "routers differing / token",
            "first divergent layer",
            *[k.replace("_", " ") for k in extra],
        ):
            table.add_column(col, justify="right")
        for s in diverging[:n]:
            table.add_row(
                Text(str(s["sequence"])),
                str(s["microbatch"]),
                str(s["tokens"]),
                f"{s['tokens_diverging_any_layer']:.2%}",
                f"{s['routers_differing_per_token']:.4f}",
                str(s["first_divergent_layer"]),
                *[Text(str(s[k])) for k in extra],
                style="red",
            )
        return table


def bucket_edges(tokens: int, buckets: int) -> torch.Tensor:
    return torch.linspace(0, tokens, buckets + 1).round().long()
