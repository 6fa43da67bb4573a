"""Traps of the GPU launch that a 1-process CPU run cannot show (issue 52, item 4), shown on the CPU where their
mechanism runs there:
- every script passes --process_group_timeout_min (its run flags, rlhf_utils/flags.py: RunFlags) to
  rlhf_utils.run.start_processes, and that timeout reaches the process group that DeepSpeed starts (a barrier nobody
  else joins fails after it, not after torch's default);
- check_finite finds a NaN in a weight that ZeRO-3 partitioned when it was loaded (each process holds a shard, the
  weight itself is empty);
- ilql.py's sampling loop, which ends once every row holds an EOS, keeps the processes in step under ZeRO-3 when one
  process's rows end first (each forward pass all-gathers the weights from all processes);
- (online_dpo.py's Gumbel noise drawn on the queries' device: tests/test_online_dpo.py)
- the timers of ppo.py, rloo.py and grpo.py read rlhf_utils.run.synced_time, which waits for a GPU's queued work.
The 2-process checks run in one launch of tests/zero3_traps_probe.py (slow)."""

import ast
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ENV, free_port, tiny_causal_lm, training_scripts

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(REPO_ROOT, "tests", "zero3_traps_probe.py")


def test_the_run_flags_hold_the_timeout_flag_of_60_minutes():
    """--process_group_timeout_min is one of the run's flags (RunFlags, which every script's Args takes in), 60 min."""
    import dataclasses

    from rlhf_utils.flags import RunFlags

    timeout = {f.name: f for f in dataclasses.fields(RunFlags)}.get("process_group_timeout_min")
    assert timeout is not None, "RunFlags has no --process_group_timeout_min"
    assert timeout.default == 60.0 and RunFlags().process_group_timeout_min == 60.0


@pytest.mark.parametrize("script", sorted(name[:-3] for name in training_scripts()))
def test_every_script_joins_its_process_group_with_the_timeout_flag(script):
    """Args takes in the run's flags (`run: RunFlags`, with --process_group_timeout_min), and main's one
    start_processes call passes it."""
    tree = ast.parse(open(os.path.join(REPO_ROOT, f"{script}.py")).read())
    args = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args")
    fields = {node.target.id: node for node in args.body if isinstance(node, ast.AnnAssign)}
    assert "run" in fields, f"{script}.py's Args takes in no run flags (run: RunFlags): no --process_group_timeout_min"
    assert "RunFlags" in {n.id for n in ast.walk(fields["run"].annotation) if isinstance(n, ast.Name)}, script
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", None)
             == "start_processes"]
    assert [ast.unparse(call) for call in calls] == ["start_processes(args.run.process_group_timeout_min)"], script


@pytest.mark.slow
def test_timeout_check_finite_and_ilql_sampling_under_zero3_with_two_processes(tmp_path):
    """One `accelerate launch --config_file zero3.yaml` of 2 CPU processes (tests/zero3_traps_probe.py) with a process
    group timeout of 12 s: the NaN of a partitioned weight is named on both processes, ilql_generate returns on both
    when only rank 0's rows end at once (before the fix rank 0 left the loop alone and the next collective aborted),
    and rank 0's lone barrier fails after the 12 s."""
    # a tiny model saved twice: as it is, and with a NaN at the last entry of one matrix (in the last process's shard)
    finite, nan = tmp_path / "finite", tmp_path / "nan"
    lm = tiny_causal_lm()
    lm.save_pretrained(finite)
    with torch.no_grad():
        lm.gpt_neox.layers[1].mlp.dense_h_to_4h.weight[-1, -1] = float("nan")
    lm.save_pretrained(nan)
    out, timeout_min = tmp_path / "out", 0.2  # 12 s
    out.mkdir()
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(REPO_ROOT, "zero3.yaml"), "--num_processes", "2", "--mixed_precision", "no",
               "--main_process_port", str(free_port()), PROBE, str(out), str(finite), str(nan), str(timeout_min)]
    result = subprocess.run(command, cwd=REPO_ROOT, env={**ENV, "DS_ACCELERATOR": "cpu"}, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.load(open(out / f"rank{r}.json")) for r in range(2)]
    for rank in ranks:
        # check_finite: the weights were partitioned as they loaded, and the NaN is named on both processes
        assert rank["partitioned"]
        assert "gpt_neox.layers.1.mlp.dense_h_to_4h.weight has 1 NaN or inf values of 2048" in rank["check_finite"]
        # ilql_generate: both processes left the sampling loop together and met in the gather after it
        assert rank["gathered"] == [float(len(ranks[0]["responses"]) * 6), 12.0]
    # rank 0's rows end at their first token ([PAD] after it); rank 1's never end (6 sampled tokens, no [PAD])
    assert all(row[0] == ranks[0]["eos"] and row[1:] == [1] * 5 for row in ranks[0]["responses"])
    assert ranks[1]["eos"] == 1 and all(1 not in row for row in ranks[1]["responses"])
    # the barrier rank 1 never joins fails after the flag's 12 s, not torch's 30 minutes
    assert "12000ms" in ranks[0]["barrier"] or "0:00:12" in ranks[0]["barrier"], ranks[0]["barrier"]
    assert 11 < ranks[0]["barrier_s"] < 60, ranks[0]["barrier_s"]


@pytest.mark.parametrize("script", ["ppo", "rloo", "grpo"])
def test_the_phase_timers_wait_for_the_device(script):
    """Every phase time of the update (generation, scoring, training, the whole update) is read with synced_time."""
    source = open(os.path.join(REPO_ROOT, f"{script}.py")).read()
    for line in ("t0 = synced_time(accelerator.device)", "t1 = synced_time(accelerator.device)",
                 'timers["scoring"] += synced_time(accelerator.device) - t1', "t_train = synced_time(device)",
                 'timers["wall"] = synced_time(device) - update_start'):
        assert line in source, (script, line)


def test_synced_time_synchronizes_a_gpu_and_not_the_cpu(monkeypatch):
    from rlhf_utils import run as run_module

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    run_module.synced_time(torch.device("cpu"))
    assert calls == []
    run_module.synced_time(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]
