"""Every script's --help flags: the committed list that tests/test_layout.py compares with the scripts (issue 62).

For every training script (tests/conftest.py's training_scripts: found, not listed) and judge.py, the names tyro
accepts on its command line, read from tyro's own parser of the script's Args with underscores (the spelling the
scripts use: `tyro.cli(Args, use_underscores=True)`): every option string, the --no_ form of each boolean and -h,
--help included, sorted.

    script_flags(script)   the flag names of one script, e.g. script_flags("ppo.py") -> ["--accept_changed_flags", ...]
    collect()              {script: its flag names} for every script the list holds

    python tools/help_flags.py           prints the list of the current tree (JSON)
    python tools/help_flags.py --write   writes it to tests/help_flags.json: a change of a flag, on purpose

A flag that appears or goes away is a change of every command line and doc that names it: regenerate the file in the
commit that makes the change, so that its diff shows the names."""

import argparse
import importlib.util
import json
import os
import sys
import warnings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELP_FLAGS_FILE = os.path.join(REPO_ROOT, "tests", "help_flags.json")
# Not a training script, but a command line of the project's with flags of its own.
OTHER_SCRIPTS = ["judge.py"]


def scripts() -> list:
    """The scripts the list holds: every training script (tests/conftest.py: training_scripts) and judge.py."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))
    try:
        from conftest import training_scripts
    finally:
        sys.path.remove(os.path.join(REPO_ROOT, "tests"))
    return training_scripts(REPO_ROOT) + OTHER_SCRIPTS


def option_strings(parser) -> set:
    """Every option string of an argparse parser and of its subparsers."""
    found = set()
    for action in parser._actions:
        found |= set(action.option_strings)
        if isinstance(action.choices, dict):  # subcommands: a parser each
            for subparser in action.choices.values():
                if isinstance(subparser, argparse.ArgumentParser):
                    found |= option_strings(subparser)
    return found


def script_flags(script: str) -> list:
    """The flag names a script's command line accepts, sorted: tyro's parser of its Args, with underscores."""
    import tyro

    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)  # the scripts import rlhf_utils from the repository root
    name = f"help_flags_{script[:-3]}"
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, script))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # tyro reads the fields' docstrings from the module's source
    try:
        spec.loader.exec_module(module)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # get_parser: tyro's own argparse parser
            parser = tyro.extras.get_parser(module.Args, use_underscores=True)
    finally:
        del sys.modules[name]
    return sorted(option_strings(parser))


def collect() -> dict:
    return {script: script_flags(script) for script in scripts()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {os.path.relpath(HELP_FLAGS_FILE, REPO_ROOT)}")
    text = json.dumps(collect(), indent=1, sort_keys=True) + "\n"
    if parser.parse_args().write:
        with open(HELP_FLAGS_FILE, "w") as f:
            f.write(text)
        print(f"wrote {HELP_FLAGS_FILE}")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
