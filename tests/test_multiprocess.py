"""Multi-process correctness on the CPU, for every training script: 2 processes over gloo, launched three ways:
- `torchrun` (plain data parallel);
- DeepSpeed ZeRO-2 and ZeRO-3 (Detail 8), with the command the README gives, the shipped zero2.yaml / zero3.yaml
  and only their hardware lines overridden on the command line (2 processes, no mixed precision), on DeepSpeed's
  CPU accelerator: `DS_ACCELERATOR=cpu accelerate launch --config_file zero3.yaml --num_processes 2
  --mixed_precision no ppo.py ...`. PPO's ZeRO-3 run adds --offload (ZeRO-3 parameter offload of the frozen
  reference and reward model, the paper's 6.9B setting).
tests/mp_probe.py runs the script's main() unchanged and saves each rank's final weights and RNG seed.

For each script and launcher, one 2-process run and one 1-process run with the same global batch prove:
- the weights are identical on both ranks after the updates (gradients are all-reduced, nothing diverges);
- the sampling seeds differ per rank (each rank draws its own samples);
- the 1-process and 2-process runs make the same number of updates, log the same training metrics and end
  with the same weights, within float tolerance. Because the 1-process run accumulates the two micro-batches
  that the two ranks take, this also proves that each rank reads a different shard (two ranks reading the
  same rows would train on half the data) and that logged metrics are gathered from every rank (rank 0's
  alone would differ from the 1-process mean).
Under DeepSpeed, in addition: every prepared module is a DeepSpeedEngine of the requested ZeRO stage, and the model
the script saved (under ZeRO-3 gathered from the partitions) loads with from_pretrained on one process and equals
the 1-process save. Separate tests run every script once in bf16 under ZeRO-2 (the GPU recipe's dtype path:
a bf16 engine beside bf16 frozen models), and SIGKILL + --resume a ZeRO-2 PPO run.
Every run gets a free port of its own (conftest.free_port), so tests running at once never meet on one.
The bf16 test compares what training did, not where it ended: the update of the weights (final minus initial; the
initial weights are those of a float32 run with --lr 0) in bf16 against the float32 run's, wherever bf16's spacing
can show it, and requires that the weights moved.
Every multi-process test is marked `slow`: `-m "not slow"` (the quick check after a fork) skips them; CI runs them."""

import glob
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import ENV, assert_same_safetensors, free_port, kill_after_checkpoint, training_scripts, without_timing

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(REPO_ROOT, "tests", "mp_probe.py")
TORCHRUN_ENV = {**ENV, "ACCELERATE_USE_CPU": "true"}  # torchrun's processes talk over gloo on the CPU
DEEPSPEED_ENV = {**ENV, "DS_ACCELERATOR": "cpu"}  # DeepSpeed's CPU accelerator (its ops need no GPU)


def sft_flags(task: dict) -> list:
    return ["--base_model", task["base_model"], "--query_dataset", task["sft"],
            "--response_length", str(task["task"]["sft_response_length"]), "--total_episodes", "64",
            "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-3",
            "--num_eval_samples", "16", "--local_eval_batch_size", "8", "--eval_every", "2"]


def reward_flags(task: dict) -> list:
    return ["--sft_model_path", task["base_model"], "--preference_dataset", task["preference"],
            "--query_dataset", task["sft"], "--total_episodes", "64", "--total_batch_size", "16",
            "--local_micro_batch_size", "8", "--lr", "1e-4", "--num_eval_samples", "32",
            "--num_normalization_samples", "32", "--eval_every", "2", "--log_every", "1"]


def dpo_flags(task: dict) -> list:
    return ["--sft_model_path", task["base_model"], "--preference_dataset", task["preference"],
            "--query_dataset", task["sft"], "--response_length", str(task["task"]["sft_response_length"]),
            "--total_episodes", "64", "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-4",
            "--beta", "0.1", "--log_every", "1", "--num_eval_samples", "16", "--local_eval_batch_size", "8"]


