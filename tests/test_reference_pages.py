"""The reference pages made from the code (trainfleet/operator/reference.py) are what the code
makes now: a RunSpec field or a command option added, changed or documented anew changes its page,
and this fails until `make docs` has written it."""

from pathlib import Path

import pytest

from trainfleet.cli import reference_pages
from trainfleet.core.runspec import RunSpec

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path, text", sorted(reference_pages().items()))
def test_the_committed_page_is_what_the_code_makes(path, text):
    assert (REPO / path).read_text() == text, f"{path} is behind the code: run `make docs`"


def test_the_runspec_page_names_every_field_with_its_docstring():
    page = reference_pages()["docs/RUNSPEC.md"]
    for name in RunSpec.model_fields:
        assert f"| `{name}` |" in page
    assert "| `keep_last` | int, ≥ 2 | `3` | Committed checkpoints kept." in page
    assert "| `microbatches` | int | required | Microbatches per step per replica" in page


def test_the_cli_page_gives_every_command_that_names_a_stack_the_stack_option():
    page = reference_pages()["docs/CLI.md"]
    for command in ("run start", "run list", "run status", "run watch", "run logs", "run stop", "run report",
                    "checkpoint list", "checkpoint export", "sample", "local deploy"):
        section = page.split(f"## `trainfleet {command}`", 1)[1].split("\n## ", 1)[0]
        assert "--stack NAME" in section, command
