"""One layout in every training script, the package of what decides no number, and the size targets of issues 39,
49 and 62, committed so that they keep holding.

Layout: module docstring (the numbered steps) -> Args -> the algorithm's pieces ->
`main` -> its optional features and the number-deciding setup -> the helpers copied from other scripts. No banner;
every script imports the run module (rlhf_utils/run.py), and whatever decides no number lives once in the package
rlhf_utils/ (INFRASTRUCTURE: no training script nor judge.py defines one of its names), each of whose modules opens
with a docstring that says what it holds and what it never does. The top level holds the scripts, data/, tests/,
tools/, docs/, the pipeline's entry points and rlhf_utils/, and nothing else in Python.

Targets, in lines of code (issue 49: count code, not comments; tools/code_lines.py says what a line of code is:
comments, docstrings and blank lines do not count, and this file measures with it): each training script, each
`main` (its docstring not counted) and each fork's code diff (`diff` of the two files reduced to their lines of code,
the lines starting with < or >) within its cap below, set at least 15% above its size when issue 62 ended; no
top-level definition that its script never uses. Only the scripts have a size cap: no module outside them has one
(issue 62).

The command lines: every script's --help flags are the committed list tests/help_flags.json (tools/help_flags.py
writes it), and --help shows the run's flags as their own group with flat names, spelled with underscores.

The training scripts are found (conftest.training_scripts), not listed: a fork meets every rule here by existing."""

import ast
import contextlib
import dataclasses
import functools
import glob
import io
import json
import os
import re
import runpy
import sys
from collections import defaultdict

import pytest

from conftest import REPO_ROOT, RUN_MODULE, training_scripts
from test_shared_helpers import (
    JUDGE_CLIENT,
    OLD_MODULES,
    PACKAGE,
    module_path,
    package_modules,
    read_sources,
    repository_imports,
    shared_copies,
    sharing_scripts,
    top_level_nodes,
)

sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
# one counter serves the tool and the targets: tools/code_lines.py
from code_lines import FORKS, code_diff, code_lines, count, count_in, first_line  # noqa: E402

# the committed list of every script's --help flags and the one reader of them: tools/help_flags.py
from help_flags import HELP_FLAGS_FILE, script_flags  # noqa: E402

SCRIPTS = training_scripts()
BANNER = "TRY NOT TO MODIFY"
# the targets, in lines of code (tools/code_lines.py); only the scripts have one
# issue 62: each cap at least 15% above the size the issue ended at (rounded up to ten); a fork the list does not
# name has MAX_CODE_LINES. A feature that needs more raises its cap in its own commit, with the size and why.
MAX_CODE_LINES = 910  # ppo.py's cap
MAX_CODE_LINES_OF = {
    "sft.py": 480,  # 411
    "reward.py": 630,  # 542
    "ppo.py": 910,  # 804 (786 at issue 62's end; issue 63: TRL's reward-function contract)
    "rloo.py": 820,  # 721
    "grpo.py": 980,  # 852 (issue 63: CISPO, SAPO, KL placement and estimators, truncation mask, entropy)
    "reinforce_pp.py": 850,  # 763
    "dpo.py": 710,  # 605
    "kto.py": 730,  # 609
    "online_dpo.py": 1020,  # 884
    "ilql.py": 720,  # 611
    "offline_rl.py": 860,  # 734
}
MAX_MAIN_CODE_LINES = 120  # the longest main: 107 (ppo.py; 103 at issue 62's end)
MAX_CODE_DIFF = {
    # 250 (issue 65: rloo.py's query-once path, six helpers that ppo.py, one response per query, has no use for)
    ("ppo.py", "rloo.py"): 290,
    ("rloo.py", "grpo.py"): 250,  # 215 (issue 63: grpo.py's loss options, above)
    ("rloo.py", "reinforce_pp.py"): 110,  # 94 (issue 63: REINFORCE++'s KL in the loss, its clamp, the clip order)
    ("dpo.py", "kto.py"): 320,  # 266
    ("dpo.py", "online_dpo.py"): 520,  # 456
}
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def package_names() -> dict:
    """name -> the rlhf_utils modules that define it at top level (a function, class or assigned name; dunders such
    as __all__ left out)."""
    out = defaultdict(list)
    for module in package_modules():
        for name in top_level_nodes(open(module_path(module)).read()):
            if not (name.startswith("__") and name.endswith("__")):
                out[name].append(module)
    return dict(out)


