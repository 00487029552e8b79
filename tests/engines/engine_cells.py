"""Every conformance comparison of a session (what, counts), written to runs/engine_cells.json at its end."""

CELLS: list[dict] = []
