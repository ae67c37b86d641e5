"""One error type for every mistake a user can make.

The CLI turns a :class:`DPFLError` into a single ``error: ...`` line and a non-zero exit; anything
else is a bug and keeps its traceback.
"""


class DPFLError(ValueError):
    """Bad input from the user: a scenario field, a CLI parameter, a malformed client message."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)
