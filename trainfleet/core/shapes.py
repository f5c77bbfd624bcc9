"""The two kinds of data shape the control plane speaks, as pydantic v2 bases, and how a refusal
reads to a person.

    Strict                      our own shapes: an unknown field is an error
    Open                        shapes owned by others (AWS's events, the trainer's config
                                sections): unknown fields are kept and passed on
    validation_message(error)   a ValidationError as "field.path: problem (got value)" lines
"""

from pydantic import BaseModel, ConfigDict, ValidationError


class Strict(BaseModel):
    """Our own shapes: unknown fields are an error (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    """Shapes owned by others (AWS, the trainer): they add fields over time, so unknown ones are
    kept and passed on, never refused."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


def validation_message(error: ValidationError) -> str:
    """One line per problem, `field.path: message (got value)`, for an execution's error cause."""
    lines = []
    for problem in error.errors(include_url=False):
        where = ".".join(str(part) for part in problem["loc"]) or "(input)"
        message = problem["msg"].removeprefix("Value error, ")
        got = problem.get("input")
        shown = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
        lines.append(f"{where}: {message}{shown}")
    return "\n".join(lines)

