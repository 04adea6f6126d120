"""Errors meant for people: what was wrong, where, and what to do."""


class UsageError(ValueError):
    """Bad input from the user (a flag, a yaml key, a path). Entry points print it as one line and exit 2."""
