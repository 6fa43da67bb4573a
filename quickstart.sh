#!/usr/bin/env bash
# Set up the environment and run the whole pipeline on the built-in task, ending in a results report
# under artifacts/quickstart/report/. Extra arguments go to pipeline.py (e.g. --mode full, --force ppo).
set -euo pipefail
cd "$(dirname "$0")"
# torch first: the CPU build is what `torch==2.13.0` resolves to here, and requirements.txt's loose bound keeps it
pip install torch==2.13.0
pip install -r requirements.txt
python pipeline.py "$@"
