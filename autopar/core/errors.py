"""Errors autopar raises on purpose, each naming the problem, the numbers and the fix."""
from __future__ import annotations


class CaptureError(RuntimeError):
    """The model (with its loss function) could not be captured as one graph.

    ``cause`` is the original exception; ``hint`` says what to change.
    """

    def __init__(self, message: str, *, cause: BaseException | None = None, hint: str = "") -> None:
        self.cause = cause
        self.hint = hint
        text = message
        if cause is not None:
            text += f"\n  cause: {type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
        if hint:
            text += f"\n  hint: {hint}"
        super().__init__(text)


class RankError(RuntimeError):
    """A rank of a launched job raised or died; names the rank and carries its traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed:\n{detail}")


class UnsupportedError(ValueError):
    """A combination autopar does not run (yet): named with its numbers, never computed wrong."""
