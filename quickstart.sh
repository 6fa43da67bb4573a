#!/usr/bin/env bash
# Set up the environment (setup.sh: a virtual environment in .venv unless one is active) and run the whole pipeline
# on the built-in task, ending in a results report under artifacts/quickstart/report/. Extra arguments go to
# pipeline.py (e.g. --mode full, --force ppo, --threads 1).
set -euo pipefail
cd "$(dirname "$0")"
source ./setup.sh
python pipeline.py "$@"
