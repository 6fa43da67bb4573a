"""Helpers are copied into each top-level script on purpose (one file = one algorithm).
Copies drift, so every function or class defined at top level in more than one script must be
byte-identical in all of them."""

import ast
import os
from collections import defaultdict

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["sft.py", "reward.py", "ppo.py", "dpo.py", "ilql.py", "offline_rl.py", "judge.py"]
# Names that legitimately differ per script: each script has its own arguments and entry point.
PER_SCRIPT = {"Args", "main"}


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


def test_every_training_script_checks_the_tokenizer_of_its_data_before_claiming_its_output():
    """Each script that trains on processed data refuses data of another tokenizer (check_data_tokenizer) before
    it claims --output_dir, so a refused run leaves nothing behind."""
    for script in ["sft.py", "reward.py", "ppo.py", "dpo.py", "ilql.py", "offline_rl.py"]:
        source = open(os.path.join(REPO_ROOT, script)).read()
        main = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "main")
        text = ast.get_source_segment(source, main)
        assert "check_data_tokenizer(" in text, f"{script} does not check the tokenizer of its data"
        assert text.index("check_data_tokenizer(") < text.index("claim_output_dir("), script


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