# What decides no number and lives once in rlhf_utils (issue 62): the definitions that were copied into the scripts
# (writing a trained policy, reading a split, placement, refusals, records, logs), named here so that one that leaves
# the package is still refused in a script, and every other top-level name a module of the package defines. No
# training script nor judge.py defines one of them: a script imports it.
NAMED_INFRASTRUCTURE = ["merged_policy", "save_policy", "load_split", "prepare_frozen_model", "placed_on",
                        "place_frozen_models", "zero3_offloaded_init", "whole_parameters", "check_flags", "run_summary",
                        "log_evaluation", "fresh_trainer_state", "next_state", "write_evaluation", "sample_table",
                        "breakdown_markdown"]
INFRASTRUCTURE = sorted(set(NAMED_INFRASTRUCTURE) | set(package_names()))
# The top level beside the scripts (the training scripts, found, and judge.py): the pipeline's entry points
# (pipeline.py, ablate.py, report.py, frontier.py; quickstart.sh and setup.sh run them), and the folders.
ENTRY_POINTS = {"pipeline.py", "ablate.py", "report.py", "frontier.py"}
TOP_LEVEL_FOLDERS = {"data", "tests", "tools", "docs", PACKAGE}


def parsed(script: str) -> tuple:
    source = open(os.path.join(REPO_ROOT, script)).read()
    return source, ast.parse(source)


def top_level(tree: ast.Module, name: str, kind=DEFINITIONS):
    return next((node for node in tree.body if isinstance(node, kind) and node.name == name), None)


def imports_run_module(tree: ast.Module) -> bool:
    """Whether a module imports rlhf_utils/run.py: `from rlhf_utils.run import ...`, `from rlhf_utils import run`
    or `import rlhf_utils.run`."""
    return RUN_MODULE in repository_imports(tree)


def defined_names(source: str) -> set:
    """The names a module defines: every top-level function, class and assigned name, and every function or class
    defined anywhere inside it (a helper nested in main is defined too)."""
    nested = {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, DEFINITIONS)}
    return set(top_level_nodes(source)) | nested


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
    """docstring -> Args -> ... -> main; no banner; the run infrastructure imported from rlhf_utils/run.py (that no
    script redefines what the package defines: the next test; the copied helpers' place: the ones after it)."""
    source, tree = parsed(script)
    assert (ast.get_docstring(tree) or "").strip(), f"{script}: the module docstring states the algorithm's steps"
    args, main = top_level(tree, "Args", ast.ClassDef), top_level(tree, "main", ast.FunctionDef)
    assert args is not None and main is not None, f"{script}: expected a top-level Args and main"
    assert first_line(args) < first_line(main), f"{script}: Args comes before main"
    assert BANNER.lower() not in source.lower(), \
        f"{script}: no '{BANNER}' banner (the run infrastructure is {PACKAGE}/)"
    assert imports_run_module(tree), f"{script} does not import {RUN_MODULE}"


