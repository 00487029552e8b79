"""``moeverify run``: scenarios grouped by world size, each group in one torchrun, results collected.

Parent side: ``select`` (which scenarios run where, decided up front), ``probe`` (user plugins loaded in a
child Python before launch), ``launch`` (torchrun per group, restarts after a crash or hang, deadlines),
``lifetime`` (no process outlives its starter), ``interrupts`` (Ctrl-C at safe points), ``nodes`` (several
nodes), ``diagnose`` (which scenario, check and rank broke), ``outputs`` (``--json``/``--junit`` kept
current), ``report`` and ``junit`` (the table, JSON and XML). Rank side: ``worker``. Between them: ``plan``,
the file one attempt runs from. Check names resolve through ``moeverify.spec.checks``.
"""
