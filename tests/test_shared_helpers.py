"""The copies cannot drift. Every line that decides a number stays in its script, so helpers shared between scripts
are copied on purpose (one file = one algorithm); what decides no number lives once in the package rlhf_utils/.
Copies drift, so every top-level definition (a function or class, its decorators included) and every top-level
assignment (a constant such as a prompt template or a compiled pattern) that more than one script defines must be the
same code in all of them: copies compare as code, by their syntax trees (`ast.dump`) with every docstring dropped, so
a fork may reword a comment or a docstring or reflow a line, but no statement, decorator, default or constant (a
number, a string's every character) can differ. The scripts compared are found, not listed: every training script
(conftest.training_scripts: a top-level script that defines `main` and constructs rlhf_utils.run's `Run`) and
judge.py, whose prompt, parser and model helpers online_dpo.py copies. A fork joins by existing; a renamed script
stays in. Names that legitimately differ are left out: PER_SCRIPT in every script, OWN in the one script that lists
them.

Also here: data/prepare.py's own copy of the tokenizer fingerprint, the imports that keep scripts self-contained
(the repository modules a script may import: rlhf_utils' run, models, records and flags; its rewards for the scripts
that take --reward_fn, its judge_client for the judge's users; never another script nor data/), the imports that keep
rlhf_utils below the scripts, and the order of the input checks in main."""

import ast
import copy
import os
import sys
from collections import defaultdict

from conftest import REPO_ROOT, RUN_MODULE, training_scripts

sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
from code_lines import docstring_nodes  # noqa: E402  (what a docstring is: the one definition, tools/code_lines.py)

# The scripts that must be found (a finder that breaks finds fewer); others join by existing.
KNOWN_TRAINING_SCRIPTS = {"sft.py", "reward.py", "ppo.py", "rloo.py", "dpo.py", "kto.py", "online_dpo.py", "ilql.py",
                          "offline_rl.py"}
