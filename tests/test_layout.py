"""One layout in every training script, and the size targets of issue 39, committed so that they keep holding.

Layout: module docstring (the numbered steps) -> Args -> the algorithm's pieces ->
`main` -> its optional features and the number-deciding setup -> the helpers copied from other scripts. No banner;
every script imports the run module (run_infra.py), whatever decides no number lives there once, and no script
defines a name of its own that the run module defines.

Targets: every training script <= 1,400 lines (online_dpo.py <= 1,600); every `main` <= 100 lines of code (blank and
comment-only lines not counted, its docstring counted); run_infra.py <= 750 lines; the forks' diffs (`diff a b`, the
lines starting with < or >): ppo.py/rloo.py <= 265, dpo.py/kto.py <= 480, dpo.py/online_dpo.py <= 750, and
rloo.py/grpo.py <= 200 once grpo.py exists; no top-level definition that its script never uses.

The training scripts are found (conftest.training_scripts), not listed: a fork meets every rule here by existing."""

import ast
import os
import shutil
import subprocess
from collections import defaultdict

import pytest
from conftest import REPO_ROOT, RUN_MODULE, training_scripts
from test_shared_helpers import PER_SCRIPT, read_sources, shared_copies, sharing_scripts, top_level_sources

SCRIPTS = training_scripts()
BANNER = "TRY NOT TO MODIFY"
MAX_LINES, MAX_LINES_OF = 1400, {"online_dpo.py": 1600}
MAX_MAIN_LINES_OF_CODE = 100
MAX_RUN_MODULE_LINES = 750
MAX_DIFF = {("ppo.py", "rloo.py"): 265, ("dpo.py", "kto.py"): 480, ("dpo.py", "online_dpo.py"): 750,
            ("rloo.py", "grpo.py"): 200}
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def parsed(script: str) -> tuple:
    source = open(os.path.join(REPO_ROOT, script)).read()
    return source, ast.parse(source)


def top_level(tree: ast.Module, name: str, kind=DEFINITIONS):
    return next((node for node in tree.body if isinstance(node, kind) and node.name == name), None)


