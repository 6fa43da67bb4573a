# Set up the project's Python environment; `source setup.sh` (quickstart.sh and the README's test command do).
# Inside an active virtual environment (or conda env) it installs there. Otherwise it creates, or reuses, .venv in
# the project folder and activates it, so the project's pins never mix into the system Python (which, on Debian 12
# or Ubuntu 24.04, refuses pip installs outright).
# torch comes first: `torch==2.13.0` resolves to the CPU build on our machines, and the loose bound in
# requirements.txt then keeps it. A torch that is already installed is never replaced: on a GPU machine, install the
# CUDA build that matches your driver first, in the same env, and this script keeps it (a CPU wheel in its place
# would turn torch.cuda.is_available() false, and every run would fall back to the CPU in silence).
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ]; then
    if [ ! -x "$_here/.venv/bin/python" ]; then
        echo "setup.sh: creating the virtual environment $_here/.venv"
        python3 -m venv "$_here/.venv" || {
            echo "setup.sh: python3 -m venv failed (Debian/Ubuntu: apt install python3-venv)"
            return 1 2>/dev/null || exit 1
        }
    fi
    . "$_here/.venv/bin/activate"
fi
echo "setup.sh: installing into $(python -c 'import sys; print(sys.prefix)') (pip output in $_here/.venv-pip.log)"
if python -c "import torch" >/dev/null 2>&1; then
    echo "setup.sh: keeping the torch already installed ($(python -c 'import torch; print(torch.__version__)'))"
    _torch=":"
else
    _torch="python -m pip install torch==2.13.0"
fi
{ $_torch && python -m pip install -r "$_here/requirements.txt"; } >"$_here/.venv-pip.log" 2>&1 || {
    tail -n 20 "$_here/.venv-pip.log"
    echo "setup.sh: pip failed (full log: $_here/.venv-pip.log)"
    return 1 2>/dev/null || exit 1
}
echo "setup.sh: ready ($(python -c 'import torch; print("torch", torch.__version__)'))"
