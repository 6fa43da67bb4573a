"""Count code, not comments (issue 49): the sizes of the scripts and the forks' diffs, measured in lines of code.

A line of code is a line of a Python file that still holds something once these are gone:
- every comment (Python's tokenizer finds them), a trailing one too: `x = 1  # why` is the code line `x = 1`;
- every docstring: a module's, a class's, a function's, and any other bare string expression statement (such as the
  string under a dataclass field that documents it): a statement that is a lone string literal does nothing;
- blank lines (and the whitespace at the end of a line).
A string that is not a docstring is code, every line of it: a multi-line prompt template counts whole, its blank
lines too. Each kept line keeps its indentation, so two files reduced to their code lines diff as the files do.

    code_lines(source)   the lines of code of a source text, in order (a list of str)
    count(path)          how many lines of code a file holds
    code_diff(a, b)      how many lines start with < or > in `diff` of the two files reduced to their code lines

Run as a script it prints, for the repository this file lives in: every top-level *.py file's lines of code beside
its `wc -l`, every top-level `main`'s lines of code (its docstring not counted), and each fork's code diff beside the
raw `diff a b | grep -c '^[<>]'`, for the forks FORKS or the pairs given with --pairs a.py:b.py ..."""

import argparse
import ast
import glob
import io
import os
import shutil
import subprocess
import sys
import tempfile
import tokenize

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORKS = [("ppo.py", "rloo.py"), ("rloo.py", "grpo.py"), ("rloo.py", "reinforce_pp.py"), ("dpo.py", "kto.py"),
         ("dpo.py", "online_dpo.py")]
STRING_NODES = (ast.Constant, ast.JoinedStr)


def docstring_nodes(tree: ast.AST) -> list:
    """Every statement that is a lone string literal (a docstring: a module's, class's or function's, or the string
    that documents a dataclass field or another statement): ast.Expr nodes whose value is a str constant."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)]


def _char_col(line: str, byte_col: int) -> int:
    """ast's column (a UTF-8 byte offset) as a character offset into the line."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def numbered_code_lines(source: str) -> list:
    """[(line number, line of code)] for a source text: its lines with comments and docstrings cut out, rstripped,
    blank ones dropped except inside a multi-line string that is code."""
    lines = source.splitlines()
    cut = {}  # line number (1-based) -> [(start column, end column or None for the line's end)] to remove
    string_rows = set()  # lines inside a multi-line string (after its first line): kept even when blank
    for node in docstring_nodes(ast.parse(source)):
        first, last = node.lineno, node.end_lineno
        start, end = _char_col(lines[first - 1], node.col_offset), _char_col(lines[last - 1], node.end_col_offset)
        if first == last:
            cut.setdefault(first, []).append((start, end))
        else:
            cut.setdefault(first, []).append((start, None))
            for row in range(first + 1, last):
                cut.setdefault(row, []).append((0, None))
            cut.setdefault(last, []).append((0, end))
    open_strings = []  # the first lines of the f-strings being read (Python 3.12 tokenizes an f-string in pieces)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            cut.setdefault(token.start[0], []).append((token.start[1], None))
        elif token.type == tokenize.STRING:
            string_rows.update(range(token.start[0] + 1, token.end[0] + 1))
        elif tokenize.tok_name.get(token.type) in ("FSTRING_START", "TSTRING_START"):
            open_strings.append(token.start[0])
        elif tokenize.tok_name.get(token.type) in ("FSTRING_END", "TSTRING_END"):
            string_rows.update(range(open_strings.pop() + 1, token.end[0] + 1))
    out = []
    for number, line in enumerate(lines, start=1):
        kept, removed = line, False
        for start, end in sorted(cut.get(number, []), reverse=True):  # from the right, so columns stay valid
            kept, removed = kept[:start] + ("" if end is None else kept[end:]), True
        if removed:
            kept = kept.rstrip()
            if kept.strip() in (";", ""):  # all that is left of `"doc"; ` or of a comment-only line
                continue
        kept = kept.rstrip()
        if kept.strip() or (number in string_rows and not removed):
            out.append((number, kept))
    return out


