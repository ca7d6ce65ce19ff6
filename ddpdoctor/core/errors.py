"""Errors that end a run with one line for the user, never a traceback."""


class UsageError(Exception):
    """Bad flags, bad environment or unreadable input: the CLI prints the message and exits 3.

    The message must say what is wrong and how to fix it, on one line.
    """