def test_what_decides_no_number_lives_once_in_the_package():
    """No training script nor judge.py defines a name of INFRASTRUCTURE (the named definitions that were copied into
    the scripts, and every top-level name of an rlhf_utils module): it imports it. Each lives once: the named ones in
    one module of the package, and no name in two of its modules."""
    where = package_names()
    twice = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert not twice, f"names defined in more than one module of {PACKAGE}: {twice}"
    missing = sorted(name for name in NAMED_INFRASTRUCTURE if name not in where)
    assert not missing, f"{missing} should live in {PACKAGE}/ (no module of it defines them)"
    defined = {script: sorted(defined_names(source) & set(INFRASTRUCTURE))
               for script, source in read_sources(sharing_scripts()).items()}
    defined = {script: names for script, names in defined.items() if names}
    assert not defined, "scripts define what lives once in rlhf_utils (import it instead):\n" + "\n".join(
        f"{script}: " + ", ".join(f"{name} ({', '.join(where.get(name, ['named']))})" for name in names)
        for script, names in sorted(defined.items()))


def test_every_module_of_the_package_says_what_it_holds_and_never_does():
    """Each module of rlhf_utils (its __init__.py too) opens with a docstring that says what it holds and what it
    never does (the word "never")."""
    problems = []
    for module in package_modules():
        docstring = ast.get_docstring(ast.parse(open(module_path(module)).read())) or ""
        if not docstring.strip():
            problems.append(f"{module}: no module docstring")
        elif "never" not in docstring:
            problems.append(f"{module}: its docstring does not say what it never does (no 'never')")
    assert not problems, "; ".join(problems)


def test_the_top_level_holds_the_scripts_the_entry_points_and_the_folders():
    """The top level shows the design card: the training scripts, judge.py, the pipeline's entry points (pipeline.py,
    ablate.py, report.py, frontier.py) as its only Python files, beside data/, tests/, tools/, docs/ and rlhf_utils/
    (a package: its __init__.py). The modules the package replaced (run_infra.py, user_reward.py, judge_client.py) are
    gone."""
    old = sorted(f"{name}.py" for name in OLD_MODULES if os.path.exists(os.path.join(REPO_ROOT, f"{name}.py")))
    assert not old, f"{old} at the top level: they live in {PACKAGE}/ now"
    python = {name for name in os.listdir(REPO_ROOT) if name.endswith(".py")}
    expected = set(SCRIPTS) | {"judge.py"} | ENTRY_POINTS
    assert python == expected, f"top-level Python files beside the scripts and entry points: " \
        f"{sorted(python - expected)} (what decides no number goes in {PACKAGE}/); missing: {sorted(expected - python)}"
    folders = sorted(name for name in TOP_LEVEL_FOLDERS if not os.path.isdir(os.path.join(REPO_ROOT, name)))
    assert not folders, f"missing top-level folders {folders}"
    assert os.path.exists(os.path.join(REPO_ROOT, PACKAGE, "__init__.py")), f"{PACKAGE}/ is no package"


# a helper copied into this many training scripts or more, not all of one family of forks, is a general helper, not
# one algorithm family's piece
WIDELY_COPIED = 4


def family_of(script: str) -> set:
    """The family of forks a script belongs to: itself and every script that tools/code_lines.py's FORKS links to it,
    directly or through other forks (ppo.py, rloo.py, grpo.py, reinforce_pp.py; dpo.py, kto.py, online_dpo.py)."""
    family, grown = {script}, True
    while grown:
        linked = family | {name for pair in FORKS if family & set(pair) for name in pair}
        family, grown = linked, linked != family
    return family


@functools.lru_cache(maxsize=None)
def training_copies() -> dict:
    """shared_copies of the training scripts, computed once for the tests that read them (none changes it)."""
    return shared_copies(read_sources(SCRIPTS))


def sides_of_main(script: str, names) -> dict:
    """name -> "before" or "after" main, for the given top-level definitions of a training script."""
    _, tree = parsed(script)
    main = first_line(top_level(tree, "main", ast.FunctionDef))
    return {node.name: "before" if first_line(node) < main else "after" for node in tree.body
            if isinstance(node, DEFINITIONS) and node.name in names}


