"""A worker's code= runs as CML's engine, an IPython kernel, runs a cell (agent_program.run_cell)."""

from __future__ import annotations

import pytest

from cmlcluster.agent.program import cell_source, is_one_shell_command, run_cell


@pytest.mark.parametrize(
    "code, source",
    [
        # A notebook's indented triple-quoted string: the common indentation goes.
        ("\n    import os\n    if True:\n        print(os.sep)\n", "import os\nif True:\n    print(os.sep)\n"),
        ("!echo hi $HOME", "get_ipython().system('echo hi $HOME')\n"),
        ("%env A=1", "get_ipython().run_line_magic('env', 'A=1')\n"),
        ("files = !ls", "files = get_ipython().getoutput('ls')\n"),
        ("x = 1\n!echo {x}\n", "x = 1\nget_ipython().system('echo {x}')\n"),
    ],
)
def test_cell_source_is_what_ipython_makes_of_a_cell(code, source):
    assert cell_source(code) == source


@pytest.mark.parametrize(
    "code, one",
    [
        ("!exit 3", True),
        ("\n    !python train.py \\\n        --epochs 3\n", True),  # one command on two lines
        ("# a comment\n!exit 3\n", True),
        ("!cd data\n!make", False),
        ("print(1)\n!exit 3", False),
        ("files = !ls", False),
        ("%env A=1", False),
        ("print(", False),
    ],
)
def test_only_a_cell_of_one_shell_command_is_a_shell_command(code, one):
    assert is_one_shell_command(cell_source(code)) is one


def test_a_cells_shell_commands_write_to_the_streams_and_set_exit_code(shell, capsys):
    # `shell`: a real IPython shell, as the engine's; run_cell runs `!cmd` through it.
    code = """
        n = 2
        !echo {n} from the shell; echo on stderr >&2; exit 4
        print("exit code", _exit_code)
    """
    assert run_cell(code) == 0  # a failing command among other lines does not fail the cell
    assert capsys.readouterr() == ("2 from the shell\nexit code 4\n", "on stderr\n")
    assert run_cell("  !exit 3") == 3
    assert "system" not in vars(shell)  # the shell's own `system` again, once the cell is done
    with pytest.raises(IndentationError):
        run_cell("if True:\n  x = 1\n    y = 2")  # run_program prints it and exits 1
