"""--gradient_checkpointing (rlhf_utils/models.py: checkpointed) and the per-size recipe of the README (issue 52,
item 3).

- Every training script has the flag, off by default, with one help text, and passes it to checkpointed() for the
  models it trains.
- transformers' activation checkpointing reruns each decoder layer in the backward pass (counted with a hook), and
  the loss and every gradient equal those of the same model without it, for each kind of model that trains here: a
  causal LM (the policy), a scalar-head model (the reward model, and PPO's critic, which reads a value per token
  through its trunk) and a LoRA policy (peft; only the adapters train).
- Slow: ppo.py (policy and critic) under zero3.yaml on 2 CPU processes ends with the weights of the same run without
  checkpointing.
- tools/measure_memory.py: the activations it counts with checkpointing, derived by hand, and the README's per-size
  commands: they are the tool's recipe, each keeps the paper's batch, and each fits the estimate on an 80 GiB GPU.
- tools/bench_trl.py --gradient_checkpointing reaches our side's command.
"""

import ast
import copy
import os
import re
import sys

import pytest
import torch

from conftest import REPO_ROOT, tiny_causal_lm, training_scripts

sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
import measure_memory  # noqa: E402
from rlhf_utils.models import checkpointed  # noqa: E402


def args_field(tree: ast.Module, name: str):
    """The (default, docstring) of the field `name` of the module's Args dataclass, or None."""
    args = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args")
    for i, node in enumerate(args.body):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            doc = args.body[i + 1].value.value if i + 1 < len(args.body) else None
            return ast.literal_eval(node.value), doc
    return None


def test_every_training_script_has_the_flag_and_passes_it_on():
    helps = {}
    for script in training_scripts():
        tree = ast.parse(open(os.path.join(REPO_ROOT, script)).read())
        field = args_field(tree, "gradient_checkpointing")
        assert field is not None, f"{script} has no --gradient_checkpointing"
        default, helps[script] = field
        assert default is False, f"{script}: --gradient_checkpointing must be off by default (the paper's runs)"
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)  # (models.checkpointed, or imported)
                 and ast.unparse(node.func) in ("checkpointed", "models.checkpointed")]
        assert any(ast.unparse(call.args[1]) == "args.gradient_checkpointing" for call in calls), \
            f"{script} never passes --gradient_checkpointing to checkpointed()"
    assert len(set(helps.values())) == 1, "one help text for the one flag"
    assert "Off: the paper trained without it" in " ".join(next(iter(helps.values())).split())


def rerun_count_loss_and_grads(model: torch.nn.Module, loss_of, checkpointing: bool):
    """A copy of `model` in training mode, with or without checkpointing: how often its first decoder layer's
    attention started in one forward + backward pass, the loss, and the gradients of every weight that trains. (A
    pre-hook: torch's non-reentrant rerun stops once it has recomputed every saved tensor, possibly before a later
    module of the layer returns.)"""
    model = checkpointed(copy.deepcopy(model), checkpointing).train()
    attention = next(module for name, module in model.named_modules() if name.endswith("layers.0.attention"))
    calls = []
    attention.register_forward_pre_hook(lambda *_: calls.append(1))
    loss = loss_of(model)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return len(calls), loss.detach(), grads


def assert_same_loss_and_grads(model: torch.nn.Module, loss_of) -> None:
    plain_calls, plain_loss, plain_grads = rerun_count_loss_and_grads(model, loss_of, False)
    calls, loss, grads = rerun_count_loss_and_grads(model, loss_of, True)
    # without it the layer runs once per forward pass; with it, once more in the backward pass
    assert plain_calls >= 1 and calls == 2 * plain_calls
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == plain_grads.keys()
    assert any(g.abs().sum() > 0 for g in grads.values())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


IDS = torch.tensor([[1, 1, 5, 6, 7, 8, 9, 2], [3, 4, 5, 6, 7, 8, 10, 11], [1, 12, 13, 14, 15, 2, 1, 1]])
MASK = (IDS != 1).long()  # [PAD] = 1, on the left (queries) and on the right (after EOS)


