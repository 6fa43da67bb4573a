"""tools/measure_memory.py: the peak-memory table of the training scripts, and its 6.9B estimate."""

import csv
import os
import subprocess
import sys

import pytest

from conftest import ENV, REPO_ROOT, tiny_causal_lm

sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
import measure_memory  # noqa: E402


def test_parameter_formula_matches_real_models():
    """The estimate's parameter count: exact on real GPT-NeoX models and on Pythia-6.9B's published count."""
    from transformers import GPTNeoXForSequenceClassification

    lm = tiny_causal_lm(vocab_size=16)
    c = lm.config
    assert measure_memory.gpt_neox_params(c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size) == \
        sum(p.numel() for p in lm.parameters())
    c.num_labels = 1
    rm = GPTNeoXForSequenceClassification(c)
    assert measure_memory.gpt_neox_params(c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size,
                                          lm_head=False) == sum(p.numel() for p in rm.parameters())
    assert measure_memory.gpt_neox_params(4096, 32, 50432, 16384) == 6_857_302_016  # Pythia-6.9B


def test_estimate_zero3_needs_less_than_zero2():
    text = measure_memory.paper_estimate()
    assert "an estimate, not a measurement" in text
    peak = next(line for line in text.splitlines() if line.startswith("| **estimated peak**"))
    zero2, zero3 = (float(cell.strip(" *")) for cell in peak.split("|")[2:4])
    # model states: 2P + 14P/N vs 16P/N with P = 13.51B trained parameters and N = 8
    states = next(line for line in text.splitlines() if line.startswith("| **model states**"))
    s2, s3 = (float(cell.strip(" *")) for cell in states.split("|")[2:4])
    p = measure_memory.gpt_neox_params(4096, 32, 50432, 16384) + measure_memory.gpt_neox_params(
        4096, 32, 50432, 16384, lm_head=False)
    assert s2 == pytest.approx((2 * p + 14 * p / 8) / 2**30, abs=0.05)
    assert s3 == pytest.approx(16 * p / 8 / 2**30, abs=0.05)
    assert zero3 < zero2 and zero2 >= s2 and zero3 >= s3


def test_failed_child_names_the_script_and_shows_its_stderr(tmp_path):
    args = measure_memory.Args()
    cmd = [sys.executable, "-c",
           "import sys; print('work' + 'ing'); sys.stderr.write('ValueError: boom\\n'); sys.exit(3)"]
    with pytest.raises(measure_memory.RunFailed) as error:
        measure_memory.run_child(cmd, "ppo.py (lora mode)", str(tmp_path / "log"), args)
    message = str(error.value)
    assert "ppo.py (lora mode) failed (exit code 3)" in message and "ValueError: boom" in message
    assert "working" not in message  # stdout stays in the log file


def test_unknown_script_or_mode_is_refused():
    with pytest.raises(SystemExit, match="unknown --scripts"):
        measure_memory.select_runs(measure_memory.Args(scripts=["judge.py"]))
    with pytest.raises(SystemExit, match="unknown --modes"):
        measure_memory.select_runs(measure_memory.Args(modes=["int8"]))
    runs = measure_memory.select_runs(measure_memory.Args(scripts=["ppo"], modes=["plain", "lora"]))
    assert runs == [("ppo.py", "plain"), ("ppo.py", "lora")]


def test_lora_and_qlora_modes_of_sft_dpo_and_ppo():
    args = measure_memory.Args(lora_rank=4)
    runs = measure_memory.select_runs(measure_memory.Args(scripts=["sft", "dpo", "ppo", "reward"], modes=["qlora"]))
    assert runs == [("sft.py", "qlora"), ("dpo.py", "qlora"), ("ppo.py", "qlora")]  # reward.py has no LoRA
    for script, _ in runs:
        assert measure_memory.mode_flags(script, "lora", args) == ["--lora_rank", "4"]
        assert measure_memory.mode_flags(script, "qlora", args) == ["--lora_rank", "4", "--load_in_4bit"]
        assert measure_memory.script_has_flag(script, "load_in_4bit")