# The scripts with an --lr schedule (sft, reward, the preference methods, ilql, offline_rl; ppo, rloo and grpo
# anneal by hand): each keeps a copy of lr_schedule, transformers.get_scheduler's curves written out.
LR_SCHEDULE_SCRIPTS = {"sft.py", "reward.py", "dpo.py", "kto.py", "online_dpo.py", "ilql.py", "offline_rl.py"}
# Not a training script (it trains nothing), but it shares the judge's prompt, parser and model helpers.
OTHER_SHARING_SCRIPTS = ["judge.py"]
# The package of what decides no number (issue 62), beside the scripts as CleanRL keeps cleanrl_utils/.
PACKAGE = "rlhf_utils"
# The package's modules every script may import: the run (RUN_MODULE, rlhf_utils/run.py: run folder, checkpoints,
# resume, logs), checks (CHECKS, rlhf_utils/checks.py: expected errors and input checks), models (placement and
# saving), records (summaries, sample tables, evaluation files) and flags (RunFlags and the refusals of flags).
CHECKS = f"{PACKAGE}.checks"
PROVENANCE = f"{PACKAGE}.provenance"
SCRIPT_MODULES = {RUN_MODULE, CHECKS, f"{PACKAGE}.models", f"{PACKAGE}.records", f"{PACKAGE}.flags"}
# The judge's HTTP client (rlhf_utils/judge_client.py): a module of its own, imported by the scripts that call a judge.
JUDGE_CLIENT = f"{PACKAGE}.judge_client"
JUDGE_CLIENT_USERS = {"judge.py", "online_dpo.py"}
# The user's reward function (--reward_fn), loaded and its answers checked (rlhf_utils/rewards.py): a module of its
# own, imported by the scripts that take --reward_fn (a reward_fn field in their Args: ppo.py, rloo.py, grpo.py,
# reinforce_pp.py, online_dpo.py and their forks).
USER_REWARD = f"{PACKAGE}.rewards"
# The top-level modules the package replaced (run_infra.py, user_reward.py, judge_client.py): an import of one of
# them is an import of a repository module that no longer exists (tests/test_layout.py: they are gone).
OLD_MODULES = {"run_infra", "user_reward", "judge_client"}
# Names that legitimately differ per script, kept minimal:
# - Args and main: each script's own flags and its own algorithm's loop;
# - the step a fork replaces, under the name of the step in the script it forked from, so that the two read alike:
#   rloo.py's steps from scores to advantages (the leave-one-out baseline, no critic, no GAE) under ppo.py's
#   `rewards_and_advantages`, returning its own `RewardsAndAdvantages` (grpo.py's group-relative advantages and
#   reinforce_pp.py's whitened returns likewise); and each preference method's logged training
#   statistics (`TRAIN_STATS`: DPO's rewards and margins, KTO's KL estimate, z0 and desirable/undesirable sums, online
#   DPO's pair counts).
PER_SCRIPT = {"Args", "main", "rewards_and_advantages", "RewardsAndAdvantages", "TRAIN_STATS"}
# Names that one script defines as its own version of a shared piece: left out for that script only, still compared
# among every other script that defines them. script -> names. ppo.py's rollout (and its Rollout) also reads the
# critic's values; rloo.py, grpo.py and reinforce_pp.py share one critic-free copy of it, compared among the three.
OWN = {"ppo.py": {"Rollout", "rollout"}}
# The copies a fork of rloo.py takes from elsewhere, compared like every copy: reinforce_pp.py (REINFORCE++) keeps
# rloo.py's pieces (the critic-free rollout among them), has its own update (`reinforce_pp_update`, the shared
# clipped_policy_loss on each token) and returns (`discounted_returns`; its group check is rlhf_utils/flags.py's
# `check_groups`, with rloo.py's and grpo.py's), and copies ppo.py's per-token rewards and whitening: each copy must be
# found where it is expected, or a rename would leave it uncompared.
FORK_COPIES = {"per_token_rewards": {"ppo.py", "reinforce_pp.py"}, "masked_whiten": {"ppo.py", "reinforce_pp.py"},
               "rollout": {"rloo.py", "grpo.py", "reinforce_pp.py"}}


def sharing_scripts() -> list:
    return training_scripts() + OTHER_SHARING_SCRIPTS


def top_level_nodes(source: str) -> dict:
    """name -> every top-level node that defines it, in order: a function or class (its decorators are part of the
    node), an assignment (`X = ...`, `X: T = ...`, `A, B = ...`, `X += ...`) whole."""
    out = defaultdict(list)
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        else:
            continue
        for name in names:
            out[name].append(node)
    return dict(out)


def top_level_sources(source: str) -> dict:
    """name -> the text of every top-level node that defines it, as whole lines: a function or class from its first
    decorator to its last line, an assignment whole. A name defined twice gets both texts, in order."""
    lines, out = source.splitlines(), {}
    for name, nodes in top_level_nodes(source).items():
        starts = [min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]) for n in nodes]
        out[name] = "\n".join("\n".join(lines[start - 1 : n.end_lineno]) for start, n in zip(starts, nodes))
    return out


def without_docstrings(node: ast.AST) -> ast.AST:
    """A copy of the node with every docstring statement dropped (tools/code_lines.py's docstring_nodes: a module's,
    class's or function's, and any other statement that is a lone string literal)."""
    node = copy.deepcopy(node)
    docstrings = {id(d) for d in docstring_nodes(node)}
    for parent in ast.walk(node):
        for field, value in ast.iter_fields(parent):
            if isinstance(value, list) and any(id(v) in docstrings for v in value):
                setattr(parent, field, [v for v in value if id(v) not in docstrings])
    return node


