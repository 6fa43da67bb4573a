"""setup.sh never replaces a torch that is already installed (a CUDA build matched to the user's driver would become
a CPU wheel, and every run would fall back to the CPU in silence), and installs torch==2.13.0 where none is.

pip is stubbed: `python` on the PATH is a small script that logs every call, answers `import torch` as told and
installs nothing, so the test needs no network and leaves no package behind."""

import os
import stat
import subprocess

import pytest

from conftest import REPO_ROOT

STUB = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
case "$*" in
  "-c import torch") exit "$STUB_TORCH_MISSING" ;;
  *"import torch; print(torch.__version__)"*) echo "9.9.9+cu999" ;;
  *"print(\\"torch\\", torch.__version__)"*) echo "torch 9.9.9+cu999" ;;
  *"import sys; print(sys.prefix)"*) echo "$VIRTUAL_ENV" ;;
esac
exit 0
"""


def source_setup(tmp_path, torch_installed: bool) -> tuple[subprocess.CompletedProcess, list]:
    """`source setup.sh` inside an active (stub) environment; returns the result and the stub's logged calls."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(STUB)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(tmp_path / "env"),
           "STUB_LOG": str(log), "STUB_TORCH_MISSING": "0" if torch_installed else "1"}
    result = subprocess.run(["bash", "-c", f"source {os.path.join(REPO_ROOT, 'setup.sh')}"], env=env,
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    return result, log.read_text().splitlines()


@pytest.mark.parametrize("torch_installed", [True, False], ids=["torch-installed", "no-torch"])
def test_setup_keeps_an_installed_torch_and_installs_one_where_none_is(tmp_path, torch_installed):
    result, calls = source_setup(tmp_path, torch_installed)
    assert result.returncode == 0, result.stdout + result.stderr
    installs = [call for call in calls if call.startswith("-m pip install")]
    assert installs[-1] == f"-m pip install -r {os.path.join(REPO_ROOT, 'requirements.txt')}"  # always, last
    if torch_installed:
        assert installs == installs[-1:], f"setup.sh replaced an installed torch: {installs}"
        assert "keeping the torch already installed (9.9.9+cu999)" in result.stdout
    else:
        assert installs == ["-m pip install torch==2.13.0", installs[-1]]
    assert "setup.sh: ready (torch 9.9.9+cu999)" in result.stdout
