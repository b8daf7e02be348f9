"""The error of generation's library functions and command: invalid arguments, named with the fix."""


class GenerateError(ValueError):
    """Invalid generation arguments (the message names the argument, its value and what is allowed)."""
