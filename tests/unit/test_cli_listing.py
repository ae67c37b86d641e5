"""`dpfl --help` and each group's `--help` list a command's first paragraph as one flowing text."""
from typer.testing import CliRunner

from cli.main import app


def _commands(typer_app):
    for info in typer_app.registered_commands:
        yield info
    for group in typer_app.registered_groups:
        yield from _commands(group.typer_instance)


def test_every_listed_command_has_a_one_line_summary():
    infos = list(_commands(app))
    assert len(infos) >= 15
    for info in infos:
        assert info.short_help and "\n" not in info.short_help, info.callback.__name__


def test_the_listing_wraps_to_the_terminal_not_to_the_docstring():
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    # sweep's docstring breaks its first line after "side by": at 80 columns the listing does not
    assert any("side by side; write sweep.csv" in line for line in result.output.splitlines()), result.output


def test_reproduce_list_names_every_run_in_one_column_per_paper():
    result = CliRunner().invoke(app, ["reproduce", "--list"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    blocks: list[list[str]] = []
    for line in result.output.splitlines():
        if line.startswith("  "):
            blocks[-1].append(line)
        else:
            blocks.append([])
    assert len([b for b in blocks if b]) >= 5
    for block in filter(None, blocks):
        # the scenario file starts in the same column on every line of a paper
        starts = {line.index(".yaml") - len(line.split()[1]) + len(".yaml") for line in block}
        assert len(starts) == 1, block
