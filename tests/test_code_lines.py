"""tools/code_lines.py: what a line of code is (the corners of comments, docstrings and strings), the code diff
against `diff`, and the command line."""

import os
import subprocess
import sys

from conftest import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
from code_lines import changed_lines, code_diff, code_lines, count, main_lines  # noqa: E402


def test_the_corners_of_comments_docstrings_and_strings():
    source = (
        'def only_a_docstring():\n'
        '    """Nothing else."""  # and a comment\n'
        '\n'
        'def parenthesized():\n'
        '    ("a docstring"\n'
        '     " in two pieces")\n'
        '    return 1\n'
        'x = "a # in a string"  # a comment\n'
        'y = 1 + \\\n'
        '    2  # after a continuation\n'
        'z = f"""{x}\n'
        '\n'
        '{y}"""\n'
        'w = [1,  # one\n'
        '     # between\n'
        '     2]\n'
        '"a bare string statement"; v = 3\n'
        'u = "ünïcode"; "a docstring after a statement"\n'
        '\t\n'
    )
    assert code_lines(source) == [
        'def only_a_docstring():',
        'def parenthesized():',
        '    return 1',
        'x = "a # in a string"',
        'y = 1 + \\',
        '    2',
        'z = f"""{x}',
        '',
        '{y}"""',
        'w = [1,',
        '     2]',
        '; v = 3',
        'u = "ünïcode";',
    ]
    assert code_lines("") == [] and code_lines("# only\n\n") == [] and code_lines('"""Only a docstring."""') == []
    assert code_lines("x = 1") == ["x = 1"]  # no newline at the end


def test_main_lines_count_the_decorator_and_not_the_docstring():
    source = 'import x\n\n\n@decorate\ndef main():\n    """Doc,\n\n    long."""\n    # why\n    return 1\n'
    assert main_lines(source) == 3
    assert main_lines("def other():\n    pass\n") is None


def test_the_code_diff_is_diff_of_the_code_lines(tmp_path):
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("x = 1\ny = 2\nz = 3\n")
    b.write_text('"""A fork."""\nx = 1\n\n# the fork\'s idea\ny = 20  # changed\nz = 3\nw = 4\n')
    c.write_text("x = 1\ny = 20\nz = 3\nw = 4\n")
    assert count(str(b)) == 4
    assert code_diff(str(a), str(b)) == changed_lines(str(a), str(c)) == 3  # y removed and added, w added
    assert changed_lines(str(a), str(b)) == 6  # the raw diff counts the docstring, the blank and comment lines


def test_the_command_line(tmp_path):
    (tmp_path / "a.py").write_text("def main():\n    return 1\n")
    (tmp_path / "b.py").write_text('def main():\n    """Doc."""\n    return 2  # two\n')
    tool = os.path.join(REPO_ROOT, "tools", "code_lines.py")
    out = subprocess.run([sys.executable, tool, "--root", str(tmp_path), "--pairs", "a.py:b.py", "a.py:gone.py"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines()]
    assert ["a.py", "2", "2"] in rows and ["b.py", "2", "3"] in rows  # file, lines of code, wc -l
    assert ["a.py", "2"] in rows and ["b.py", "2"] in rows  # each main's lines of code
    assert ["a.py", "->", "b.py", "2", "3"] in rows  # the code diff, the raw diff
    assert ["a.py", "->", "gone.py", "(missing", "gone.py)"] in rows
    bad = subprocess.run([sys.executable, tool, "--pairs", "a.py"], capture_output=True, text=True)
    assert bad.returncode == 2 and "a.py:b.py" in bad.stderr