def ilql_flags(task: dict) -> list:
    return ["--init_from", "base", "--model_path", task["base_model"], "--preference_dataset", task["preference"],
            "--query_dataset", task["sft"], "--response_length", str(task["task"]["sft_response_length"]),
            "--total_episodes", "64", "--total_batch_size", "16", "--local_micro_batch_size", "8",
            "--ilql.steps_for_target_q_sync", "2", "--log_every", "1", "--num_eval_samples", "8",
            "--local_eval_batch_size", "4", "--eval_betas", "1"]


def reward_model(task: dict, seed: int = 0) -> str:
    """A reward model for the PPO run: the base model with a scalar head from `seed` (made once per task)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.path.join(task["root"], "mp_reward_model" + (f"_seed{seed}" if seed else ""))
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        torch.manual_seed(seed)
        AutoModelForSequenceClassification.from_pretrained(task["base_model"], num_labels=1).save_pretrained(path)
        AutoTokenizer.from_pretrained(task["base_model"]).save_pretrained(path)
    return path


def ppo_flags(task: dict) -> list:
    # Rollouts are sampled with a different seed on each rank, so the 1-process run can only draw the same
    # responses when sampling is near greedy (--temperature 0.001). One minibatch per epoch keeps the
    # minibatches of both runs the same rows; whitening uses the statistics of the global batch.
    return ["--sft_model_path", task["base_model"], "--reward_model_path", reward_model(task),
            "--query_dataset", task["sft"], "--response_length", str(task["task"]["sft_response_length"]),
            "--total_episodes", "32", "--total_batch_size", "8", "--local_micro_batch_size", "4",
            "--local_rollout_forward_batch_size", "4", "--ppo.num_ppo_epochs", "2", "--ppo.num_mini_batches", "1",
            "--temperature", "0.001", "--num_eval_samples", "8", "--eval_every", "2", "--lr", "1e-4"]


def rloo_flags(task: dict) -> list:
    # as PPO's (near-greedy sampling, one minibatch per epoch); both responses to a query are then the same and
    # their advantages 0, so PPO-ptx gives the weights a gradient that both runs must agree on
    return ["--sft_model_path", task["base_model"], "--reward_model_path", reward_model(task),
            "--query_dataset", task["sft"], "--response_length", str(task["task"]["sft_response_length"]),
            "--total_episodes", "32", "--total_batch_size", "8", "--local_micro_batch_size", "4",
            "--local_rollout_forward_batch_size", "4", "--rloo.num_ppo_epochs", "2", "--rloo.ptx_coef", "0.1",
            "--temperature", "0.001", "--num_eval_samples", "8", "--eval_every", "2", "--lr", "1e-4"]


def offline_rl_flags(task: dict) -> list:
    # each run builds its own RM-labelled mixture ({run} is the run's folder), greedy as the seed paper did
    return ["--method", "rwr", "--sft_model_path", task["base_model"], "--reward_model_path", reward_model(task),
            "--query_dataset", task["sft"], "--preference_dataset", task["preference"],
            "--response_length", str(task["task"]["sft_response_length"]), "--cache_dir", "{run}/cache",
            "--mixture_size", "32", "--total_batch_size", "8", "--local_micro_batch_size", "4",
            "--num_eval_samples", "4", "--local_rollout_batch_size", "8", "--lr", "1e-4"]


def kto_flags(task: dict) -> list:
    # the built-in preference pairs, each split into a desirable and an undesirable example; z0 is estimated over the
    # update's whole batch (gathered), so 2 processes must see the reference point of 1
    return ["--sft_model_path", task["base_model"], "--preference_dataset", task["preference"],
            "--query_dataset", task["sft"], "--response_length", str(task["task"]["sft_response_length"]),
            "--total_episodes", "64", "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-4",
            "--log_every", "1", "--num_eval_samples", "16", "--local_eval_batch_size", "8"]


def online_dpo_flags(task: dict) -> list:
    # pairs sampled each round at temperature 1 with per-prompt seeds (the same samples however the prompts are
    # split over processes), labelled by a reward model
    return ["--sft_model_path", task["base_model"], "--reward_model_path", reward_model(task),
            "--preference_dataset", task["preference"], "--query_dataset", task["sft"],
            "--response_length", str(task["task"]["sft_response_length"]), "--total_episodes", "48",
            "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-3", "--beta", "0.1",
            "--log_every", "1", "--num_eval_samples", "8", "--local_eval_batch_size", "8"]


def grpo_flags(task: dict) -> list:
    # as RLOO's: near-greedy sampling makes the responses of a group alike and their advantages 0, so what trains is
    # the KL in the loss and PPO-ptx; DAPO's token mean over the whole minibatch gathers its token count
    return ["--sft_model_path", task["base_model"], "--reward_model_path", reward_model(task),
            "--query_dataset", task["sft"], "--response_length", str(task["task"]["sft_response_length"]),
            "--total_episodes", "32", "--total_batch_size", "8", "--local_micro_batch_size", "2", "--group_size", "2",
            "--local_rollout_forward_batch_size", "4", "--grpo.num_ppo_epochs", "2", "--grpo.ptx_coef", "0.1",
            "--grpo.loss_normalizer", "batch_token_mean", "--grpo.advantage_std", "batch", "--temperature", "0.001",
            "--num_eval_samples", "8", "--eval_every", "2", "--lr", "1e-4"]


def reinforce_pp_flags(task: dict) -> list:
    # as RLOO's (near-greedy sampling, one minibatch per epoch), one response per query: 8 queries of other scores,
    # whose returns are whitened with the statistics of the global batch, so 2 processes train as 1 only if they
    # gather them
    return ["--sft_model_path", task["base_model"], "--reward_model_path", reward_model(task),
            "--query_dataset", task["sft"], "--response_length", str(task["task"]["sft_response_length"]),
            "--total_episodes", "32", "--total_batch_size", "8", "--local_micro_batch_size", "4",
            "--local_rollout_forward_batch_size", "4", "--reinforce_pp.num_ppo_epochs", "2",
            "--reinforce_pp.ptx_coef", "0.1", "--temperature", "0.001", "--num_eval_samples", "8", "--eval_every", "2",
            "--lr", "1e-4"]


SCRIPTS = {"sft": sft_flags, "reward": reward_flags, "dpo": dpo_flags, "ilql": ilql_flags, "ppo": ppo_flags,
           "rloo": rloo_flags, "offline_rl": offline_rl_flags, "kto": kto_flags, "online_dpo": online_dpo_flags,
           "grpo": grpo_flags, "reinforce_pp": reinforce_pp_flags}


def test_every_training_script_runs_here():
    """A training script joins these tests by existing: each one found (conftest.training_scripts) has its flags
    above, so that 2 processes = 1 holds for it under every launcher and in bf16."""
    found = {script[:-3] for script in training_scripts()}
    assert found <= set(SCRIPTS), f"no multi-process flags for {sorted(found - set(SCRIPTS))}: add them to SCRIPTS"
LAUNCHERS = ["torchrun", "zero2", "zero3"]


def launcher_command(launcher: str, processes: int, port: int, bf16: bool = False) -> list:
    """The command that starts tests/mp_probe.py: plain python (1 process), torchrun, or the README's
    `accelerate launch --config_file zeroN.yaml` with only the hardware lines overridden."""
    if processes == 1:
        return [sys.executable, PROBE]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                "--master_port", str(port), PROBE]
    return [sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", os.path.join(REPO_ROOT, f"{launcher}.yaml"),
            "--num_processes", str(processes), "--mixed_precision", "bf16" if bf16 else "no",
            "--main_process_port", str(port), PROBE]


def run_probe(script: str, flags: list, tmp_path, name: str, processes: int, port=None, launcher: str = "torchrun",
              bf16: bool = False, extra: tuple = ()):
    """Run `script` under `launcher`; returns each rank's probe record, the metrics rows and the output folder.
    port: the rendezvous port of a multi-process run; None (best) takes a free one."""
    port = free_port() if port is None and processes > 1 else port
    out = tmp_path / name
    flags = [flag.replace("{run}", str(out)) for flag in flags]
    output_dir = tmp_path / f"model_{name}"
    common = ["--output_dir", str(output_dir), "--run_dir_root", str(tmp_path / "runs"), "--run_name", name,
              "--checkpoint_every", "0", *extra]
    command = [*launcher_command(launcher, processes, port, bf16), script, str(out), "--", *flags, *common]
    env = TORCHRUN_ENV if launcher == "torchrun" or processes == 1 else DEEPSPEED_ENV
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(processes)]
    rows = [without_timing(json.loads(line)) for line in open(tmp_path / "runs" / name / "metrics.jsonl")]
    return ranks, rows, output_dir


def one_process_run(script: str, task: dict):
    """The 1-process run every launcher is compared with, made once per script and test worker."""
    root = pathlib.Path(task["root"]) / "one_process" / script
    if not (root / "one" / "rank0.pt").exists():
        root.mkdir(parents=True, exist_ok=True)
        return run_probe(script, SCRIPTS[script](task), root, "one", 1)
    return ([torch.load(root / "one" / "rank0.pt")],
            [without_timing(json.loads(line)) for line in open(root / "runs" / "one" / "metrics.jsonl")],
            root / "model_one")


def with_flag(flags: list, name: str, value: str) -> list:
    """`flags` with the value of `name` replaced."""
    i = flags.index(name)
    return flags[: i + 1] + [value] + flags[i + 2 :]


def saved_weights(output_dir) -> dict:
    """Every tensor the script saved (model.safetensors, plus ilql_heads.safetensors for ILQL), by file and name."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(output_dir, "*.safetensors")))
    assert files, f"no safetensors in {output_dir}"
    return {f"{os.path.basename(f)}:{name}": t for f in files for name, t in load_file(f).items()}


