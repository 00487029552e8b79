"""Several nodes: every node runs its share of each world-size group; node 0 gathers and reports.

Each node starts ``moeverify run`` with the same scenario files and ``--nnodes N --node-rank R
--rdzv-endpoint HOST:PORT`` (or torchrun's ``NNODES``/``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``, or Slurm's
``SLURM_NNODES``/``SLURM_NODEID`` with the first host of ``SLURM_JOB_NODELIST``). Node 0 hosts a small control
store (a ``torch.distributed.TCPStore`` on PORT); the torchrun launches use PORT+1, PORT+2, ... (static
rendezvous, so node R holds global ranks ``R*k .. R*k+k-1`` and rank 0, which writes the results, is on
node 0).

Protocol, over the store (keys are plain strings, values JSON; nothing is unpickled):
- ``join/R``: node R's host, pid and the digest of what it loaded; node 0 waits for every node and refuses
  a node whose scenarios, options, backend or timeout differ from its own.
- ``beat/R``: each node's heartbeat (every second); a node silent for ``timeouts.NODE_DEAD_AFTER_S`` is named dead.
- ``launch/A`` (node 0, for the A-th multi-node torchrun): world size, first scenario index, port; or
  ``done`` with node 0's exit code, which the other nodes then return.
- ``report/A/R`` (node R after that torchrun): its ranks' event and stack files and its torchrun log, which
  node 0 writes into its own attempt directory before diagnosing, so blame names the rank that failed,
  wherever it ran.

A world size that is not a multiple of N (a 1-rank group on 2 nodes) runs on node 0 alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from moeverify.errors import UsageError
from moeverify.spec import timeouts

MAX_FILE_BYTES = 1 << 20  # per rank file copied to node 0 (stacks, events)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """Where this node stands among ``nnodes``."""

    nnodes: int
    node_rank: int
    host: str
    port: int

    def runs_everywhere(self, world_size: int) -> bool:
        """Whether a group of ``world_size`` ranks is spread over every node (else node 0 runs it alone)."""
        return world_size >= self.nnodes and world_size % self.nnodes == 0

    def per_node(self, world_size: int) -> int:
        return world_size // self.nnodes if self.runs_everywhere(world_size) else world_size

    def launch_port(self, launch: int) -> int:
        return self.port + 1 + launch


def _int(text: str, what: str, *, minimum: int) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise UsageError(f"{what}: expected an integer, got {text!r}") from None
    if value < minimum:
        raise UsageError(f"{what}: expected an integer >= {minimum}, got {value}")
    return value


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``node[03-05,9],gpu1`` -> ``node03``."""
    head = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not head:
        raise UsageError(f"SLURM_JOB_NODELIST {nodelist!r}: cannot read its first host; give --rdzv-endpoint")
    prefix, ranges = head.group(1), head.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def from_args(args, env: Mapping[str, str] | None = None) -> NodeSpec | None:
    """The node spec of this run (None for a single node): flags, else torchrun's env, else Slurm's."""
    env = os.environ if env is None else env
    nnodes = args.nnodes or env.get("NNODES") or env.get("SLURM_NNODES")
    if nnodes is None:
        if args.node_rank is not None or args.rdzv_endpoint:
            raise UsageError("--node-rank and --rdzv-endpoint need --nnodes N (or NNODES / SLURM_NNODES)")
        return None
    nnodes = _int(nnodes, "--nnodes", minimum=1)
    if nnodes == 1:
        return None
    node_rank = args.node_rank if args.node_rank is not None else env.get("NODE_RANK", env.get("SLURM_NODEID"))
    if node_rank is None:
        raise UsageError(f"--nnodes {nnodes}: give --node-rank R (or NODE_RANK / SLURM_NODEID)")
    node_rank = _int(node_rank, "--node-rank", minimum=0)
    if node_rank >= nnodes:
        raise UsageError(f"--node-rank {node_rank} is not below --nnodes {nnodes}")
    endpoint = args.rdzv_endpoint
    if not endpoint and env.get("MASTER_ADDR"):
        endpoint = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}"
    if not endpoint and env.get("SLURM_JOB_NODELIST"):
        endpoint = f"{first_slurm_host(env['SLURM_JOB_NODELIST'])}:{env.get('MASTER_PORT', '29500')}"
    if not endpoint:
        raise UsageError(f"--nnodes {nnodes}: give --rdzv-endpoint HOST:PORT (node 0's address), or MASTER_ADDR")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host:
        raise UsageError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT")
    port = _int(port, "--rdzv-endpoint port", minimum=1)
    if port > 65535 - 200:
        raise UsageError(f"--rdzv-endpoint port {port}: needs the 200 ports above it free (at most 65335)")
    return NodeSpec(nnodes=nnodes, node_rank=node_rank, host=host, port=port)


def digest(plan_like: object) -> str:
    return hashlib.sha256(json.dumps(plan_like, sort_keys=True, default=str).encode()).hexdigest()[:16]


# what a node loaded, by part: parts this small travel as they are, so a mismatch names the value that differs
_SHOWN = ("options", "timeout", "groups", "nnodes")


def loaded_parts(parts: Mapping[str, object]) -> dict:
    """``{"digests": {part: digest}, "shown": {small part: its JSON value}}`` of what a node loaded."""
    return {
        "digests": {name: digest(value) for name, value in parts.items()},
        "shown": {name: json.loads(json.dumps(parts[name], default=str)) for name in _SHOWN if name in parts},
    }


