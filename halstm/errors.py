"""halstm's exceptions, in one module that imports nothing of halstm's."""


class CompileError(RuntimeError):
    """A pipeline failed to compile; the message names cell, target and schedule."""


class KernelError(RuntimeError):
    """A compiled pipeline reported an error."""


class CacheError(RuntimeError):
    """The kernel cache folder cannot be used (not a folder, not writable,
    or writable by other users: loading a library from it runs its code)."""


class LibraryError(ValueError):
    """A compiled library or its manifest is damaged or not halstm's."""