def loads_with_from_pretrained(script: str, output_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if script == "reward" else AutoModelForCausalLM
    return cls.from_pretrained(output_dir)


def assert_same_run(script, two, two_rows, one, one_rows, what: str):
    """The same updates, the same logged training metrics and the same final weights as the 1-process run."""
    steps = lambda rows: [row["step"] for row in rows]  # noqa: E731
    assert steps(two_rows) == steps(one_rows) and len(two_rows) > 0, what
    for a, b in zip(two_rows, one_rows):
        assert a.keys() == b.keys(), what
        for key in a:
            if key.startswith(("train/", "objective/", "ppo/", "rloo/", "grpo/", "reinforce_pp/", "online/", "loss")) \
                    and isinstance(a[key], float):
                # a clip fraction counts values past a threshold: a 1e-8 difference can flip one token
                tolerance = dict(abs=0.01) if "clipfrac" in key else dict(rel=1e-4, abs=1e-5)
                assert a[key] == pytest.approx(b[key], **tolerance), (what, a["step"], key)
            elif key.startswith("online/"):  # online DPO's pair counts: the same pairs, counted alike
                assert a[key] == b[key], (what, a["step"], key)
    assert two[0]["weights"].keys() == one["weights"].keys(), what
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(two[0]["weights"][name], tensor, rtol=1e-4, atol=1e-5, msg=f"{what}: {name}")


# the tests of one script share its 1-process run when they run in one pytest-xdist worker (--dist loadgroup)
BY_SCRIPT = [pytest.param(script, marks=pytest.mark.xdist_group(script)) for script in sorted(SCRIPTS)]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "zero2", "zero3"])
@pytest.mark.parametrize("script", BY_SCRIPT)
def test_two_processes_match_one_process(script, launcher, synthetic_task, tmp_path):
    flags = SCRIPTS[script](synthetic_task)
    # ZeRO-3 parameter offload of PPO's frozen reference and reward model (--offload), the paper's 6.9B recipe
    extra = ("--offload",) if script == "ppo" and launcher == "zero3" else ()
    two, two_rows, two_dir = run_probe(script, flags, tmp_path, "two", 2, None, launcher, extra=extra)
    (one,), one_rows, one_dir = one_process_run(script, synthetic_task)
    what = f"{script} under {launcher}"

    assert two[0]["world_size"] == 2
    if launcher == "torchrun":
        assert two[0]["zero_stage"] is None and "DeepSpeedEngine" not in two[0]["engines"]
    else:  # every prepared module runs in a DeepSpeed engine of the requested stage
        assert two[0]["engines"] and set(two[0]["engines"]) == {"DeepSpeedEngine"}, two[0]["engines"]
        assert two[0]["zero_stage"] == int(launcher[-1])
    if launcher == "zero3":  # the weights are partitioned: get_state_dict gathers them on rank 0 only
        assert two[1]["weights"] == {}
    else:  # both ranks end with bit-identical weights
        assert two[0]["weights"].keys() == two[1]["weights"].keys()
        for name, tensor in two[0]["weights"].items():
            assert torch.equal(tensor, two[1]["weights"][name]), f"{what}: {name} differs between rank 0 and rank 1"
    # each rank samples with its own seed (reward.py samples nothing: it keeps the common seed)
    if script != "reward":
        assert two[0]["initial_seed"] != two[1]["initial_seed"]

    assert_same_run(script, two, two_rows, one, one_rows, what)
    if launcher != "torchrun":
        # what the script saved (under ZeRO-3: gathered from the partitions, not empty shards) is the full model
        saved, expected = saved_weights(two_dir), saved_weights(one_dir)
        assert saved.keys() == expected.keys(), what
        for name, tensor in expected.items():
            assert saved[name].shape == tensor.shape and saved[name].numel() > 0, f"{what}: {name} {saved[name].shape}"
            torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=f"{what}: saved {name}")
        loaded = loads_with_from_pretrained(script, two_dir).state_dict()
        reference = loads_with_from_pretrained(script, one_dir).state_dict()
        for name, tensor in reference.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=1e-4, atol=1e-5, msg=f"{what}: loaded {name}")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ppo", "rloo"])