def token_logprob_loss(model) -> torch.Tensor:
    """A policy's loss: the mean negative log-prob of each real next token (SFT's, and the shape of PPO's)."""
    logits = model(input_ids=IDS, attention_mask=MASK).logits[:, :-1]
    logprobs = torch.gather(logits.log_softmax(-1), 2, IDS[:, 1:, None])[..., 0]
    mask = MASK[:, 1:].float()
    return -(logprobs * mask).sum() / mask.sum()


def test_causal_lm_policy():
    assert_same_loss_and_grads(tiny_causal_lm(vocab_size=16), token_logprob_loss)


def test_scalar_head_reward_model_and_critic():
    from transformers import GPTNeoXForSequenceClassification

    config = tiny_causal_lm(vocab_size=16).config
    config.num_labels = 1
    torch.manual_seed(0)
    model = GPTNeoXForSequenceClassification(config)

    def loss_of(scorer):
        score = scorer(input_ids=IDS, attention_mask=MASK).logits[:, 0]  # the reward model's score per sequence
        trunk = getattr(scorer, scorer.base_model_prefix)  # the critic's value at every token
        values = scorer.score(trunk(input_ids=IDS, attention_mask=MASK).last_hidden_state)[..., 0]
        return (score - torch.tensor([1.0, -1.0, 0.5])).pow(2).mean() + (values * MASK).pow(2).mean()

    assert_same_loss_and_grads(model, loss_of)


def test_lora_policy():
    from peft import LoraConfig, get_peft_model

    base = tiny_causal_lm(vocab_size=16)
    # as the scripts' lora_policy adapts it (every linear layer), with B drawn at random instead of zero so that A's
    # gradients are not zero either
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                             init_lora_weights=False))
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)  # the frozen embeddings: no grad reaches them
    assert_same_loss_and_grads(policy, token_logprob_loss)


@pytest.mark.slow
def test_ppo_under_zero3_with_checkpointing_ends_with_the_weights_of_a_run_without(synthetic_task, tmp_path):
    """ppo.py trains a policy and a critic; under ZeRO-3 each layer's weights are gathered by DeepSpeed's hooks, for
    the forward pass and again for its rerun in the backward pass. 2 processes, zero3.yaml, with and without
    --gradient_checkpointing: the same metrics and final weights."""
    from test_multiprocess import assert_same_run, ppo_flags, run_probe, with_flag

    # one rollout, two PPO epochs (two AdamW steps: the second one's size depends on the gradients' sizes, not only
    # their signs), and the smallest final evaluation
    flags = with_flag(ppo_flags(synthetic_task), "--total_episodes", "8")
    flags = with_flag(with_flag(flags, "--num_eval_samples", "2"), "--eval_every", "0")
    plain, plain_rows, _ = run_probe("ppo", flags, tmp_path, "plain", 2, None, "zero3")
    ckpt, ckpt_rows, _ = run_probe("ppo", flags, tmp_path, "ckpt", 2, None, "zero3",
                                   extra=("--gradient_checkpointing",))
    assert ckpt[0]["zero_stage"] == 3 and set(ckpt[0]["engines"]) == {"DeepSpeedEngine"}
    assert sum(plain[0]["checkpointing"]) == 0 and sum(ckpt[0]["checkpointing"]) > 0
    assert_same_run("ppo", ckpt, ckpt_rows, plain[0], plain_rows, "ppo under zero3, --gradient_checkpointing")
    assert plain[0]["weights"].keys() == ckpt[0]["weights"].keys() and plain[0]["weights"]
    for name, tensor in plain[0]["weights"].items():
        torch.testing.assert_close(ckpt[0]["weights"][name], tensor, rtol=1e-6, atol=1e-6, msg=name)


