"""The ``moeverify`` commands, one module each; ``moeverify.cli`` holds the entry point and dispatch.

``moeverify.cli`` builds the parser and imports a command's module only where its imports are light or the
command is the one about to run: ``dump``'s verbs load torch and safetensors through the dump format, so
``--help``, ``run --list`` and scenario validation never import them.

- ``run``: ``moeverify run`` (arguments, selection, preflight, run directory; the launching is ``moeverify.runner``);
- ``common``: what the commands share (exit codes, the repository root, ``--model``/``--model-set``).
- ``doctor``: ``moeverify doctor`` (installed stack, backend, one tiny model built).
- ``bench``: ``moeverify bench`` (the scripts of bench/).
- ``dump``: ``moeverify dump``'s parser with ``inspect`` and ``finalize``; ``dump_diff``, ``dump_convert`` and
  ``dump_plot`` (``diff --plot``) hold the other verbs, ``dump_errors`` their exit codes and input guard,
  ``dump_outputs`` the checks of their output paths (never an input, never one file twice).

A new command is a module here with ``register(subparsers)`` (setting ``func``), added to ``cli.build_parser``.
"""
