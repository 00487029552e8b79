"""Checks against a real rollout engine, run as its own process (``moeverify.engines``).

- ``conformance``: an engine's captured routes against the trainer's native routing of the same tokens and weights,
  per layer and position, near ties told apart from wrong routes.
"""