def top_level_code(source: str) -> dict:
    """name -> the code of every top-level node that defines it: `ast.dump` of the node without its docstrings
    (decorators, defaults, annotations and constants included; comments, docstrings, line numbers and layout not)."""
    return {name: "\n".join(ast.dump(without_docstrings(node)) for node in nodes)
            for name, nodes in top_level_nodes(source).items()}


def shared_copies(sources: dict, per_script: set = PER_SCRIPT, own: dict = OWN) -> dict:
    """{script: source} -> {name: {script: code}} for every name that two or more of the scripts define at top level
    (names in per_script left out everywhere, names in own[script] left out for that script)."""
    copies = defaultdict(dict)
    for script, source in sources.items():
        for name, code in top_level_code(source).items():
            if name not in per_script and name not in own.get(script, ()):
                copies[name][script] = code
    return {name: by_script for name, by_script in copies.items() if len(by_script) > 1}


def drifted(sources: dict, per_script: set = PER_SCRIPT, own: dict = OWN) -> dict:
    """{script: source} -> {name: [scripts holding one code, scripts holding another, ...]} for every shared name
    whose copies are not the same code."""
    out = {}
    for name, by_script in shared_copies(sources, per_script, own).items():
        groups = defaultdict(list)
        for script, code in sorted(by_script.items()):
            groups[code].append(script)
        if len(groups) > 1:
            out[name] = list(groups.values())
    return out


def read_sources(scripts: list) -> dict:
    return {script: open(os.path.join(REPO_ROOT, script)).read() for script in scripts}


def test_the_training_scripts_are_found_not_listed():
    found = set(training_scripts())
    missing = KNOWN_TRAINING_SCRIPTS - found
    assert not missing, f"the finder missed {sorted(missing)} (found {sorted(found)})"
    # none of these constructs rlhf_utils.run's Run (and the package's own modules are no top-level scripts)
    assert not {"judge.py", "ablate.py", "pipeline.py", "report.py"} & found


def test_a_new_fork_is_found_by_existing(tmp_path):
    """A fork is a training script because of what it is: a copy of a training script under any name is found, and
    a script with its own class named Run, or one that constructs no run, is not."""
    from conftest import training_scripts as find

    (tmp_path / "grpo_variant.py").write_text(open(os.path.join(REPO_ROOT, "rloo.py")).read())
    (tmp_path / "aliased.py").write_text(
        "import rlhf_utils.run as infra\n\ndef main(args):\n    run = infra.Run(args, None)\n")
    (tmp_path / "by_module.py").write_text(
        "from rlhf_utils import run as r\n\ndef main(args):\n    return r.Run(args, None)\n")
    (tmp_path / "own_run.py").write_text("class Run:\n    pass\n\ndef main(args):\n    run = Run()\n")
    (tmp_path / "no_main.py").write_text(
        "from rlhf_utils.run import Run\n\ndef start(args):\n    return Run(args, None)\n")
    assert find(str(tmp_path)) == ["aliased.py", "by_module.py", "grpo_variant.py"]


def test_shared_definitions_and_constants_are_identical_across_scripts():
    sources = read_sources(sharing_scripts())
    shared = shared_copies(sources)
    # what the comparison must see, or it compares nothing: a helper every script shares, decorated definitions, and
    # the judge's prompt template that online_dpo.py copies from judge.py (a module-level constant)
    assert "real_columns" in shared and set(shared["real_columns"]) >= KNOWN_TRAINING_SCRIPTS
    # the learning-rate schedule written out in place of transformers.get_scheduler (tests/test_lr_schedule.py)
    assert set(shared.get("lr_schedule", {})) >= LR_SCHEDULE_SCRIPTS, "a script lost its copy of lr_schedule"
    decorated = {name for source in sources.values() for name, nodes in top_level_nodes(source).items()
                 if any(getattr(node, "decorator_list", None) for node in nodes)}
    assert decorated & set(shared), "no shared definition has a decorator: are decorators compared?"
    assert {"judge.py", "online_dpo.py"} <= set(shared.get("PAIRWISE_JUDGE_TEMPLATE", {})), \
        "online_dpo.py should keep the judge's prompt template, a copy of judge.py's"
    for name, holders in FORK_COPIES.items():
        assert holders <= set(shared.get(name, {})), f"{name} should be compared in {sorted(holders)}"
    # a script's own names are names it defines (a stale entry would only hide nothing, but reads as a rule)
    stale = {script: sorted(names - set(top_level_nodes(sources[script]))) for script, names in OWN.items()
             if script in sources and names - set(top_level_nodes(sources[script]))}
    assert not stale, f"OWN lists names their script does not define: {stale}"
    drift = drifted(sources)
    assert not drift, "copies differ in code between scripts (make them the same, or rename the one that is another " \
        "thing):\n" + "\n".join(f"{name}: " + " vs ".join(str(group) for group in groups)
                                for name, groups in sorted(drift.items()))


