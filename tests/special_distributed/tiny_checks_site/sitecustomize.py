"""Test-side hook: adds the tiny checks of ``test_runner_checks.py`` to the declared checks in every process.

The runner's distributed tests put this directory (and ``tests/special_distributed``) on ``PYTHONPATH``
(``tiny_checks.env``); Python imports ``sitecustomize`` at start-up, so ``moeverify run``, torchrun and
every rank it starts know the same checks. Nothing in the product reads it.
"""

from moeverify.spec import checks

TINY_CHECKS = {
    "passing": "passing",
    "passing2": "passing",
    "failing": "failing",
    "raise1": "raise_on_rank1",
    "hang1": "hang_on_rank1",
    "echo": "echo_options",
    "kill1": "sigkill_on_rank1",
    "sleep": "sleep_long",
    "raise_last": "raise_on_last_rank",
}

checks.CHECKS.update(
    {name: checks.CheckSpec(name=name, entry=f"test_runner_checks:{fn}") for name, fn in TINY_CHECKS.items()}
)
