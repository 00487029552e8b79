"""The project's exception hierarchy: user errors are ``MoEVerifyError`` subclasses, never bare asserts."""


class MoEVerifyError(Exception):
    """Base of every error moeverify raises for bad input or a failed precondition."""


class UsageError(MoEVerifyError):
    """Bad command line, scenario file, name or option (the CLI exits 2)."""


class LayoutError(UsageError):
    """An invalid parallel layout; the message names the rule that broke."""


class RouteError(MoEVerifyError):
    """A route tensor that cannot be recorded or replayed (names layer, rank, micro-batch, expected, got)."""


class DumpError(MoEVerifyError):
    """A routing dump that is corrupt, truncated, missing or inconsistent (names the file)."""


class SubjectError(MoEVerifyError):
    """An export subject that cannot be loaded or yields malformed rows (names rank, row, slot)."""


class EnvironmentProblem(MoEVerifyError):
    """The installed stack does not match what moeverify was written against (names what was expected)."""


class RankDisagreement(MoEVerifyError):
    """Ranks that ran one step in lockstep ended it differently: some raised, others did not (names the ranks)."""