# ---- tools/measure_memory.py: the estimate with checkpointing, and the README's per-size recipe ----
def test_checkpointing_keeps_each_layers_input_and_one_layer():
    # sft.py at Pythia-1B (h 2048, 16 layers), micro batch 2 of 565 tokens, ZeRO-2: activations of 34 s b h bytes per
    # layer without checkpointing; with it, each layer's bf16 input (2 s b h) and one layer's 34 s b h
    s, b, h, L = 565, 2, 2048, 16
    plain = measure_memory.phase_estimate("sft.py", "1b", 2, b, 32, False, False)["training"]
    ckpt = measure_memory.phase_estimate("sft.py", "1b", 2, b, 32, True, False)["training"]
    assert plain - ckpt == pytest.approx(L * 34 * s * b * h - (L * 2 * s * b * h + 34 * s * b * h))
    # ppo.py trains two models (policy, critic): twice the saving
    plain = measure_memory.phase_estimate("ppo.py", "1b", 2, b, 32, False, False)["training"]
    ckpt = measure_memory.phase_estimate("ppo.py", "1b", 2, b, 32, True, False)["training"]
    assert plain - ckpt == pytest.approx(2 * (L * 34 * s * b * h - (L * 2 * s * b * h + 34 * s * b * h)))
    # --offload under ZeRO-3 takes the frozen reference's and reward model's 1/8 shards (2 bytes each) off the GPU
    policy = measure_memory.gpt_neox_params(2048, 16, 50304, 8192)
    rm = measure_memory.gpt_neox_params(2048, 16, 50304, 8192, lm_head=False)
    kept = measure_memory.phase_estimate("ppo.py", "1b", 3, b, 32, False, False)["training"]
    offloaded = measure_memory.phase_estimate("ppo.py", "1b", 3, b, 32, False, True)["training"]
    assert kept - offloaded == pytest.approx(2 * (policy + rm) / 8)


def readme_commands() -> list:
    """The README's `accelerate launch` commands with an --output_dir of models/<kind>_<size>, each as
    (config, script, size, flags), continuation lines joined."""
    text = open(os.path.join(REPO_ROOT, "README.md")).read().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        match = re.match(r"accelerate launch --config_file (zero[23])\.yaml (\w+\.py) (.*)", line.strip())
        size = re.search(r"--output_dir models/(?:sft|rm|ppo|dpo)_(1b|2\.8b|6\.9b)\b", line)
        if match and size:
            commands.append((match.group(1), match.group(2), size.group(1), match.group(3).split()))
    return commands


def flag(flags: list, name: str, default=None):
    return flags[flags.index(name) + 1] if name in flags else default


def test_readme_per_size_commands_are_the_recipe_and_fit_the_estimate():
    text = open(os.path.join(REPO_ROOT, "README.md")).read()
    assert measure_memory.recipe_commands() in text, "the README's per-size block is not `measure_memory.py --recipe`"
    commands = readme_commands()
    found = {(script, size) for _, script, size, _ in commands}
    assert found == {(s, z) for s in measure_memory.README_COMMANDS for z in measure_memory.PYTHIA_SIZES}
    assert len(commands) == len(found), "one command per script and size"
    budget = measure_memory.HEADROOM * 80 * 2**30
    for config, script, size, flags in commands:
        c = measure_memory.RECIPE_SCRIPTS[script]
        micro = int(flag(flags, "--local_micro_batch_size"))
        accumulation = int(flag(flags, "--gradient_accumulation_steps"))
        assert micro * accumulation == c["rows"], f"{script} {size}: the paper's batch per process"
        chunk = int(flag(flags, c["chunk"][0])) if c["chunk"] else 0
        phases = measure_memory.phase_estimate(script, size, int(config[-1]), micro, chunk,
                                               "--gradient_checkpointing" in flags, "--offload" in flags)
        assert max(phases.values()) <= budget, f"{script} {size} does not fit 80 GiB by the estimate: {phases}"


def test_bench_trl_runs_our_side_with_the_flag_when_asked():
    """tools/bench_trl.py --gradient_checkpointing (the peak-memory comparison in docs/results.md, Memory): our
    command carries the flag only then (TRL's side reads the same setting into its config)."""
    import bench_trl

    paths = {"base_model": "base", "rows": "rows", "response_length": 8}
    for on in (False, True):
        settings = {**bench_trl.settings_for("tiny")["sft"], "gradient_checkpointing": on}
        command = bench_trl.our_command("sft", "fp32", 16, paths, "work", "run", settings)
        assert ("--gradient_checkpointing" in command) is on