def test_reward_model_ensemble_under_zero2_matches_one_process(script, synthetic_task, tmp_path):
    """Two reward models joined by the min rule, each with its own running statistics for reward scaling (fed the
    gathered batch): ZeRO-2 on 2 processes ends with the weights and metrics of 1 process."""
    flags = SCRIPTS[script](synthetic_task)
    i = flags.index("--reward_model_path")
    flags = [*flags[: i + 2], reward_model(synthetic_task, seed=1), "--reward_combine", "min",
             f"--{script}.scale_rewards", *flags[i + 2 :]]
    (one,), one_rows, _ = run_probe(script, flags, tmp_path, "one", 1)
    two, two_rows, _ = run_probe(script, flags, tmp_path, "two", 2, None, "zero2")
    assert two[0]["zero_stage"] == 2 and set(two[0]["engines"]) == {"DeepSpeedEngine"}
    train = [row for row in two_rows if "objective/scores_rm1" in row]
    assert train and all(row["objective/scores_rm0"] != row["objective/scores_rm1"] for row in train)
    assert_same_run(script, two, two_rows, one, one_rows, f"{script}, two reward models, under zero2")


OFFLINE_METHODS = {"filter": [], "dt": ["--dt_eval_targets", "0"],
                   # each rank samples with its own seed: near-greedy candidates are the same rows as one process's
                   "best_of_n": ["--n", "2", "--bon_num_prompts", "8", "--iterations", "2",
                                 "--bon_temperature", "0.001"]}


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(OFFLINE_METHODS))
def test_other_offline_methods_under_zero3_match_one_process(method, synthetic_task, tmp_path):
    """offline_rl.py's other methods (the test above runs RWR): MLE with filtering and the Decision Transformer
    train on the same RM-labelled mixture with other weights or prompts; best-of-n samples and labels in rounds
    from the policy being trained. Each under ZeRO-3 computes what its 1-process run computes."""
    flags = with_flag(offline_rl_flags(synthetic_task), "--method", method) + OFFLINE_METHODS[method]
    two, two_rows, two_dir = run_probe("offline_rl", flags, tmp_path, "two", 2, None, "zero3")
    (one,), one_rows, one_dir = run_probe("offline_rl", flags, tmp_path, "one", 1)
    assert set(two[0]["engines"]) == {"DeepSpeedEngine"} and two[0]["zero_stage"] == 3
    assert_same_run("offline_rl", two, two_rows, one, one_rows, f"offline_rl --method {method} under zero3")
    saved, expected = saved_weights(two_dir), saved_weights(one_dir)
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=f"{method}: saved {name}")


