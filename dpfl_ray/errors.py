"""One error type for every mistake a user can make.

The CLI turns a :class:`DPFLError` into a single ``error: ...`` line and a non-zero exit; anything
else is a bug and keeps its traceback.
"""


class DPFLError(ValueError):
    """Bad input from the user: a scenario field, a CLI parameter, a malformed client message."""

    def __init__(self, message: str, field: str | None = None):
        self.field, self.detail = field, message
        super().__init__(f"{field}: {message}" if field else message)

    def about(self, field: str) -> "DPFLError":
        """The same error, said of ``field``: a library function names its own parameter, a caller
        that passed it a scenario's field names that."""
        return DPFLError(self.detail, field=field)
