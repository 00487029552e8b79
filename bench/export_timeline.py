"""Where the export oracle's time goes: a per-rank timeline of one ``run_subject`` call.

Used by ``bench/export_oracle.py --timeline PATH``. On every rank it records, against one clock
started at the call:

- ``export``: each reference tensor ``bridge.export_hf_weights`` yields, from the request for it to its
  arrival (the feed thread);
- ``row``: each row of the oracle's protocol on the main thread (``oracle._one_row``), with the main
  thread's CPU seconds inside it (a row that waits on another rank burns little CPU);
- ``wait``: the main thread waiting for a reference (``ReferenceFeed.wait_until``) or for an export
  to end before it opens merges (``ReferenceFeed.admit``);
- ``setup``: draining the subject into rows, the lockstep collectives and reading the checkpoint's
  shapes, before the first row;
- ``finish``: draining the reference and the final checks (``ReferenceFeed.finish`` and
  ``Collector.finish_all``).

Rank 0 gathers every rank's events (its own benchmark data) and writes them as JSON, a per-phase
table on stdout and a PNG (one lane per rank and thread).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[dict] = []

    def add(self, kind: str, start: float, end: float, **extra) -> None:
        self.events.append(dict(kind=kind, start=round(start - self.t0, 5), end=round(end - self.t0, 5), **extra))

    def reference(self, iterable):
        """Wrap the reference iterable: one ``export`` event per tensor."""
        it = iter(iterable)
        while True:
            start = time.perf_counter()
            try:
                name, tensor = next(it)
            except StopIteration:
                return
            self.add("export", start, time.perf_counter(), name=name, numel=tensor.numel())
            yield name, tensor

    @contextlib.contextmanager
    def patched(self):
        """Time the oracle's rows, waits and final phase (module attributes restored on exit)."""
        from moeverify.oracles.export import collect, feed, oracle

        saved = [
            (oracle, "_one_row", oracle._one_row),
            (oracle, "_drain", oracle._drain),
            (oracle, "_lockstep", oracle._lockstep),
            (oracle, "checkpoint_shapes", oracle.checkpoint_shapes),
            (feed.ReferenceFeed, "wait_until", feed.ReferenceFeed.wait_until),
            (feed.ReferenceFeed, "admit", feed.ReferenceFeed.admit),
            (feed.ReferenceFeed, "finish", feed.ReferenceFeed.finish),
            (collect.Collector, "finish_all", collect.Collector.finish_all),
        ]

        def timed(kind, fn, cpu=False):
            def wrapper(*args, **kwargs):
                start, c0 = time.perf_counter(), time.thread_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    extra = {"cpu": round(time.thread_time() - c0, 5)} if cpu else {}
                    if kind == "row":
                        extra["index"], extra["row"] = args[0], args[1].row
                    self.add(kind, start, time.perf_counter(), **extra)

            return wrapper

        kinds = ["row", "setup", "setup", "setup", "wait", "wait", "finish", "finish"]
        for (owner, attr, fn), kind in zip(saved, kinds, strict=True):
            setattr(owner, attr, timed(kind, fn, cpu=kind != "wait"))
        try:
            yield self
        finally:
            for owner, attr, fn in saved:
                setattr(owner, attr, fn)


def summarize(per_rank: list[list[dict]], total_s: float) -> list[dict]:
    """Per rank: seconds in each kind (wall, and CPU where recorded), and when the export ended."""
    rows = []
    for rank, events in enumerate(per_rank):
        row = {"rank": rank, "total_s": round(total_s, 3)}
        for kind in ("setup", "export", "row", "wait", "finish"):
            mine = [e for e in events if e["kind"] == kind]
            row[f"{kind}_s"] = round(sum(e["end"] - e["start"] for e in mine), 3)
            if any("cpu" in e for e in mine):
                row[f"{kind}_cpu_s"] = round(sum(e.get("cpu", 0) for e in mine), 3)
        exports = [e["end"] for e in events if e["kind"] == "export"]
        row["export_done_at_s"] = round(max(exports, default=0.0), 3)
        rows.append(row)
    return rows


def slowest_exports(per_rank: list[list[dict]], bare_events: list[list[dict]], n: int = 6) -> list[dict]:
    """Rank 0's slowest tensors to export inside the oracle, against the same tensor in a bare export."""
    bare = {e["name"]: e["end"] - e["start"] for e in bare_events[0]}
    mine = sorted((e for e in per_rank[0] if e["kind"] == "export"), key=lambda e: e["start"] - e["end"])[:n]
    return [
        {
            "name": e["name"],
            "numel": e["numel"],
            "oracle_s": round(e["end"] - e["start"], 3),
            "bare_s": round(bare.get(e["name"], float("nan")), 3),
        }
        for e in mine
    ]


def write(
    path: str, per_rank: list[list[dict]], total_s: float, bare_s: float, *, bare_events: list[list[dict]]
) -> None:
    table = summarize(per_rank, total_s)
    slow = slowest_exports(per_rank, bare_events)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "bare_export_s": round(bare_s, 3),
                "summary": table,
                "slowest_exports_rank0": slow,
                "events": per_rank,
                "bare_events": bare_events,
            },
            indent=1,
        )
    )
    for rows in (table, slow):
        keys = list(rows[0])
        print(" | ".join(keys))
        for row in rows:
            print(" | ".join(str(row.get(k, "")) for k in keys))
    _plot(out.with_suffix(".png"), per_rank, total_s, bare_s)


def _plot(path: Path, per_rank: list[list[dict]], total_s: float, bare_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {
        "setup": "tab:purple",
        "export": "tab:blue",
        "row": "tab:orange",
        "wait": "tab:gray",
        "finish": "tab:green",
    }
    lanes = {"export": 0, "setup": 1, "row": 1, "wait": 1, "finish": 1}
    fig, ax = plt.subplots(figsize=(12, 1 + 0.9 * len(per_rank)))
    for rank, events in enumerate(per_rank):
        for e in events:
            y = rank * 2 + lanes[e["kind"]]
            ax.barh(y, e["end"] - e["start"], left=e["start"], height=0.8, color=colors[e["kind"]], linewidth=0)
    ax.set_yticks(
        [r * 2 + i for r in range(len(per_rank)) for i in (0, 1)],
        [f"rank {r} {lane}" for r in range(len(per_rank)) for lane in ("export thread", "main thread")],
    )
    ax.axvline(bare_s, color="black", linestyle="--", linewidth=1)
    ax.axvline(total_s, color="red", linestyle="--", linewidth=1)
    handles = [Patch(color=c, label=k) for k, c in colors.items()]
    handles += [
        Patch(color="black", label=f"bare export {bare_s:.2f} s"),
        Patch(color="red", label=f"oracle {total_s:.2f} s"),
    ]
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the oracle's start (export events: from the request for a tensor to its arrival)")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title("export oracle timeline (bench/export_oracle.py --timeline)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
