"""The one error type of the model package."""


class ModelError(ValueError):
    """A model could not be found, loaded or built; the message is one line that says why."""
