"""Helpers are copied into each top-level script on purpose (one file = one algorithm).
Copies drift, so every function or class defined at top level in more than one script must be
byte-identical in all of them."""

import ast
import os
from collections import defaultdict

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["sft.py", "reward.py", "ppo.py", "dpo.py", "ilql.py", "offline_rl.py", "judge.py", "rloo.py", "kto.py",
           "online_dpo.py"]
# Names that legitimately differ per script: each script has its own arguments and entry point, and a fork keeps the
# name of the algorithm step it replaces (rloo.py's reward shaping is RLOO's, under ppo.py's name).
PER_SCRIPT = {"Args", "main", "shape_rewards", "ShapedRewards"}


def top_level_definitions(path: str) -> dict:
    source = open(path).read()
    tree = ast.parse(source)
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name not in PER_SCRIPT:
            out[node.name] = ast.get_source_segment(source, node)
    return out


def test_shared_helpers_are_identical_across_scripts():
    copies = defaultdict(dict)
    present = [s for s in SCRIPTS if os.path.exists(os.path.join(REPO_ROOT, s))]
    assert len(present) >= 2, "expected at least two top-level scripts"
    for script in present:
        for name, text in top_level_definitions(os.path.join(REPO_ROOT, script)).items():
            copies[name][script] = text
    shared = {name: by_script for name, by_script in copies.items() if len(by_script) > 1}
    assert "first_true_indices" in shared, "the core helpers should be shared by several scripts"
    drifted = [f"{name}: {sorted(by_script)}" for name, by_script in shared.items() if len(set(by_script.values())) > 1]
    assert not drifted, "helper copies differ between scripts (make them identical):\n" + "\n".join(drifted)


TRAINING_SCRIPTS = ["sft.py", "reward.py", "ppo.py", "dpo.py", "ilql.py", "offline_rl.py", "rloo.py", "kto.py",
                    "online_dpo.py"]
BANNER = "# RUN INFRASTRUCTURE: TRY NOT TO MODIFY."
SHARED_BLOCK = "# ---- shared input checks: identical in every training script"
RUN_BLOCK = "# ---- shared run infrastructure: identical in every training script"


def calls_before(function: ast.FunctionDef, stop: str) -> list:
    """Names of the functions (and methods) that `function` calls before its first call named `stop`, in order."""
    names = []
    for node in sorted((n for n in ast.walk(function) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name == stop:
            return names
        names.append(name)
    raise AssertionError(f"{function.name} never calls {stop}")


def test_every_training_script_checks_the_tokenizer_of_its_data_before_claiming_its_output():
    """Each script that trains on processed data refuses data of another tokenizer (check_data_tokenizer) before
    it claims --output_dir, so a refused run leaves nothing behind: main calls check_data_tokenizer, or a function
    of the script that calls it, before it claims the folder."""
    for script in TRAINING_SCRIPTS:
        source = open(os.path.join(REPO_ROOT, script)).read()
        functions = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
        before = calls_before(functions["main"], "claim_output_dir")
        checked = "check_data_tokenizer" in before or any(
            name in functions and "check_data_tokenizer" in {getattr(c.func, "id", None) for c in ast.walk(functions[name])
                                                              if isinstance(c, ast.Call)}
            for name in before
        )
        assert checked, f"{script} does not check the tokenizer of its data before it claims --output_dir"


def test_every_training_script_reads_as_the_algorithm_first():
    """Every training script reads top down: docstring -> Args -> the algorithm -> main -> one banner -> the run
    infrastructure, whose shared part (the Run object and the helpers every script needs) is the same text in every
    training script."""
    blocks = {}
    for script in TRAINING_SCRIPTS:
        source = open(os.path.join(REPO_ROOT, script)).read()
        lines = source.splitlines()
        assert sum(line.startswith(BANNER) for line in lines) == 1, f"{script}: expected the banner exactly once"
        banner = next(i for i, line in enumerate(lines) if line.startswith(BANNER)) + 1
        tree = ast.parse(source)
        main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
        args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
        assert args.lineno < main.lineno < banner, f"{script}: Args, then main, then the banner"
        assert ast.get_docstring(tree), f"{script}: the module docstring states the algorithm"
        below = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.lineno > banner}
        assert {"Run", "NonFiniteError", "check_data_tokenizer", "start_processes"} <= below, script
        assert source.index(BANNER) < source.index(SHARED_BLOCK) < source.index(RUN_BLOCK), script
        start = source.index(SHARED_BLOCK)
        blocks[script] = source[start : source.index('\nif __name__ == "__main__":', start)]
    assert len(set(blocks.values())) == 1, "the shared run infrastructure differs between " + ", ".join(
        f"{a} and {b}" for a, b in zip(TRAINING_SCRIPTS, TRAINING_SCRIPTS[1:]) if blocks[a] != blocks[b])
    # the run block stays small enough to read in one sitting: from its marker to `if __name__ == "__main__":`
    run_block = blocks[TRAINING_SCRIPTS[0]][blocks[TRAINING_SCRIPTS[0]].index(RUN_BLOCK):]
    assert len(run_block.splitlines()) <= 200, f"the shared run block has {len(run_block.splitlines())} lines (at most 200)"


def test_data_preparation_has_its_own_copy_of_the_tokenizer_fingerprint():
    """data/prepare.py writes the tokenizer fingerprint that every script's check_data_tokenizer compares with its
    own: it keeps its own copy (it imports no training script), the same text as the scripts' copy."""
    prepare = os.path.join(REPO_ROOT, "data", "prepare.py")
    ours = top_level_definitions(prepare).get("tokenizer_fingerprint")
    assert ours is not None, "data/prepare.py should define tokenizer_fingerprint itself"
    theirs = {script: top_level_definitions(os.path.join(REPO_ROOT, script)).get("tokenizer_fingerprint")
              for script in TRAINING_SCRIPTS}
    assert all(theirs.values()), f"a training script lacks tokenizer_fingerprint: {sorted(s for s, t in theirs.items() if not t)}"
    differ = sorted(script for script, text in theirs.items() if text != ours)
    assert not differ, f"data/prepare.py's tokenizer_fingerprint differs from the copy in {differ}"
    scripts = {s[:-3] for s in SCRIPTS}
    for node in ast.walk(ast.parse(open(prepare).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
        assert not set(names) & scripts, f"data/prepare.py imports a training script ({names}); data prep knows no trainer"


def test_scripts_do_not_import_each_other():
    modules = {s[:-3] for s in SCRIPTS}
    for script in SCRIPTS:
        path = os.path.join(REPO_ROOT, script)
        if not os.path.exists(path):
            continue
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            assert not (set(names) & (modules - {script[:-3]})), f"{script} imports another top-level script"
            assert "data" not in names, f"{script} imports the project's data package; scripts stay self-contained"