@pytest.mark.parametrize("script", SCRIPTS)
def test_copied_helpers_come_after_main(script):
    """A helper copied into WIDELY_COPIED training scripts or more (exact_div, forward, get_reward, ...) is not the
    algorithm: it comes after main, with the other copies. A piece shared only within a family of forks (family_of:
    ppo, rloo, grpo, reinforce_pp; dpo, kto, online_dpo) is the algorithm of each of them and may come before main,
    however many of the family hold it."""
    shared = training_copies()
    wide = {name for name, by_script in shared.items() if len(by_script) >= WIDELY_COPIED and script in by_script
            and not set(by_script) <= family_of(script)}
    early = sorted(name for name, side in sides_of_main(script, wide).items() if side == "before")
    assert not early, f"{script}: the copied helpers {early} come before main; they go after it, last in the file"


def test_every_copy_sits_on_the_same_side_of_main():
    """A fork keeps its parent's reading order: each shared definition is before main in every training script that
    holds it, or after main in every one."""
    shared = training_copies()
    sides = defaultdict(dict)
    for script in training_scripts():
        for name, side in sides_of_main(script, set(shared)).items():
            sides[name][script] = side
    split = {name: by_script for name, by_script in sides.items() if len(set(by_script.values())) > 1}
    assert not split, f"copies on different sides of main: {split}"


def test_judge_keeps_its_place():
    """judge.py imports the input checks (rlhf_utils/checks.py: RunError, load_split, the tokenizer check) and its
    HTTP client's module (rlhf_utils/judge_client.py); it trains nothing, so it needs no run folder of the run
    module's. That it redefines nothing of either: test_what_decides_no_number_lives_once_in_the_package; that the
    run module imports nothing of the judge's client: tests/test_shared_helpers.py."""
    assert os.path.exists(module_path(JUDGE_CLIENT)), \
        f"the judge's HTTP client lives in {JUDGE_CLIENT}, which is missing"
    missing = sorted({"rlhf_utils.checks", JUDGE_CLIENT} - repository_imports(parsed("judge.py")[1]))
    assert not missing, f"judge.py does not import {missing}"


# ---------------------------------------------------------------------------------------------------------------
# The targets, in lines of code (tools/code_lines.py)
# ---------------------------------------------------------------------------------------------------------------
def test_every_training_script_and_its_main_stay_within_their_size():
    too_long, long_mains = [], []
    for script in SCRIPTS:
        source, tree = parsed(script)
        limit, lines = MAX_CODE_LINES_OF.get(script, MAX_CODE_LINES), len(code_lines(source))
        if lines > limit:
            too_long.append(f"{script}: {lines} (at most {limit})")
        main_lines = count_in(source, top_level(tree, "main", ast.FunctionDef))
        if main_lines > MAX_MAIN_CODE_LINES:
            long_mains.append(f"{script}: {main_lines} (at most {MAX_MAIN_CODE_LINES})")
    assert not too_long, "training scripts over their size in lines of code: " + "; ".join(too_long)
    assert not long_mains, "main's lines of code (its docstring, comments and blank lines not counted): " \
        + "; ".join(long_mains)


def test_every_script_imports_the_run_module():
    missing = [s for s in SCRIPTS if not imports_run_module(parsed(s)[1])]
    assert not missing, f"{missing} do not import {RUN_MODULE}"


def test_only_the_scripts_have_a_size_cap():
    """No module outside the scripts has a size cap (issue 62 lifted the run module's): every cap here names training
    scripts, and this module holds no cap but the scripts' (MAX_CODE_LINES, MAX_CODE_LINES_OF, MAX_MAIN_CODE_LINES,
    MAX_CODE_DIFF)."""
    capped = set(MAX_CODE_LINES_OF) | {script for pair in MAX_CODE_DIFF for script in pair}
    assert capped <= set(SCRIPTS), f"caps on what is no training script: {sorted(capped - set(SCRIPTS))}"
    caps = {name for name in globals() if name.startswith("MAX_")}
    assert caps == {"MAX_CODE_LINES", "MAX_CODE_LINES_OF", "MAX_MAIN_CODE_LINES", "MAX_CODE_DIFF"}, \
        f"size caps here: {sorted(caps)}; only the scripts have one"