def test_a_run_flag_counts_as_the_scripts_own():
    """--checkpoint_every sits in every script's run group (rlhf_utils/flags.py), not in its own Args."""
    for script in ("sft.py", "ppo.py", "dpo.py", "ilql.py"):
        assert measure_memory.script_has_flag(script, "checkpoint_every")
        assert not measure_memory.script_has_flag(script, "no_such_flag")
    assert not measure_memory.script_has_flag("reward.py", "lora_rank")  # a flag of the script's own is still read


@pytest.mark.slow  # the end-to-end runs: in the full suite, out of the quick `-m "not slow"` check
def test_tiny_model_table_and_csv(synthetic_task, tmp_path):
    """sft.py and ppo.py, each plain, LoRA and QLoRA, on a tiny model: one row per run, real figures."""
    out = tmp_path / "memory"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tools", "measure_memory.py"), "--task_dir", synthetic_task["root"],
           "--output_dir", str(out), "--hidden_size", "64", "--num_layers", "2", "--num_heads", "4",
           "--scripts", "sft.py", "ppo.py", "--modes", "plain", "lora", "qlora",
           "--updates", "1", "--micro_batch_size", "4", "--num_eval_samples", "4"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    table = (out / "memory.md").read_text()
    assert table.strip() in result.stdout  # printed as well
    header = table.splitlines()[0]
    assert f"{os.cpu_count()} CPUs" in header and "GPT-NeoX hidden 64, 2 layers, 4 heads" in header
    rows_md = [line for line in table.splitlines() if line.startswith(("| sft.py", "| ppo.py"))]
    assert len(rows_md) == 6
    assert "## Worked example: PPO at Pythia-6.9B on 8 GPUs (an estimate, not a measurement)" in table

    with open(out / "memory.csv") as f:
        rows = {(r["script"], r["mode"]): r for r in csv.DictReader(f)}
    assert set(rows) == {(script, mode) for script in ("sft.py", "ppo.py") for mode in ("plain", "lora", "qlora")}
    for row in rows.values():
        assert row["status"] == "ok"
        peak, own, before = (float(row["peak_rss_mib"]), float(row["own_peak_rss_mib"]),
                             float(row["rss_before_main_mib"]))
        assert peak > 0 and before > 0 and peak >= before
        # the parent never grew large, so the child's ru_maxrss is its own high-water mark
        assert abs(peak - own) <= 0.05 * own
        assert float(row["wall_s"]) > float(row["main_s"]) > 0
        if row["peak_gpu_allocated_mib"] == "":
            assert "n/a (no GPU)" in table
    plain, lora = rows[("ppo.py", "plain")], rows[("ppo.py", "lora")]
    model_params = int(plain["model_params"])
    assert int(plain["policy_trainable_params"]) == int(plain["policy_params"]) == model_params
    assert 0 < int(lora["policy_trainable_params"]) < int(plain["policy_trainable_params"])
    assert int(lora["policy_params"]) > model_params  # the adapters sit on top of the frozen weights
    # PPO's AdamW also holds the critic; SFT's holds the policy alone
    assert int(plain["optimizer_params"]) > int(plain["policy_trainable_params"])
    assert int(rows[("sft.py", "plain")]["optimizer_params"]) == model_params
    assert "--lora_rank 8" in lora["command"] and "--checkpoint_every 0" in lora["command"]
    qlora = rows[("ppo.py", "qlora")]
    assert "--lora_rank 8 --load_in_4bit" in qlora["command"]
    assert int(qlora["policy_trainable_params"]) == int(lora["policy_trainable_params"])  # the same adapters
    assert int(qlora["policy_params"]) < int(lora["policy_params"])  # 4-bit weights are packed two per byte
    assert "packs two 4-bit weights" in table
