"""The one error type of the model package."""

from psgd.errors import InputError


class ModelError(InputError):
    """A model could not be found, loaded or built; the message is one line that says why."""