@pytest.mark.parametrize("pair", sorted(MAX_CODE_DIFF), ids=lambda pair: f"{pair[0]}-{pair[1]}")
def test_forks_stay_forks(pair):
    """A fork differs from the script it forked from by its idea, not by renames and rewrites: the code diff (`diff`
    of the two files reduced to their lines of code, the lines starting with < or >) stays within its target."""
    a, b = pair
    if b == "grpo.py" and not os.path.exists(os.path.join(REPO_ROOT, b)):
        pytest.skip("no grpo.py yet")
    changed = code_diff(os.path.join(REPO_ROOT, a), os.path.join(REPO_ROOT, b))
    assert changed <= MAX_CODE_DIFF[pair], \
        f"code diff {a} -> {b}: {changed} changed lines of code (at most {MAX_CODE_DIFF[pair]})"


def test_no_training_script_keeps_a_definition_it_never_uses():
    unused = {script: unused_definitions(parsed(script)[0]) for script in SCRIPTS}
    unused = {script: names for script, names in unused.items() if names}
    assert not unused, f"top-level definitions their script never uses (dead code): {unused}"


MEASURED = '''"""Module docstring.

Its second paragraph."""
from dataclasses import dataclass

LIMIT = 3  # a trailing comment: the code before it counts
UNUSED = 4
# a string that is no docstring: every line of it is code, the blank one and the one that looks like a comment too
TEMPLATE = """A prompt:

# this line is the string's own
{post}"""


def helper(n):
    return helper(n - 1) if n else LIMIT


@dataclass
class Record:
    """Class docstring."""

    x: int = 1
    """The docstring of the field x."""


@decorate
def main():
    """Function docstring,
    on two lines."""

    # a comment-only line
    total = (LIMIT +  # a trailing comment inside brackets
             1)
    return TEMPLATE.format(post=total)  # code
'''


def test_the_measures_see_what_they_measure(tmp_path):
    """The helpers of the targets on a tiny source: a function only its own body calls is dead, one called elsewhere
    is not; a line of code is what is left without comments (trailing ones too), docstrings (module, class, function
    and dataclass field) and blank lines, and a multi-line string that is no docstring is code, every line of it;
    main's lines of code count its decorator, not its docstring; a code diff sees code, not comments."""
    assert unused_definitions(MEASURED) == ["Record", "UNUSED", "helper", "main"]
    assert code_lines(MEASURED) == [
        "from dataclasses import dataclass",
        "LIMIT = 3",
        "UNUSED = 4",
        'TEMPLATE = """A prompt:',
        "",
        "# this line is the string's own",
        '{post}"""',
        "def helper(n):",
        "    return helper(n - 1) if n else LIMIT",
        "@dataclass",
        "class Record:",
        "    x: int = 1",
        "@decorate",
        "def main():",
        "    total = (LIMIT +",
        "             1)",
        "    return TEMPLATE.format(post=total)",
    ]
    main = top_level(ast.parse(MEASURED), "main", ast.FunctionDef)
    assert count_in(MEASURED, main) == 5
    (tmp_path / "a.py").write_text(MEASURED)
    assert count(str(tmp_path / "a.py")) == 17
    # a fork that rewrites every comment and docstring and adds blank lines differs by no line of code; one changed
    # statement is one line removed and one added
    reworded = MEASURED.replace("comment", "remark").replace("docstring", "doc").replace("\n\n\n", "\n\n\n\n")
    assert "remark" in reworded and reworded.count("\n") > MEASURED.count("\n")
    (tmp_path / "b.py").write_text(reworded)
    (tmp_path / "c.py").write_text(MEASURED.replace("UNUSED = 4", "UNUSED = 5"))
    assert code_diff(str(tmp_path / "a.py"), str(tmp_path / "b.py")) == 0
    assert code_diff(str(tmp_path / "a.py"), str(tmp_path / "c.py")) == 2