def code_lines(source: str) -> list:
    """The lines of code of a source text, in order (see the module docstring)."""
    return [line for _, line in numbered_code_lines(source)]


def count(path: str) -> int:
    """How many lines of code the file at path holds."""
    with open(path) as f:
        return len(code_lines(f.read()))


def first_line(node: ast.AST) -> int:
    """A definition's first line, its decorators included."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def count_in(source: str, node: ast.AST) -> int:
    """How many lines of code a node of the source's tree spans (a definition: from its first decorator to its last
    line; its docstring and comments not counted)."""
    return sum(1 for number, _ in numbered_code_lines(source) if first_line(node) <= number <= node.end_lineno)


def main_lines(source: str):
    """The lines of code of the source's top-level `main`, or None when it defines none."""
    main = next((node for node in ast.parse(source).body
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "main"), None)
    return None if main is None else count_in(source, main)


def changed_lines(a: str, b: str) -> int:
    """`diff a b | grep -c '^[<>]'`: the lines that the second file removed from the first or added to it."""
    if not shutil.which("diff"):
        raise RuntimeError("measuring a diff needs the diff command (diffutils)")
    out = subprocess.run(["diff", a, b], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line[:1] in "<>")


def code_diff(a: str, b: str) -> int:
    """changed_lines of the two files reduced to their lines of code."""
    with tempfile.TemporaryDirectory() as tmp:
        reduced = []
        for i, path in enumerate((a, b)):
            reduced.append(os.path.join(tmp, f"{i}_{os.path.basename(path)}"))
            with open(path) as f, open(reduced[-1], "w") as out:
                out.write("".join(line + "\n" for line in code_lines(f.read())))
        return changed_lines(*reduced)


def pair(text: str) -> tuple:
    a, sep, b = text.partition(":")
    if not sep or not a or not b:
        raise argparse.ArgumentTypeError(f"expected a.py:b.py, got {text!r}")
    return a, b


def report(root: str, pairs: list) -> None:
    scripts = sorted(glob.glob(os.path.join(root, "*.py")))
    width = max([len(os.path.basename(s)) for s in scripts] + [10])
    print(f"{'file':<{width}}  code lines  wc -l")
    for script in scripts:
        with open(script) as f:
            source = f.read()
        print(f"{os.path.basename(script):<{width}}  {len(code_lines(source)):>10}  {len(source.splitlines()):>5}")
    print(f"\n{'main of':<{width}}  code lines")
    for script in scripts:
        with open(script) as f:
            lines = main_lines(f.read())
        if lines is not None:
            print(f"{os.path.basename(script):<{width}}  {lines:>10}")
    print(f"\n{'fork':<{2 * width + 4}}  code diff  raw diff")
    for a, b in pairs:
        name = f"{a} -> {b}"
        pa, pb = os.path.join(root, a), os.path.join(root, b)
        missing = [p for p in (pa, pb) if not os.path.exists(p)]
        if missing:
            print(f"{name:<{2 * width + 4}}  (missing {', '.join(os.path.basename(p) for p in missing)})")
            continue
        print(f"{name:<{2 * width + 4}}  {code_diff(pa, pb):>9}  {changed_lines(pa, pb):>8}")


def cli(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", type=pair, default=FORKS, metavar="A.py:B.py",
                        help="the pairs whose diffs to measure (default: the forks " +
                             ", ".join(f"{a}:{b}" for a, b in FORKS) + ")")
    parser.add_argument("--root", default=REPO_ROOT, help="the folder whose top-level *.py files to measure")
    args = parser.parse_args(argv)
    report(args.root, args.pairs)


if __name__ == "__main__":
    sys.exit(cli())
