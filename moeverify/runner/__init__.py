"""``moeverify run``: scenarios grouped by world size, each group in one torchrun, results collected.

``launch`` is the parent side (torchrun per group, restarts after a crash or hang, deadlines),
``worker`` the per-rank side, ``plan`` the file that passes work between them, ``report`` and
``junit`` the outputs, ``checks`` the check names a run knows (the registry plus test-only extras).
"""
