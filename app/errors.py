"""Errors with a one-line message meant for the user."""


class StrataError(Exception):
    """An error with a one-line message meant for the user."""