def test_the_comparison_has_no_blind_spot():
    """The comparison reports a copy that lost its decorator, a changed module-level constant (plain, annotated or
    unpacked), a changed class decorator, a changed statement or default; identical copies, per-script names and a
    reworded comment or docstring (a module's, function's, class's, dataclass field's) are not reported."""
    body = "def evaluate(model, rows):\n    return model(rows)\n"
    decorated = "@torch.no_grad()\n" + body
    assert drifted({"a.py": decorated, "b.py": body}) == {"evaluate": [["a.py"], ["b.py"]]}
    assert drifted({"a.py": "LIMIT = 3\n", "b.py": "LIMIT = 4\n"}) == {"LIMIT": [["a.py"], ["b.py"]]}
    assert drifted({"a.py": "LIMIT: int = 3\n", "b.py": "LIMIT: int = 4\n"}) == {"LIMIT": [["a.py"], ["b.py"]]}
    assert set(drifted({"a.py": "A, B = 1, 2\n", "b.py": "A, B = 1, 3\n"})) == {"A", "B"}
    assert drifted({"a.py": 'TEMPLATE = "Which is better? {a}"\n',
                    "b.py": 'TEMPLATE = "Which is better?  {a}"\n'}) == {"TEMPLATE": [["a.py"], ["b.py"]]}
    cls = "class Record:\n    x: int\n"
    assert drifted({"a.py": "@dataclass\n" + cls, "b.py": "@dataclass(frozen=True)\n" + cls}) == {
        "Record": [["a.py"], ["b.py"]]}
    assert drifted({"a.py": body, "b.py": body.replace("model(rows)", "model(rows[1:])")}) == {
        "evaluate": [["a.py"], ["b.py"]]}
    clip = "def clip(x, limit=0.2):\n    return x\n"
    assert drifted({"a.py": clip, "b.py": clip.replace("0.2", "0.3")}) == {"clip": [["a.py"], ["b.py"]]}
    # a docstring that holds a statement's place is dropped, the statement is still compared
    documented = 'def f():\n    """Doc."""\n    return 1\n'
    assert drifted({"a.py": documented, "b.py": documented.replace("1", "2")}) == {"f": [["a.py"], ["b.py"]]}
    # the same code is no drift, whatever stands between the definitions or around the code: comments, docstrings
    same = decorated + "\n\nLIMIT = 3\n"
    assert drifted({"a.py": same, "b.py": "import torch\n\n\n" + same, "c.py": "X = 1\n"}) == {}
    reworded = ('"""Another module docstring."""\n@torch.no_grad()  # no graph\ndef evaluate(model, rows):\n'
                '    """Score the rows."""\n    # one call\n    return model(rows)  # the scores\n\n\n'
                'LIMIT = 3  # why three\n')
    assert drifted({"a.py": same, "b.py": reworded}) == {}
    field = '@dataclass\nclass Config:\n    """{}"""\n\n    lr: float = {}\n    """{}"""\n'
    assert drifted({"a.py": field.format("The flags.", "1e-5", "The learning rate."),
                    "b.py": field.format("Flags.", "1e-5", "The step size.")}) == {}
    assert drifted({"a.py": field.format("The flags.", "1e-5", "The learning rate."),
                    "b.py": field.format("The flags.", "1e-6", "The learning rate.")}) == {
        "Config": [["a.py"], ["b.py"]]}
    assert drifted({"a.py": 'SIZES = {\n    "small": 1,  # why\n}\n', "b.py": 'SIZES = {"small": 1}\n'}) == {}
    # per-script names may differ
    assert drifted({"a.py": "def main():\n    pass\n", "b.py": "def main():\n    return 1\n"}) == {}


