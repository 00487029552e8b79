"""A tiny agent for Megatron-LM's RL loop: fixed short prompts, a reward read off the response's text.

Imported by Megatron-LM's agent registry (``megatron.rl.agent.registry``) inside ``megatron_lm_rl_job.py``'s
process only: it needs Megatron-LM's ``megatron.rl`` on the path. The reward varies with the response so that GRPO
groups get nonzero advantages; what it rewards does not matter to routing.
"""

from __future__ import annotations

from typing import Any

from megatron.rl.agent.reward_only_agent import RewardOnlyAgent

PROMPTS = ("count to three", "name a colour", "say a number", "spell moe")


class TinyAgent(RewardOnlyAgent):
    """Round-robin prompts; reward = the response's byte sum mod 5, over 4."""

    env_id: str | None = "moeverify_tiny"
    next_prompt: int = 0

    def get_dataset(self, validation: bool = False):
        return list(PROMPTS)

    async def get_prompt(self, validation: bool = False) -> tuple[str, Any]:
        prompt = PROMPTS[self.next_prompt % len(PROMPTS)]
        self.next_prompt += 1
        return prompt, prompt

    async def evaluation_prompts(self, num_prompts: int, validation: bool = False) -> list[tuple[str, Any]]:
        return [(p, p) for p in PROMPTS[:num_prompts]]

    async def get_reward(self, response: str, golden: Any, finish_reason: str) -> float:
        return (sum(response.encode()) % 5) / 4
