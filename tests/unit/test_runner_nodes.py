"""Several nodes: where a node stands (flags, torchrun's env, Slurm's env) and how groups are shared."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from moeverify.errors import UsageError
from moeverify.runner import launch, nodes


def _args(nnodes=None, node_rank=None, rdzv_endpoint=None):
    return NS(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)


def test_flags_win_over_environment():
    spec = nodes.from_args(_args("2", 1, "n0:29400"), env={"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "x"})
    assert spec == nodes.NodeSpec(nnodes=2, node_rank=1, host="n0", port=29400)


def test_torchrun_and_slurm_environments():
    assert nodes.from_args(
        _args(), env={"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "7"}
    ) == nodes.NodeSpec(nnodes=2, node_rank=1, host="h", port=7)
    slurm = {"SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09],cpu1"}
    assert nodes.from_args(_args(), env=slurm) == nodes.NodeSpec(nnodes=3, node_rank=2, host="gpu07", port=29500)
    assert nodes.from_args(_args(), env={}) is None
    assert nodes.from_args(_args("1"), env={}) is None


@pytest.mark.parametrize(
    "nodelist, host",
    [("a", "a"), ("a,b", "a"), ("n[3-5]", "n3"), ("n[03,7-9]", "n03"), ("rack1-n[10-11],x", "rack1-n10")],
)
def test_first_slurm_host(nodelist, host):
    assert nodes.first_slurm_host(nodelist) == host


@pytest.mark.parametrize(
    "args, env, message",
    [
        (_args(node_rank=1), {}, "need --nnodes"),
        (_args("2"), {}, "give --node-rank"),
        (_args("2", 2, "h:1"), {}, "not below --nnodes 2"),
        (_args("2", 1), {}, "give --rdzv-endpoint"),
        (_args("2", 1, "h"), {}, "expected HOST:PORT"),
        (_args("2", 1, "h:x"), {}, "expected an integer"),
        (_args("2", 1, "h:65500"), {}, "200 ports above"),
        (_args("two", 1, "h:1"), {}, "--nnodes: expected an integer"),
        (_args("0", 0, "h:1"), {}, ">= 1"),
    ],
)
def test_bad_node_settings_are_refused(args, env, message):
    with pytest.raises(UsageError, match=message):
        nodes.from_args(args, env=env)


def test_groups_spread_only_when_every_node_gets_an_equal_share():
    spec = nodes.NodeSpec(nnodes=2, node_rank=1, host="h", port=100)
    assert [spec.runs_everywhere(w) for w in (1, 2, 3, 4, 16)] == [False, True, False, True, True]
    assert spec.per_node(16) == 8 and spec.per_node(1) == 1 and spec.launch_port(0) == 101


def test_torchrun_command_static_rendezvous_for_a_spread_group():
    spec = nodes.NodeSpec(nnodes=2, node_rank=1, host="h", port=100)
    cmd = launch.torchrun_command(world_size=8, plan_file="p.json", node=spec, launch=3)
    text = " ".join(cmd)
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 4 --rdzv-backend static --master-addr h --master-port 104" in text
    local = " ".join(launch.torchrun_command(world_size=1, plan_file="p.json", node=spec))
    assert "--nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint localhost:0" in local


def test_a_node_that_loaded_other_flags_is_told_which():
    """Nodes compare digests of what they loaded; a mismatch names the part, and an option or the timeout by value."""
    from moeverify.runner import nodes

    base = {"scenarios": [{"family": "qwen3_moe"}], "options": {"subject": "sharded"}, "timeout": 600, "nnodes": 2}
    node0 = nodes.loaded_parts(base)
    assert nodes.loaded_parts(dict(base)) == node0
    other = nodes.loaded_parts({**base, "options": {"subject": "gather"}, "timeout": 900})
    text = nodes.loaded_difference(node0, other)
    assert "options subject: 'gather' != 'sharded'" in text and "timeout: 900 != 600" in text, text
    files = nodes.loaded_parts({**base, "scenarios": [{"family": "qwen2"}]})
    assert nodes.loaded_difference(node0, files) == "scenarios (the scenario files or their selection)"
