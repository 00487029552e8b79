"""``moeverify run``: scenarios grouped by world size, each group in one torchrun, results collected.

``launch`` is the parent side (torchrun per group, restarts after a crash or hang, deadlines),
``worker`` the per-rank side, ``plan`` the file that passes work between them, ``report`` and
``junit`` the outputs. Check names resolve through ``moeverify.spec.checks``.
"""
