"""halstm's exceptions, in one module that imports nothing of halstm's."""


class CompileError(RuntimeError):
    """A pipeline failed to compile; the message names cell, target and schedule."""


class KernelError(RuntimeError):
    """A compiled pipeline reported an error."""