# ---------------------------------------------------------------------------------------------------------------
# The command lines: the committed --help flags, and how --help shows them
# ---------------------------------------------------------------------------------------------------------------
REGENERATE = "python tools/help_flags.py --write"
# flags that --help must show in a given group of a given script (the spelling of the docs: underscores)
EXPECTED_IN_GROUP = {"ppo.py": {"options": ["--gradient_checkpointing"], "ppo options": ["--ppo.kl_coef"]}}
# the line that opens a group of --help: "ppo options" (plain text), "╭─ ppo options ───╮" (boxed)
GROUP_HEADER = re.compile(r"^(?:[\w.]+ )?options$")
OPTION_NAMES = re.compile(r"^--?[A-Za-z][\w.\-]*(?:, --?[A-Za-z][\w.\-]*)*")
FLAG = re.compile(r"--[A-Za-z][\w.\-]*")


@functools.lru_cache(maxsize=None)
def flags_of(script: str) -> tuple:
    """tools/help_flags.py's script_flags, read once per script for the tests here."""
    return tuple(script_flags(script))


def test_every_scripts_help_flags_are_the_committed_ones():
    """Every script's command line accepts the flags tests/help_flags.json lists for it, no more and no fewer (the
    names tyro's parser of its Args accepts, with underscores: tools/help_flags.py). A flag that appears or goes away
    is a change on purpose: its commit regenerates the file, whose diff shows the names."""
    committed = json.load(open(HELP_FLAGS_FILE))
    current = {script: flags_of(script) for script in sharing_scripts()}
    problems = []
    for script in sorted(set(current) | set(committed)):
        if script not in committed:
            problems.append(f"{script}: not in {os.path.relpath(HELP_FLAGS_FILE, REPO_ROOT)}")
        elif script not in current:
            problems.append(f"{script}: listed, but no such script")
        else:
            added, removed = sorted(set(current[script]) - set(committed[script])), \
                sorted(set(committed[script]) - set(current[script]))
            if added or removed:
                problems.append(f"{script}: added {added}, removed {removed}")
    assert not problems, "--help flags differ from the committed list:\n" + "\n".join(problems) + \
        f"\nA change on purpose regenerates the list: {REGENERATE}"


def flag_helps(path: str):
    """(class, field, lines) of every dataclass field's help in a file: the string under the field, as tyro reads it."""
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ClassDef):
            for field, doc in zip(node.body, node.body[1:]):
                if (isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr)
                        and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
                    yield node.name, ast.unparse(field.target), doc.end_lineno - doc.lineno + 1


def test_every_flags_help_takes_at_most_three_lines():
    """A flag's help says what it does and where its default comes from in at most 3 lines; the rest goes to
    docs/usage.md, "Flags in depth" (every Python file of the project: the scripts' Args, rlhf_utils/flags.py's
    groups, pipeline.py, data/prepare.py and the tools)."""
    paths = sorted(path for folder in ("", "data", "rlhf_utils", "tools")
                   for path in glob.glob(os.path.join(REPO_ROOT, folder, "*.py")))
    long = [f"{os.path.relpath(path, REPO_ROOT)} {cls}.{name}: {lines} lines" for path in paths
            for cls, name, lines in flag_helps(path) if lines > 3]
    assert not long, "flag helps over 3 lines (move the rest to docs/usage.md, \"Flags in depth\"):\n" + "\n".join(long)


def help_text(script: str, monkeypatch) -> str:
    """What `python <script> --help` prints, run in this process by the script's own `tyro.cli` call (runpy, as
    __main__), 120 columns wide (one column of groups)."""
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit:
        runpy.run_path(os.path.join(REPO_ROOT, script), run_name="__main__")
    assert exit.value.code in (0, None), f"{script} --help exited with {exit.value.code}"
    return out.getvalue()


