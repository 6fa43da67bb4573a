"""Provenance: what produced a run or a report, so that a number can be traced to the software and machine behind it.

  provenance        the versions of the packages a run imports (torch, transformers, accelerate, deepspeed,
                    datasets, peft, tyro, trl; those installed), the Python version, the CPU (cpu_record: its model
                    name, family and model numbers, and whether it has AVX-512, avx512f, which changes the rounding
                    of float sums) and the project's git commit (git_commit), marked when the tree held uncommitted
                    changes ("unknown" without git or outside a checkout). Run.start writes it to the run folder
                    (provenance.json) and each checkpoint's manifest; report.py puts it in every report's header
  provenance_line   the same in one line, for a report's header
  cpu_type          the CPU type in words, which pipeline.py records per seed (a seed finishes on one type only)
  provenance_differences
                    what differs between two of them, for the one line a --resume on other versions prints

What it never does: decide or change anything a run computes, or refuse a run. It reads package metadata,
/proc/cpuinfo and `git`, and a resume on other versions goes on (bit-identity holds only on the same versions,
CPU type and commit: the note says so).
"""

import contextlib
import importlib.metadata
import os
import platform
import subprocess

# the packages whose versions can change a run's numbers (each where installed)
RECORDED_PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "datasets", "peft", "tyro", "trl")
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout the scripts run from


def cpu_record() -> dict:
    """The CPU's model name (/proc/cpuinfo, else platform.processor()), its family and model numbers (None where
    /proc/cpuinfo is absent) and whether it has AVX-512 (avx512f). The numbers tell generations apart that share a
    model name: two "AMD EPYC" machines with AVX-512 gave the quickstart different seeded digits (docs/results.md)."""
    name, flags, family, number = platform.processor() or platform.machine() or "unknown", "", None, None
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            info = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in f if ":" in line)}
        name, flags = info.get("model name", name), info.get("flags", "")  # (the last processor's: all are alike)
        family, number = info.get("cpu family"), info.get("model")
    return {"model": name, "family": family, "model_number": number, "avx512f": "avx512f" in flags.split()}


def cpu_type(chip: dict) -> str:
    """A cpu_record in words: `AMD EPYC (family 25, model 17), with AVX-512 (avx512f)`; a record without the numbers
    (none in /proc/cpuinfo, or written before they were recorded) leaves the parentheses out."""
    numbers = (f" (family {chip['family']}, model {chip.get('model_number', 'not recorded')})"
               if chip.get("family") is not None else "")
    return (f"{chip.get('model', 'unknown')}{numbers}, {'with' if chip.get('avx512f') else 'without'} AVX-512 "
            "(avx512f)")


def git_commit(root: str = CHECKOUT) -> str:
    """The commit of the checkout at `root`, with "+uncommitted changes" when a tracked file differs from it or an
    untracked one is there (ignored files aside); "unknown" without git, outside a checkout, or when git hangs."""
    def git(*arguments) -> str:
        return subprocess.run(["git", "--no-optional-locks", "-C", root, *arguments], capture_output=True, text=True,
                              timeout=20, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        return commit + (" +uncommitted changes" if git("status", "--porcelain") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance() -> dict:
    """What produces a run or a report now: package versions, Python, CPU, commit (see the module's docstring)."""
    versions = {}
    for package in RECORDED_PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return {"packages": versions, "python": platform.python_version(), "cpu": cpu_record(), "commit": git_commit()}


def provenance_line(record: dict) -> str:
    """A provenance record in one line: `torch 2.13.0, ..., Python 3.11.9, CPU <cpu_type>, commit <sha>`."""
    packages = ", ".join(f"{name} {version}" for name, version in record.get("packages", {}).items())
    return (f"{packages}, Python {record.get('python', 'unknown')}, CPU {cpu_type(record.get('cpu', {}))}, "
            f"commit {record.get('commit', 'unknown')}")


def provenance_differences(then: dict, now: dict) -> list:
    """What differs between two provenance records, `name was -> now` each; [] = the same."""
    def flat(record: dict) -> dict:
        chip = record.get("cpu", {})
        return {**record.get("packages", {}), "Python": record.get("python"), "CPU": chip.get("model"),
                "CPU family": chip.get("family", "not recorded"),  # (a record from before the numbers were kept)
                "CPU model number": chip.get("model_number", "not recorded"),
                "AVX-512": chip.get("avx512f"), "commit": record.get("commit")}

    before, after = flat(then), flat(now)
    return [f"{name} {before.get(name, 'absent')} -> {after.get(name, 'absent')}"
            for name in dict.fromkeys([*before, *after]) if before.get(name) != after.get(name)]
