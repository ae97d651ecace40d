"""Errors shown to users: each names what was wrong and where."""

from __future__ import annotations

from pydantic import ValidationError


class RetexoError(Exception):
    """Base class for errors the CLI reports without a traceback (exit code 2).

    Pickled as their message and attributes, so that one raised in a worker process (a process
    pool's job) reaches its parent whole, whatever its subclass's constructor takes."""

    def __reduce__(self) -> tuple[object, tuple[type, str, dict[str, object]]]:
        return (_restored, (type(self), str(self), self.__dict__))


def _restored(cls: type[RetexoError], message: str, state: dict[str, object]) -> RetexoError:
    """The error ``cls`` with ``message`` and attributes ``state``, without calling its constructor."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class InputError(RetexoError):
    """Bad user input: names the file, the column and the first offending row when known."""

    def __init__(self, file: str, message: str, column: str | None = None, row: int | None = None):
        self.file = str(file)
        self.column = column
        self.row = row
        where = [self.file]
        if column is not None:
            where.append(f"column '{column}'")
        if row is not None:
            where.append(f"row {row}")
        super().__init__(f"{', '.join(where)}: {message}")


class StoreError(RetexoError):
    """The store is missing something a command needs, or is inconsistent."""


class ConfigError(RetexoError):
    """A configuration value is invalid; the message names the key."""


def describe_validation_error(exc: ValidationError, origin: str) -> str:
    """One line: ``<origin>: <key> = <value>: <what was expected>; ...`` for every error."""
    problems = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        value = error.get("input")
        shown = f" = {value!r}" if key and not isinstance(value, dict) else ""
        problems.append(f"{key}{shown}: {message}" if key else message)
    return f"{origin}: " + "; ".join(problems)