def help_groups(text: str) -> dict:
    """A --help text's groups: title ("options", "ppo options", "run options") -> the flags its option lines list, in
    order (each line's names: "--resume, --no_resume"). An option line starts a group's entry at its left edge; its
    description, indented further, is not read."""
    groups, title = {}, None
    for line in text.splitlines():
        header = line.strip().strip("╭╮─ ")
        if GROUP_HEADER.match(header):
            title = header
            groups[title] = []
            continue
        body = line.rstrip().rstrip("│")  # a boxed line's text: inside its │ ... │
        if body.lstrip().startswith("│"):
            body = body.lstrip()[1:]
        indent = len(body) - len(body.lstrip())
        names = OPTION_NAMES.match(body.strip())
        if title is not None and names and indent <= 2:
            groups[title] += names.group(0).split(", ")
    return groups


def test_help_groups_reads_both_styles():
    plain = (" options\n ---\n  -h, --help\n        show this help\n  --seed INT\n        --not_an_option here\n"
             " run options\n ---\n  the run's name\n  ---\n  --resume, --no_resume\n        continue\n")
    boxed = ("╭─ options ───╮\n│ -h, --help  │\n│       show  │\n│ --seed INT  │\n╰─────────────╯\n"
             "╭─ run options ───╮\n│ --resume, --no_resume │\n│       --x continue │\n╰────╯\n")
    expected = {"options": ["-h", "--help", "--seed"], "run options": ["--resume", "--no_resume"]}
    assert help_groups(plain) == expected
    assert help_groups(boxed) == expected


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_the_run_flags_as_their_own_group_with_flat_underscored_names(script, monkeypatch):
    """--help shows the run's flags (rlhf_utils/flags.py: RunFlags) as their own group, "run options", under their
    flat names (--resume, --run_name: tyro.conf.OmitArgPrefixes), and spells every flag as the docs and the error
    messages do, with underscores (--gradient_checkpointing, --ppo.kl_coef: the script's
    `tyro.cli(Args, use_underscores=True)`): it lists every flag its parser names with underscores, and no other."""
    from rlhf_utils.flags import RunFlags

    text = help_text(script, monkeypatch)
    groups = help_groups(text)
    run_flags = {f"--{field.name}" for field in dataclasses.fields(RunFlags)}
    assert "run options" in groups, f"{script} --help shows no 'run options' group (groups: {sorted(groups)})"
    shown = {flag for flag in groups["run options"] if not flag.startswith("--no_")}
    assert shown == run_flags, f"{script}'s run options: missing {sorted(run_flags - shown)}, " \
        f"others {sorted(shown - run_flags)}"
    elsewhere = {title: sorted(run_flags & set(flags)) for title, flags in groups.items()
                 if title != "run options" and run_flags & set(flags)}
    assert not elsewhere, f"{script}: run flags outside 'run options': {elsewhere}"
    assert "--run." not in text, f"{script} --help shows a run flag under its group's prefix (--run.)"
    accepted = set(flags_of(script))
    listed = {flag for flags in groups.values() for flag in flags}
    assert listed <= accepted, f"{script} --help lists flags its parser with underscores does not name: " \
        f"{sorted(listed - accepted)} (tyro.cli(Args, use_underscores=True)?)"
    assert accepted <= listed, f"{script} --help does not list {sorted(accepted - listed)}"
    hyphenated = sorted(flag for flag in accepted if "_" in flag and flag.replace("_", "-") in set(FLAG.findall(text)))
    assert not hyphenated, f"{script} --help spells {hyphenated} with hyphens"
    for title, flags in EXPECTED_IN_GROUP.get(script, {}).items():
        missing = sorted(set(flags) - set(groups.get(title, [])))
        assert not missing, f"{script} --help does not show {missing} in '{title}'"