def test_a_scripts_own_names_are_left_out_for_that_script_only():
    """A name in OWN[script] is that script's own version: not compared for it, still compared among the others."""
    sources = {"a.py": "def rollout():\n    return 1\n", "b.py": "def rollout():\n    return 2\n",
               "c.py": "def rollout():\n    return 3\n", "d.py": "def rollout():\n    return 2\n"}
    own = {"a.py": {"rollout"}}
    assert set(shared_copies(sources, own=own)["rollout"]) == {"b.py", "c.py", "d.py"}
    assert drifted(sources, own=own) == {"rollout": [["b.py", "d.py"], ["c.py"]]}
    assert drifted({**sources, "c.py": sources["b.py"]}, own=own) == {}
    assert drifted({**sources, "c.py": sources["b.py"]}) == {"rollout": [["a.py"], ["b.py", "c.py", "d.py"]]}
    # a name only one other script defines is then no copy at all
    assert shared_copies({"a.py": sources["a.py"], "b.py": sources["b.py"]}, own=own) == {}
    assert drifted({"a.py": sources["a.py"], "b.py": sources["b.py"]}, own={"c.py": {"rollout"}}) == {
        "rollout": [["a.py"], ["b.py"]]}


# ---------------------------------------------------------------------------------------------------------------
# data/prepare.py's own copy, and the imports
# ---------------------------------------------------------------------------------------------------------------
def imported_modules(tree: ast.Module) -> set:
    """The top-level package of every module a module imports (anywhere in it, function-level imports included)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def repo_modules() -> set:
    """The repository's own top-level modules (every *.py at its root) and its packages (data, rlhf_utils)."""
    return {name[:-3] for name in os.listdir(REPO_ROOT) if name.endswith(".py")} | {"data", PACKAGE}


def module_path(module: str) -> str:
    """The file of a repository module named with dots: rlhf_utils.run -> rlhf_utils/run.py, a package -> its
    __init__.py."""
    path = os.path.join(REPO_ROOT, *module.split("."))
    return os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"


def package_modules() -> list:
    """The modules of rlhf_utils/ by dotted name (rlhf_utils for its __init__.py), sorted."""
    names = sorted(name[:-3] for name in os.listdir(os.path.join(REPO_ROOT, PACKAGE)) if name.endswith(".py"))
    return [PACKAGE if name == "__init__" else f"{PACKAGE}.{name}" for name in names]


def repository_imports(tree: ast.Module, package: str = "") -> set:
    """The repository's own modules a module imports (anywhere in it, function-level imports included), each by its
    dotted name: `import judge` -> judge, `from rlhf_utils.run import Run` -> rlhf_utils.run, `from rlhf_utils import
    models, records` -> rlhf_utils.models and rlhf_utils.records (a name that is no module of the package: the package
    itself), `from data.synthetic import gold_score` -> data.synthetic. A module that no longer exists (OLD_MODULES)
    counts too. A relative import resolves against `package`, the importing module's package."""
    ours = repo_modules() | OLD_MODULES

    def submodule_or_package(module: str, name: str) -> str:
        path = os.path.join(REPO_ROOT, *module.split("."), name)
        return f"{module}.{name}" if os.path.isdir(path) or os.path.exists(path + ".py") else module

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            found |= {submodule_or_package(module, alias.name) for alias in node.names}
    return {name for name in found if name.split(".")[0] in ours}