def first_line(node: ast.AST) -> int:
    """A definition's first line, its decorators included."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def lines_of_code(source: str, node: ast.AST) -> int:
    """The lines of a definition that hold code: blank lines and comment-only lines are not counted; docstring lines
    are (a long docstring in main counts against its target)."""
    lines = source.splitlines()[first_line(node) - 1 : node.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def imports_run_module(tree: ast.Module) -> bool:
    return any((isinstance(node, ast.ImportFrom) and node.module == RUN_MODULE)
               or (isinstance(node, ast.Import) and any(a.name == RUN_MODULE for a in node.names))
               for node in ast.walk(tree))


def changed_lines(a: str, b: str) -> int:
    """`diff a b | grep -c '^[<>]'`: the lines that a fork removed or added."""
    assert shutil.which("diff"), "the fork-size targets need the diff command (diffutils)"
    out = subprocess.run(["diff", a, b], cwd=REPO_ROOT, capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line[:1] in "<>")


def unused_definitions(source: str) -> list:
    """The top-level functions, classes and assigned names a module never uses: no name reads it outside its own
    definition (a function that only calls itself is unused; dunders such as __all__ are left out)."""
    tree = ast.parse(source)
    spans = {}  # name -> the line spans of its own definitions
    for node in tree.body:
        if isinstance(node, DEFINITIONS):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        else:
            continue
        for name in names:
            spans.setdefault(name, []).append((first_line(node), node.end_lineno))
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in spans:
            if not any(start <= node.lineno <= end for start, end in spans[node.id]):
                used.add(node.id)
    return sorted(name for name in spans if name not in used and not (name.startswith("__") and name.endswith("__")))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_training_script_reads_as_the_algorithm_first(script):
    """docstring -> Args -> ... -> main; no banner; the run infrastructure imported from the run module, never
    redefined (the copied helpers' place: the next test)."""
    source, tree = parsed(script)
    assert (ast.get_docstring(tree) or "").strip(), f"{script}: the module docstring states the algorithm's steps"
    args, main = top_level(tree, "Args", ast.ClassDef), top_level(tree, "main", ast.FunctionDef)
    assert args is not None and main is not None, f"{script}: expected a top-level Args and main"
    assert first_line(args) < first_line(main), f"{script}: Args comes before main"
    assert BANNER.lower() not in source.lower(), f"{script}: no '{BANNER}' banner (the run infrastructure is run_infra.py)"
    assert imports_run_module(tree), f"{script} does not import {RUN_MODULE}"
    # what the run module defines lives there once
    infra = set(top_level_sources(open(os.path.join(REPO_ROOT, f"{RUN_MODULE}.py")).read()))
    redefined = sorted(infra & set(top_level_sources(source)))
    assert not redefined, f"{script} redefines {redefined}, which {RUN_MODULE}.py defines: import them instead"


# a helper copied into this many training scripts or more is a general helper, not one algorithm family's piece
WIDELY_COPIED = 4


def sides_of_main(script: str, names) -> dict:
    """name -> "before" or "after" main, for the given top-level definitions of a training script."""
    _, tree = parsed(script)
    main = first_line(top_level(tree, "main", ast.FunctionDef))
    return {node.name: "before" if first_line(node) < main else "after" for node in tree.body
            if isinstance(node, DEFINITIONS) and node.name in names}


@pytest.mark.parametrize("script", SCRIPTS)
def test_copied_helpers_come_after_main(script):
    """A helper copied into WIDELY_COPIED training scripts or more (exact_div, forward, get_reward, ...) is not the
    algorithm: it comes after main, with the other copies. A piece shared only within a family of forks (ppo, rloo,
    grpo; dpo, kto, online_dpo) is the algorithm of each of them and may come before main."""
    shared = shared_copies(read_sources(training_scripts()))
    wide = {name for name, by_script in shared.items() if len(by_script) >= WIDELY_COPIED and script in by_script}
    early = sorted(name for name, side in sides_of_main(script, wide).items() if side == "before")
    assert not early, f"{script}: the copied helpers {early} come before main; they go after it, last in the file"


def test_every_copy_sits_on_the_same_side_of_main():
    """A fork keeps its parent's reading order: each shared definition is before main in every training script that
    holds it, or after main in every one."""
    shared = shared_copies(read_sources(training_scripts()))
    sides = defaultdict(dict)
    for script in training_scripts():
        for name, side in sides_of_main(script, set(shared)).items():
            sides[name][script] = side
    split = {name: by_script for name, by_script in sides.items() if len(set(by_script.values())) > 1}
    assert not split, f"copies on different sides of main: {split}"


def test_judge_and_the_run_module_keep_their_place():
    """judge.py imports the run module (its HTTP client lives there) and redefines nothing of it."""
    source, tree = parsed("judge.py")
    assert imports_run_module(tree), f"judge.py does not import {RUN_MODULE}"
    infra = set(top_level_sources(open(os.path.join(REPO_ROOT, f"{RUN_MODULE}.py")).read()))
    assert not infra & set(top_level_sources(source)), sorted(infra & set(top_level_sources(source)))


# ---------------------------------------------------------------------------------------------------------------
# The targets
# ---------------------------------------------------------------------------------------------------------------
def test_every_training_script_and_its_main_stay_within_their_size():
    too_long, long_mains = [], []
    for script in SCRIPTS:
        source, tree = parsed(script)
        limit = MAX_LINES_OF.get(script, MAX_LINES)
        if len(source.splitlines()) > limit:
            too_long.append(f"{script}: {len(source.splitlines())} lines (at most {limit})")
        main = top_level(tree, "main", ast.FunctionDef)
        if lines_of_code(source, main) > MAX_MAIN_LINES_OF_CODE:
            long_mains.append(f"{script}: {lines_of_code(source, main)} (at most {MAX_MAIN_LINES_OF_CODE})")
    assert not too_long, "training scripts over their size: " + "; ".join(too_long)
    assert not long_mains, "main's lines of code (blank and comment-only lines not counted): " + "; ".join(long_mains)


def test_the_run_module_is_small_and_imported_by_every_script():
    source, _ = parsed(f"{RUN_MODULE}.py")
    assert len(source.splitlines()) <= MAX_RUN_MODULE_LINES, f"{RUN_MODULE}.py has {len(source.splitlines())} lines"
    missing = [s for s in sharing_scripts() if not imports_run_module(parsed(s)[1])]
    assert not missing, f"{missing} do not import {RUN_MODULE}"


@pytest.mark.parametrize("pair", sorted(MAX_DIFF), ids=lambda pair: f"{pair[0]}-{pair[1]}")
def test_forks_stay_forks(pair):
    """A fork differs from the script it forked from by its idea, not by renames and rewrites."""
    a, b = pair
    if b == "grpo.py" and not os.path.exists(os.path.join(REPO_ROOT, b)):
        pytest.skip("no grpo.py yet")
    assert changed_lines(a, b) <= MAX_DIFF[pair], f"diff {a} {b}: {changed_lines(a, b)} changed lines (at most {MAX_DIFF[pair]})"


def test_no_training_script_keeps_a_definition_it_never_uses():
    unused = {script: unused_definitions(parsed(script)[0]) for script in SCRIPTS}
    unused = {script: names for script, names in unused.items() if names}
    assert not unused, f"top-level definitions their script never uses (dead code): {unused}"


def test_the_measures_see_what_they_measure():
    """The helpers of the targets on tiny sources: a function only its own body calls is dead, one called elsewhere
    is not; lines of code skip blank and comment-only lines and count the docstring and the decorator."""
    source = ('LIMIT = 3\nUNUSED = 4\n\n\ndef helper(n):\n    return helper(n - 1) if n else LIMIT\n\n\n'
              '@decorate\ndef main():\n    """Doc."""\n\n    # a comment\n    return 1  # code\n')
    assert unused_definitions(source) == ["UNUSED", "helper", "main"]
    main = ast.parse(source).body[-1]
    assert lines_of_code(source, main) == 4