def initial_weights(script: str, task: dict) -> dict:
    """The weights every run of `script` starts from, as the probe records them: a float32 1-process run with --lr 0
    (the optimizer steps, but moves nothing), made once per script and test worker."""
    root = pathlib.Path(task["root"]) / "zero_lr" / script
    if not (root / "start" / "rank0.pt").exists():
        root.mkdir(parents=True, exist_ok=True)
        flags = SCRIPTS[script](task)
        flags = with_flag(flags, "--lr", "0") if "--lr" in flags else [*flags, "--lr", "0"]
        run_probe(script, flags, root, "start", 1)
    return torch.load(root / "start" / "rank0.pt")["weights"]


def as_bf16(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as a bf16 model holds it (rounded to the nearest bf16), in float32 for the arithmetic."""
    return tensor.to(torch.bfloat16).float()


def bf16_spacing(tensor: torch.Tensor) -> torch.Tensor:
    """The gap between a value and the next bf16 (8 significant bits): 2^(exponent - 7) for |x| in [2^e, 2^(e+1))."""
    _, exponent = torch.frexp(tensor.float())  # x = m * 2^exponent with 0.5 <= |m| < 1
    return torch.ldexp(torch.ones_like(tensor, dtype=torch.float32), (exponent - 8).clamp(min=-126))


def compare_updates(bf16: dict, float32: dict, start: dict) -> dict:
    """How a bf16 run's update of the weight matrices compares with a float32 run's from the same start.
    - The weight matrices (every 2-D tensor: the linear layers, the embeddings, the heads) hold nearly all parameters
      and only the optimizer moves them; biases and norm gains are left out (few of their elements move visibly, and
      reward.py's Detail-15 normalisation shifts a norm bias after training by a mean reward computed in bf16).
    - The bf16 run's weights are bf16 (its float32 master weights rounded), so an update smaller than the bf16
      spacing of its weight rounds away or to one step: the comparison covers the elements whose float32 update
      spans at least 2 steps (`visible`), where the bf16 update, bf16(w) - bf16(w0), can show it.
    Returns their number and share, both updates' norms over them, the cosine between the updates and their relative
    difference |u_bf16 - u_32| / |u_32|."""
    u16, u32, visible = [], [], []
    for name, w0 in start.items():
        if w0.dim() != 2:
            continue
        update = (float32[name].float() - w0.float()).flatten()
        u16.append((as_bf16(bf16[name]) - as_bf16(w0)).flatten())
        u32.append(update)
        visible.append(update.abs() >= 2 * bf16_spacing(w0).flatten())
    u16, u32, visible = torch.cat(u16), torch.cat(u32), torch.cat(visible)
    u16, u32 = u16[visible], u32[visible]
    norm16, norm32 = u16.norm().item(), u32.norm().item()
    return {"visible": int(visible.sum()), "visible_share": visible.float().mean().item(), "norm_bf16": norm16,
            "norm_float32": norm32, "cosine": (u16 @ u32).item() / max(norm16 * norm32, 1e-30),
            "relative_difference": (u16 - u32).norm().item() / max(norm32, 1e-30)}


# Where the float32 update is visible in bf16, the bf16 run's update points the same way and has the same size. On the
# built-in task (4 updates; ZeRO-2 on 2 processes in bf16 against 1 process in float32): sft, ppo, kto, online_dpo,
# dpo, rloo, ilql and offline_rl gave a cosine of 0.99-0.9997 and a relative difference of 0.03-0.14; reward.py, whose
# pairwise loss reads small differences of two rewards that bf16 rounds, 0.95 and 0.32; every norm ratio 0.99-1.00,
# over 30-93% of the matrices' elements. A run that never trained (lr 0) has an update of norm 0 there, and one that
# moved the weights at random a cosine near 0.
MIN_VISIBLE, MIN_COSINE, MAX_RELATIVE_DIFFERENCE, NORM_RATIO = 1000, 0.9, 0.5, (0.8, 1.25)


@pytest.mark.slow
@pytest.mark.parametrize("script", BY_SCRIPT)
def test_bf16_under_zero2(script, synthetic_task, tmp_path):
    """The GPU recipe's precision on the CPU: --bf16 under ZeRO-2, where DeepSpeed casts the trained model to bf16
    (float32 master weights in the optimizer) and the frozen models load in bf16. A dtype mismatch between them
    would fail here. The run must finish with finite bf16 weights and finite training metrics, and train as the
    float32 1-process run trains: its update of the weights (final minus initial) has the float32 update's size and
    direction wherever bf16 can show it (compare_updates); so the weights moved."""
    two, rows, _ = run_probe(script, SCRIPTS[script](synthetic_task), tmp_path, "bf16", 2, None, "zero2", bf16=True,
                             extra=("--bf16", "True"))
    (one,), _, _ = one_process_run(script, synthetic_task)
    start = initial_weights(script, synthetic_task)
    assert set(two[0]["engines"]) == {"DeepSpeedEngine"}
    weights = two[0]["weights"]
    assert weights.keys() == one["weights"].keys() == start.keys()
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16, f"{name} is {tensor.dtype}: the engine did not run in bf16"
        assert torch.isfinite(tensor.float()).all(), name
    compared = compare_updates(weights, one["weights"], start)
    print(f"{script}: bf16 against float32, {compared}")  # shown with pytest -s or -rP
    assert compared["visible"] >= MIN_VISIBLE, f"{script}: the float32 run barely moved the weights: {compared}"
    ratio = compared["norm_bf16"] / compared["norm_float32"]
    assert NORM_RATIO[0] <= ratio <= NORM_RATIO[1], f"{script}: the bf16 update has another size: {compared}"
    assert compared["cosine"] >= MIN_COSINE, f"{script}: bf16 updated the weights otherwise: {compared}"
    assert compared["relative_difference"] <= MAX_RELATIVE_DIFFERENCE, f"{script}: bf16 updated otherwise: {compared}"
    assert rows
    for row in rows:
        for key, value in row.items():
            if key.startswith(("train/", "objective/", "ppo/", "loss")) and isinstance(value, float):
                assert value == value and abs(value) != float("inf"), (row["step"], key, value)


@pytest.mark.slow
def test_zero2_sigkill_then_resume_matches_an_uninterrupted_run(synthetic_task, tmp_path):
    """A ZeRO-2 PPO run killed (SIGKILL) right after its update-2 checkpoint and resumed with --resume ends where
    the uninterrupted ZeRO-2 run ends: the same saved policy, bit for bit. The checkpoint holds DeepSpeed's own
    engine and optimizer state (written through accelerate's save_state)."""
    flags = with_flag(ppo_flags(synthetic_task), "--total_episodes", "40")  # 5 updates of 8

    def command(name, *more):
        return [*launcher_command("zero2", 2, free_port()), "ppo", str(tmp_path / name), "--",
                *flags, "--output_dir", str(tmp_path / f"model_{name}"), "--run_dir_root", str(tmp_path / "runs"),
                "--run_name", name, "--checkpoint_every", "2", *more]

    subprocess.run(command("full"), cwd=REPO_ROOT, env=DEEPSPEED_ENV, capture_output=True, check=True, timeout=600)
    kill_after_checkpoint(command("killed"), tmp_path / "runs" / "killed" / "checkpoints" / "update_000002",
                          cwd=REPO_ROOT, env=DEEPSPEED_ENV, timeout=300)
    assert not (tmp_path / "model_killed" / "model.safetensors").exists()
    # the checkpoint records who wrote it, and one plain process is refused before anything loads
    checkpoint = tmp_path / "runs" / "killed" / "checkpoints" / "update_000002"
    manifest = json.load(open(checkpoint / "manifest.json"))
    assert (manifest["num_processes"], manifest["deepspeed_stage"]) == (2, 2)
    one = subprocess.run([sys.executable, PROBE, *command("killed", "--resume")[len(launcher_command("zero2", 2, 0)):]],
                         cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert one.returncode != 0 and one.stderr.strip().splitlines()[-1] == (
        f"mp_probe.py: error: --resume: {checkpoint} was written by 2 process(es) with DeepSpeed stage 2, "
        "this run has 1 with stage None; launch 2 process(es) with the original config"), one.stderr[-2000:]
    resumed = subprocess.run(command("killed", "--resume"), cwd=REPO_ROOT, env=DEEPSPEED_ENV, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout and "update_000002" in resumed.stdout, resumed.stdout[-2000:]
    assert_same_safetensors(tmp_path / "model_full" / "model.safetensors",
                            tmp_path / "model_killed" / "model.safetensors")
    full = [without_timing(json.loads(line)) for line in open(tmp_path / "runs" / "full" / "metrics.jsonl")]
    killed = [without_timing(json.loads(line)) for line in open(tmp_path / "runs" / "killed" / "metrics.jsonl")]
    assert [row["step"] for row in killed] == [row["step"] for row in full] and full[-1] == killed[-1]


@pytest.mark.slow
def test_a_refused_resume_of_a_zero2_run_is_one_paragraph_from_rank_0(synthetic_task, tmp_path):
    """issue 40: a ZeRO-2 sft.py run written by 2 processes, resumed on 1 (plain, and as `accelerate launch
    --num_processes 1`) and on 2 under ZeRO-3: the refusal is printed once, by rank 0, with no traceback of the
    script (before: under a rank traceback, accelerate's ChildFailedError and torch's failure block, 48 lines). The
    launcher's own report may follow it."""
    flags = [*sft_flags(synthetic_task), "--output_dir", str(tmp_path / "model"),
             "--run_dir_root", str(tmp_path / "runs"), "--run_name", "z2", "--checkpoint_every", "2"]
    sft = os.path.join(REPO_ROOT, "sft.py")

    def launch(config: str, processes: int) -> list:  # each launch takes a free port
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(REPO_ROOT, config),
                "--num_processes", str(processes), "--mixed_precision", "no", "--main_process_port",
                str(free_port()), sft]

    written = subprocess.run([*launch("zero2.yaml", 2), *flags], cwd=REPO_ROOT, env=DEEPSPEED_ENV,
                             capture_output=True, text=True, timeout=600)
    assert written.returncode == 0, written.stderr[-4000:]
    checkpoint = tmp_path / "runs" / "z2" / "checkpoints" / "update_000002"
    refusal = (f"--resume: {checkpoint} was written by 2 process(es) with DeepSpeed stage 2, this run has {{}} "
               f"with stage {{}}; launch 2 process(es) with the original config")
    for command, env, ours in (([sys.executable, sft], ENV, (1, None)),
                               (launch("zero2.yaml", 1), DEEPSPEED_ENV, (1, 2)),
                               (launch("zero3.yaml", 2), DEEPSPEED_ENV, (2, 3))):
        result = subprocess.run([*command, *flags, "--resume"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                timeout=600)
        paragraph = f"sft.py: error: {refusal.format(*ours)}"
        assert result.returncode != 0, result.stderr[-3000:]
        assert result.stderr.count(paragraph) == 1, result.stderr[-4000:]
        script_part = result.stderr.split(paragraph)[0] + paragraph  # what the script printed, before any report of
        assert "Traceback" not in script_part, result.stderr[-4000:]  # the launcher
        assert "resumed from" not in result.stdout