def module_imports(module: str) -> set:
    """The repository modules a repository module imports (repository_imports), itself left out."""
    package = module if module_path(module).endswith("__init__.py") else module.rpartition(".")[0]
    return repository_imports(ast.parse(open(module_path(module)).read()), package) - {module}


def script_imports(script: str) -> set:
    """The repository modules a top-level script imports (repository_imports)."""
    return module_imports(script[:-3])


def takes_reward_fn(script: str) -> bool:
    """Whether a script's Args has a --reward_fn flag (a field reward_fn)."""
    tree = ast.parse(open(os.path.join(REPO_ROOT, script)).read())
    args = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args"), None)
    return args is not None and any(isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                                    and node.target.id == "reward_fn" for node in args.body)


def test_data_preparation_has_its_own_copy_of_the_tokenizer_fingerprint():
    """data/prepare.py writes the tokenizer fingerprint that rlhf_utils/checks.py's check_data_tokenizer compares with
    the model's: it keeps its own copy, the same code as the run module's (compared as the other copies are), and
    imports neither rlhf_utils nor any script (data preparation knows no trainer)."""
    prepare = open(os.path.join(REPO_ROOT, "data", "prepare.py")).read()
    ours = top_level_code(prepare).get("tokenizer_fingerprint")
    assert ours is not None, "data/prepare.py should define tokenizer_fingerprint itself"
    theirs = top_level_code(open(module_path(CHECKS)).read()).get("tokenizer_fingerprint")
    assert theirs is not None, f"{CHECKS} should define tokenizer_fingerprint"
    assert ours == theirs, f"data/prepare.py's tokenizer_fingerprint differs in code from {CHECKS}'s"
    imported = sorted(name for name in module_imports("data.prepare") if name.split(".")[0] != "data")
    assert not imported, f"data/prepare.py imports {imported}; data preparation imports no script nor {PACKAGE}"


def test_scripts_import_no_other_script_nor_the_data_package():
    """A script is self-contained: of the repository's own modules it imports rlhf_utils' run, models, records and
    flags (SCRIPT_MODULES), the scripts that call a judge (JUDGE_CLIENT_USERS: judge.py, online_dpo.py)
    rlhf_utils/judge_client.py too, and the scripts that take --reward_fn rlhf_utils/rewards.py; never another
    script, the data package, or a top-level module the package replaced (run_infra, user_reward, judge_client)."""
    imports, problems = {script: script_imports(script) for script in sharing_scripts()}, []
    for script, imported in imports.items():
        allowed = SCRIPT_MODULES | ({JUDGE_CLIENT} if script in JUDGE_CLIENT_USERS else set())
        if takes_reward_fn(script):
            allowed |= {USER_REWARD}
        if imported - allowed:
            problems.append(f"{script} imports {sorted(imported - allowed)} (of the repository's modules it may "
                            f"import {sorted(allowed)})")
    assert not problems, "\n".join(problems)
    users = {script for script, imported in imports.items() if USER_REWARD in imported}
    assert {"ppo.py", "rloo.py", "grpo.py", "reinforce_pp.py", "online_dpo.py"} <= users, \
        f"--reward_fn's scripts: only {sorted(users)} import {USER_REWARD}"
    missing = sorted(script for script in JUDGE_CLIENT_USERS if JUDGE_CLIENT not in imports[script])
    assert not missing, f"{missing} call a judge but do not import {JUDGE_CLIENT}"


