"""The one error base shared by data_tools and hpctrain: input problems reported as one line.

Defined here, in the lower layer, so that hpctrain uses data_tools and never the reverse
(`hpctrain.errors` re-exports it). Messages start with the offending file, key or node.
"""


class UserError(Exception):
    """A problem with the user's input; printed as `error: <message>` and exit status 2."""


def out_of_memory(exc: BaseException) -> bool:
    """Memory (or address space, under `ulimit -v`) ran out: a MemoryError, or a thread that
    could not get its stack."""
    return isinstance(exc, MemoryError) or \
        (isinstance(exc, RuntimeError) and "can't start new thread" in str(exc))