def loaded_difference(mine: Mapping, theirs: Mapping) -> str:
    """What differs between two ``loaded_parts``: each differing part, with the values of a shown one (an option
    by key)."""
    out: list[str] = []
    for name, value in mine["digests"].items():
        if theirs["digests"].get(name) == value:
            continue
        a, b = theirs["shown"].get(name), mine["shown"].get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            keys = sorted(set(a) | set(b))
            out.extend(f"{name} {k}: {a.get(k)!r} != {b.get(k)!r}" for k in keys if a.get(k) != b.get(k))
        elif name in mine["shown"]:
            out.append(f"{name}: {a!r} != {b!r}")
        else:
            out.append(f"{name} (the scenario files or their selection)" if name == "scenarios" else name)
    return "; ".join(out) or "unknown"


class Control:
    """The control store shared by the nodes' ``moeverify run`` processes (node 0 hosts it)."""

    def __init__(self, node: NodeSpec, *, loaded: Mapping[str, object], timeout_s: float | None = None):
        """``loaded``: what this node loaded, by part (``loaded_parts``: every node must load the same)."""
        from torch.distributed import TCPStore  # lazy: torch

        timeout_s = timeouts.NODE_JOIN_S if timeout_s is None else timeout_s
        self.node = node
        try:
            self.store = TCPStore(
                node.host,
                node.port,
                is_master=node.node_rank == 0,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:
            role = "host" if node.node_rank == 0 else "reach node 0's"
            raise UsageError(
                f"node {node.node_rank}: cannot {role} control store at {node.host}:{node.port}: {exc}"
            ) from None
        self.loaded = loaded_parts(loaded)
        self._stop = threading.Event()
        self._beat()
        threading.Thread(target=self._beat_loop, name="moeverify-node-beat", daemon=True).start()
        self.put(f"join/{node.node_rank}", {"host": socket.gethostname(), "pid": os.getpid(), "loaded": self.loaded})

    # -- plain JSON values
    def put(self, key: str, value: object) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str, *, timeout_s: float, watch: int | None = None) -> Any:
        """Wait for ``key``, then its JSON value; while waiting, a watched node that stops beating is named dead."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.store.check([key]):
                return json.loads(self.store.get(key))
            if watch is not None and self.dead(watch):
                raise NodeLost(
                    f"node {watch} stopped responding (no heartbeat for {timeouts.NODE_DEAD_AFTER_S:.0f} s) "
                    f"while node {self.node.node_rank} waited for {key}"
                )
            if time.monotonic() > deadline:
                raise NodeLost(f"node {self.node.node_rank}: {key} did not come within {timeout_s:.0f} s")
            time.sleep(0.2)

    def close(self) -> None:
        self._stop.set()

    # -- liveness
    def _beat(self) -> None:
        self.store.set(f"beat/{self.node.node_rank}", repr(time.time()))

    def _beat_loop(self) -> None:
        while not self._stop.wait(timeouts.NODE_BEAT_S):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 (the store went away: node 0 ended)
                return

    def dead(self, node_rank: int) -> bool:
        key = f"beat/{node_rank}"
        if not self.store.check([key]):
            return False
        return time.time() - float(self.store.get(key).decode()) > timeouts.NODE_DEAD_AFTER_S

    def dead_nodes(self) -> list[int]:
        return [r for r in range(self.node.nnodes) if r != self.node.node_rank and self.dead(r)]

    # -- node 0
    def wait_joined(self) -> None:
        loaded = self.loaded
        for rank in range(1, self.node.nnodes):
            try:
                joined = self.get(f"join/{rank}", timeout_s=timeouts.NODE_JOIN_S)
            except NodeLost:
                raise UsageError(
                    f"node {rank} did not join within {timeouts.NODE_JOIN_S:.0f} s (is `moeverify run "
                    f"--nnodes {self.node.nnodes} --node-rank {rank}` running, with "
                    f"--rdzv-endpoint {self.node.host}:{self.node.port}?)"
                ) from None
            if joined["loaded"]["digests"] != loaded["digests"]:
                self.put("launch/0", {"done": True, "exit": 2})
                raise UsageError(
                    f"node {rank} ({joined['host']}) loaded other scenarios, options, backend or timeout than "
                    f"node 0 (node {rank}'s != node 0's: {loaded_difference(loaded, joined['loaded'])}): every node "
                    "must run `moeverify run` with the same files and flags"
                )

    def collect_reports(self, launch: int, directory: Path) -> list[tuple[int, str]]:
        """Write the other nodes' rank files into ``directory``; returns (node, why) of each node that did not
        report."""
        missing = []
        for rank in range(1, self.node.nnodes):
            try:
                report = self.get(f"report/{launch}/{rank}", timeout_s=timeouts.NODE_REPORT_S, watch=rank)
            except NodeLost as exc:
                missing.append((rank, str(exc)))
                continue
            for name, (text, mtime) in report["files"].items():
                if not re.fullmatch(r"rank\d+\.(events\.jsonl|stacks\.txt)", name):
                    continue  # only rank files, never a path
                path = directory / name
                path.write_text(text)
                os.utime(path, (mtime, mtime))
            with open(directory / "torchrun.log", "a") as log:
                log.write(f"\n----- node {rank} torchrun.log -----\n{report['torchrun_log']}")
        return missing


class NodeLost(Exception):
    """Another node stopped responding, or did not answer in time."""


def report_files(directory: Path, ranks: range) -> dict:
    """This node's ranks' event and stack files (and torchrun log) for node 0."""
    files = {}
    for rank in ranks:
        for name in (f"rank{rank}.events.jsonl", f"rank{rank}.stacks.txt"):
            path = directory / name
            if path.exists():
                files[name] = (path.read_text(errors="replace")[-MAX_FILE_BYTES:], path.stat().st_mtime)
    log = directory / "torchrun.log"
    return {"files": files, "torchrun_log": log.read_text(errors="replace")[-MAX_FILE_BYTES:] if log.exists() else ""}