def test_the_package_imports_no_script_and_the_run_module_nothing_of_it():
    """rlhf_utils sits below the scripts: its modules import no training script, judge.py, pipeline.py nor any other
    top-level module, and no data/ module. Within it, rlhf_utils/checks.py (the expected errors and input checks)
    and rlhf_utils/provenance.py (what produced a run) import none of the repository's modules; rlhf_utils/run.py, of
    the repository's, those two alone (nothing of the judge's client nor of rewards, and not the package's other
    modules, which import it);
    rlhf_utils/judge_client.py and rlhf_utils/rewards.py the checks alone."""
    modules = package_modules()
    assert {RUN_MODULE, CHECKS, JUDGE_CLIENT, USER_REWARD} <= set(modules), f"{PACKAGE}/ holds only {modules}"
    outside = {module: sorted(name for name in module_imports(module) if name.split(".")[0] != PACKAGE)
               for module in modules}
    outside = {module: names for module, names in outside.items() if names}
    assert not outside, f"{PACKAGE} imports what it never may (a script, data/, a top-level module): {outside}"
    for leaf in (CHECKS, PROVENANCE):
        assert not module_imports(leaf), f"{leaf} imports {sorted(module_imports(leaf))}: it imports none of " \
            "the repository's modules"
    for module, allowed in ((RUN_MODULE, {CHECKS, PROVENANCE}), (JUDGE_CLIENT, {CHECKS}), (USER_REWARD, {CHECKS})):
        extra = module_imports(module) - allowed
        assert not extra, f"{module} imports {sorted(extra)}: of the repository's modules, only {sorted(allowed)}"


def test_the_imports_are_seen_as_they_are_written(tmp_path):
    """repository_imports names each repository module by its dotted name, however the import is written
    (a module of the package, a name from it, a relative import, one inside a function, a module that is gone);
    other packages are not the repository's."""
    source = ("import os\nimport torch.nn\nimport rlhf_utils.run as infra\nfrom rlhf_utils import models, records\n"
              "from rlhf_utils.rewards import check_rewards\nfrom data.synthetic import gold_score\nimport ppo\n"
              "from .flags import RunFlags\n\ndef late():\n    from judge_client import run_jobs\n")
    assert repository_imports(ast.parse(source), package=PACKAGE) == {
        "rlhf_utils.run", "rlhf_utils.models", "rlhf_utils.records", "rlhf_utils.rewards", "data.synthetic", "ppo",
        "rlhf_utils.flags", "judge_client"}
    assert repository_imports(ast.parse("from rlhf_utils import not_a_module\n")) == {PACKAGE}


# ---------------------------------------------------------------------------------------------------------------
# Bad input fails before the output folder is claimed
# ---------------------------------------------------------------------------------------------------------------
def calls_in_order(name: str, functions: dict, seen: frozenset = frozenset()) -> list:
    """The names of the calls a script's function makes, in source order, with each call of another of the script's
    top-level functions followed by that function's own calls (recursively)."""
    out = []
    calls = sorted((n for n in ast.walk(functions[name]) if isinstance(n, ast.Call)),
                   key=lambda n: (n.lineno, n.col_offset))
    for call in calls:
        callee = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
        out.append(callee)
        if isinstance(call.func, ast.Name) and callee in functions and callee not in seen | {name}:
            out += calls_in_order(callee, functions, seen | {name})
    return out


def test_every_training_script_checks_the_tokenizer_of_its_data_before_claiming_its_output():
    """Each script that trains on processed data refuses data of another tokenizer (check_data_tokenizer) before it
    claims --output_dir, so a refused run leaves nothing behind: following main's calls into the script's own
    functions, check_data_tokenizer comes before claim_output_dir."""
    for script in training_scripts():
        tree = ast.parse(open(os.path.join(REPO_ROOT, script)).read())
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        calls = calls_in_order("main", functions)
        assert "claim_output_dir" in calls, f"{script}: main never claims --output_dir"
        before = calls[: calls.index("claim_output_dir")]
        assert "check_data_tokenizer" in before, \
            f"{script} does not check the tokenizer of its data before it claims --output_dir"
