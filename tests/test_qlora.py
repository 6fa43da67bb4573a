"""QLoRA (--lora_rank with --load_in_4bit) in every training script that has the flags (sft.py, dpo.py, kto.py,
ppo.py, rloo.py, online_dpo.py: found, not listed).

Unit tests on a tiny GPT-NeoX: the 4-bit layers are bitsandbytes' Linear4bit and only LoRA trains; merged_policy
(rlhf_utils/models.py, every script's save of a LoRA policy) computes what the LoRA model computes (4-bit or not)
and equals peft's merge_and_unload without 4 bits; DPO's reference with LoRA gives log-ratios of exactly 0 at
initialisation, live and precomputed; the flag checks fail at start. The end-to-end runs on the built-in task, the
resume, and the DeepSpeed runs are marked slow."""

import ast
import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import AutoModelForCausalLM

from conftest import ENV, free_port, load_script, run_ok, tiny_causal_lm, training_scripts, without_timing
from rlhf_utils import checks, models

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAD, EOS = 1, 2

sft, dpo, kto, ppo = load_script("sft"), load_script("dpo"), load_script("kto"), load_script("ppo")

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A tiny GPT-NeoX saved to disk (4-bit loading quantizes a checkpoint as it reads it)."""
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_causal_lm(seed=0, pad_token_id=PAD, eos_token_id=EOS).save_pretrained(path)
    return str(path)


def qlora_args(load_in_4bit: bool = True, lora_rank: int = 8, **more) -> SimpleNamespace:
    return SimpleNamespace(load_in_4bit=load_in_4bit, lora_rank=lora_rank, lora_alpha=16.0, bf16=False,
                           disable_dropout=True, trust_remote_code=False, gradient_checkpointing=False, **more)


def load_lora(path: str, load_in_4bit: bool):
    """sft.py's policy with --lora_rank 8 [--load_in_4bit]. Its tokenizer is read for its length only: the tiny
    model's 16 tokens."""
    return sft.load_sft_model(qlora_args(load_in_4bit, base_model=path), [None] * 16)


def randomize_lora_b(model, seed: int = 0) -> None:
    """LoRA's B starts at zero (the adapters add nothing); a random B makes every adapter count."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)


TOKENS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, EOS], [12, 3, 4, 13, 14, EOS, PAD, PAD]])


def logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return sft.forward(model, tokens, PAD, tokens != PAD).logits


def test_4bit_layers_are_bitsandbytes_and_only_lora_trains(tiny_path):
    import bitsandbytes

    model = load_lora(tiny_path, load_in_4bit=True)
    base = model.get_base_model()
    quantized = [name for name, m in base.named_modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    linear = [name for name, m in base.named_modules() if isinstance(m, torch.nn.Linear)]
    # every linear layer of the 2 blocks (qkv, attention output, two MLP layers) is 4-bit; the output layer is not
    assert len(quantized) == 8 and all(".layers." in name for name in quantized), quantized
    [kept] = [name for name in linear if name not in quantized and "lora_" not in name]
    assert base.get_submodule(kept) is base.get_output_embeddings()
    first = base.gpt_neox.layers[0].attention.query_key_value.base_layer
    assert first.weight.dtype == torch.uint8 and first.weight.quant_state.quant_type == "nf4"
    assert first.weight.quant_state.nested  # double quantization: the block scales are quantized too
    assert first.compute_dtype == torch.float32  # the run's dtype (float32 without --bf16)
    assert not first.support_avx512bf16_for_cpu  # one forward path in training and evaluation
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in name or "lora_B" in name for name in trainable)
    assert len(trainable) == 2 * len(quantized)
    # a training step reaches the adapters of the first block through the 4-bit layers above it (lora_A gets a
    # gradient once B is not zero)
    randomize_lora_b(model)
    model.train()
    sft.forward(model, TOKENS, PAD, slice(None)).logits.square().mean().backward()
    first_block = [p for n, p in model.named_parameters() if "lora_A" in n and "layers.0." in n]
    assert len(first_block) == 4 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in first_block)


def test_bf16_runs_compute_the_4bit_layers_in_bf16(tiny_path):
    config = sft.quantized_loading(qlora_args(), bf16=True)["quantization_config"]
    assert config.bnb_4bit_compute_dtype == torch.bfloat16
    assert sft.quantized_loading(qlora_args(load_in_4bit=False), bf16=True) == {}  # plain loading, as before


def test_evaluation_forwards_leave_training_intact(tiny_path):
    """An eval-mode forward without gradients (sampling, the reference) must compute what a training forward computes
    and leave the layer trainable: bitsandbytes' CPU inference kernel does neither, so lora_policy switches it off."""
    model = load_lora(tiny_path, load_in_4bit=True)
    randomize_lora_b(model)
    model.train()
    before = sft.forward(model, TOKENS, PAD, slice(None)).logits.detach()
    model.eval()
    evaluated = logits(model)
    model.train()
    after = sft.forward(model, TOKENS, PAD, slice(None)).logits
    after.square().mean().backward()  # a training forward and backward after the evaluation still work
    assert torch.equal(evaluated, before[TOKENS != PAD]) and torch.equal(after.detach(), before)


@pytest.mark.parametrize("load_in_4bit", [True, False])
def test_merged_policy_computes_what_the_lora_model_computes(tiny_path, tmp_path, load_in_4bit):
    model = load_lora(tiny_path, load_in_4bit)
    randomize_lora_b(model)
    model.eval()
    expected = logits(model)
    with model.disable_adapter():
        base = logits(model)
    assert (expected - base).abs().max() > 0.05  # the adapters change the outputs: folding them in matters
    rng = torch.get_rng_state()
    merged = models.merged_policy(model)
    assert torch.equal(torch.get_rng_state(), rng)  # no random initialisation on the way
    assert not hasattr(merged, "peft_config") and type(merged).__name__ == "GPTNeoXForCausalLM"
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    torch.testing.assert_close(logits(merged), expected, atol=1e-4, rtol=0)
    # the saved folder is a plain float32 model: from_pretrained without any quantization config
    merged.save_pretrained(tmp_path / "merged")
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert all(type(m) is torch.nn.Linear for m in loaded.modules() if isinstance(m, torch.nn.Linear))
    torch.testing.assert_close(logits(loaded), expected, atol=1e-4, rtol=0)
    # the policy keeps its adapters: training could go on
    assert any("lora_B" in name for name, _ in model.named_parameters())
    torch.testing.assert_close(logits(model), expected, atol=0, rtol=0)
    if load_in_4bit:
        # peft's merge_and_unload quantizes W + delta back to 4 bits: its model is further from the trained one
        requantized = copy.deepcopy(model).merge_and_unload()
        assert (logits(requantized) - expected).abs().max() > 10 * (logits(merged) - expected).abs().max()


def test_merged_policy_equals_merge_and_unload_without_4bit(tiny_path):
    """ppo.py saved LoRA policies with merge_and_unload; on a float32 base merged_policy gives the same weights."""
    model = load_lora(tiny_path, load_in_4bit=False)
    randomize_lora_b(model)
    ours = models.merged_policy(model).state_dict()
    peft_merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert ours.keys() == peft_merged.keys()
    different = [name for name in ours if not torch.equal(ours[name], peft_merged[name])]
    assert not different, different
    base = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    assert not torch.equal(ours["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"],
                           base["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"])  # the adapters were folded in


def preference_rows(num_rows: int = 6, seed: int = 0) -> Dataset:
    """Preference pairs in the processed schema: query + response + EOS, right-padded; labels: the query as [PAD]."""
    generator, width = torch.Generator().manual_seed(seed), 12

    def tokens(low: int, high: int) -> list:  # between low and high - 1 random ordinary tokens
        length = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(3, 16, (length,), generator=generator).tolist()

    columns = {name: [] for name in dpo.PAIR_COLUMNS}
    for _ in range(num_rows):
        query = tokens(2, 5)
        for side in ("chosen", "rejected"):
            response = tokens(1, 6) + [EOS]
            columns[f"query_{side}_token"].append((query + response + [PAD] * width)[:width])
            label = [PAD] * len(query) + response
            columns[f"query_{side}_token_response_label"].append((label + [PAD] * width)[:width])
    return dpo.with_row_index(Dataset.from_dict(columns), dpo.PAIR_COLUMNS)


@pytest.mark.parametrize("load_in_4bit", [True, False])
def test_dpo_reference_with_lora_has_log_ratio_zero_at_initialisation(tiny_path, load_in_4bit):
    args = qlora_args(load_in_4bit, sft_model_path=tiny_path)
    accelerator = Accelerator(cpu=True)
    tokenizer = [None] * 16  # len(tokenizer) is all the loader reads: the tiny model's vocabulary
    policy, reference = dpo.load_lora_policy_and_reference(args, accelerator, tokenizer)
    assert isinstance(reference, dpo.AdaptersOff) and reference.policy is policy
    dataset = preference_rows()
    batch = dataset[: len(dataset)]
    table = dpo.precompute_reference_logprobs(accelerator, reference, dataset, len(dataset), PAD)
    policy.train()
    chosen, rejected = dpo.concatenated_logprobs(policy, batch, PAD)
    for ref_model, ref_table in ((reference, None), (None, table)):  # live, and the precomputed tables
        ref_chosen, ref_rejected = dpo.reference_logprobs(ref_model, ref_table, batch, PAD)
        assert torch.equal(chosen.detach() - ref_chosen, torch.zeros_like(chosen))
        assert torch.equal(rejected.detach() - ref_rejected, torch.zeros_like(rejected))
    assert policy.training  # the reference ran in eval mode and handed the policy back as it was
    # the reference really has its adapters off: once they add something, the log-ratios move away from 0
    randomize_lora_b(policy)
    moved, _ = dpo.concatenated_logprobs(policy, batch, PAD)
    assert (moved.detach() - dpo.reference_logprobs(reference, None, batch, PAD)[0]).abs().min() > 1e-3
    # a float32 copy of the SFT model as the reference of a 4-bit policy: the log-ratios start off 0 (quantization)
    full = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    full_chosen, _ = dpo.concatenated_logprobs(full, batch, PAD)
    gap = (chosen.detach() - full_chosen).abs().max()
    assert gap > 1e-3 if load_in_4bit else gap < 1e-5


# ------------------------------------------------------------------------------------------------
# Clear errors at start: before any model loads, before the run folder or --output_dir exists
# ------------------------------------------------------------------------------------------------
def fake_accelerator(zero_stage):
    plugin = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))


def test_check_qlora_flags():
    for zero_stage in (None, 2, 3):
        # off: nothing to check
        checks.check_qlora_flags(qlora_args(load_in_4bit=False), fake_accelerator(zero_stage))
    # ZeRO-2 keeps the 4-bit base whole on every process
    checks.check_qlora_flags(qlora_args(), fake_accelerator(2))
    with pytest.raises(ValueError, match=r"--load_in_4bit \(QLoRA\) .* needs --lora_rank > 0"):
        checks.check_qlora_flags(qlora_args(lora_rank=0), fake_accelerator(None))
    with pytest.raises(ValueError, match="cannot run under DeepSpeed ZeRO-3, .* Use zero2.yaml"):
        checks.check_qlora_flags(qlora_args(), fake_accelerator(3))


def has_lora_flags(script: str) -> bool:
    """Whether a script's Args declares --lora_rank."""
    tree = ast.parse(open(os.path.join(REPO_ROOT, script)).read())
    args = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args"), None)
    return args is not None and any(isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == "lora_rank"
                                    for n in args.body)


# The training scripts with the LoRA/QLoRA flags, found rather than listed (a fork that keeps them joins by existing).
LORA_SCRIPTS = sorted(script[:-3] for script in training_scripts() if has_lora_flags(script))
# At least these: the scripts of the README's LoRA and QLoRA rows, and online_dpo.py (a fork of dpo.py that keeps them).
EXPECTED_LORA_SCRIPTS = {"sft", "dpo", "kto", "ppo", "rloo", "online_dpo"}


def test_every_script_that_should_have_lora_has_it():
    missing = EXPECTED_LORA_SCRIPTS - set(LORA_SCRIPTS)
    assert not missing, f"no --lora_rank in {sorted(missing)}"


@pytest.mark.parametrize("script", LORA_SCRIPTS)
@pytest.mark.parametrize("problem", ["no_lora", "no_bitsandbytes"])
def test_qlora_errors_come_before_anything_is_loaded_or_written(script, problem, tmp_path, monkeypatch):
    """Every flag keeps its default (model paths that do not exist here): the QLoRA error comes first."""
    import tyro

    module = load_script(script)
    monkeypatch.setitem(sys.modules, script, module)  # tyro reads the docstrings of nested dataclasses through it
    flags = ["--load_in_4bit", "--output_dir", str(tmp_path / "out"), "--run_dir_root", str(tmp_path / "runs")]
    if problem == "no_bitsandbytes":
        flags += ["--lora_rank", "8"]
        monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` fails as if not installed
    args = tyro.cli(module.Args, args=flags, use_underscores=True)  # as the scripts parse their flags
    error, message = {"no_lora": (ValueError, "needs --lora_rank > 0"),
                      "no_bitsandbytes": (ImportError, "needs the bitsandbytes package.* pip install bitsandbytes"),
                      }[problem]
    with pytest.raises(error, match=message):
        module.main(args)
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow  # a fresh interpreter importing torch, transformers and peft: ~10-30 s on 2 busy cores
def test_the_command_line_refuses_4bit_without_lora(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "sft.py"), "--base_model", "unused",
                             "--load_in_4bit", "--output_dir", str(tmp_path / "out"), "--run_dir_root", str(tmp_path)],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("sft.py: error: --load_in_4bit (QLoRA)"), result.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", LORA_SCRIPTS)
def test_every_script_has_the_flags_with_the_same_defaults(script):
    args = load_script(script).Args()
    assert (args.lora_rank, args.lora_alpha, args.load_in_4bit) == (0, 16.0, False), script


# ------------------------------------------------------------------------------------------------
# End to end on the built-in task (slow): each script with --lora_rank 8 --load_in_4bit saves a plain model
# ------------------------------------------------------------------------------------------------
QLORA = ["--lora_rank", "8", "--load_in_4bit"]


@pytest.fixture(scope="module")
def reward_model(synthetic_task, tmp_path_factory):
    """PPO's reward model: the base model with a seeded scalar head (as tests/test_ppo.py builds it)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tmp_path_factory.mktemp("qlora_rm") / "rm"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(synthetic_task["base_model"], num_labels=1).save_pretrained(path)
    AutoTokenizer.from_pretrained(synthetic_task["base_model"]).save_pretrained(path)
    return str(path)


def smoke_flags(script: str, task: dict, reward_model: str, root) -> list:
    """The flags of each script's smoke test (tests/test_sft.py, test_dpo.py, test_ppo.py), outputs under root."""
    response = ["--response_length", str(task["task"]["sft_response_length"])]
    common = ["--output_dir", str(root / "model"), "--run_dir_root", str(root / "runs"), "--run_name", "smoke"]
    return common + response + {
        "sft": ["--base_model", task["base_model"], "--query_dataset", task["sft"], "--total_episodes", "32",
                "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-3", "--eval_every", "1",
                "--num_eval_samples", "8", "--local_eval_batch_size", "4"],
        "dpo": ["--sft_model_path", task["base_model"], "--preference_dataset", task["preference"],
                "--query_dataset", task["sft"], "--total_episodes", "32", "--total_batch_size", "16",
                "--local_micro_batch_size", "8", "--lr", "1e-3", "--beta", "0.1", "--eval_every", "1",
                "--log_every", "1", "--num_eval_samples", "8", "--local_eval_batch_size", "8"],
        "kto": ["--sft_model_path", task["base_model"], "--preference_dataset", task["preference"],
                "--query_dataset", task["sft"], "--total_episodes", "32", "--total_batch_size", "16",
                "--local_micro_batch_size", "8", "--lr", "1e-3", "--eval_every", "1", "--log_every", "1",
                "--num_eval_samples", "8", "--local_eval_batch_size", "8"],
        "ppo": ["--sft_model_path", task["base_model"], "--reward_model_path", reward_model, "--query_dataset",
                task["sft"], "--total_episodes", "16", "--total_batch_size", "8", "--local_micro_batch_size", "2",
                "--local_rollout_forward_batch_size", "8", "--ppo.num_ppo_epochs", "2", "--ppo.num_mini_batches", "2",
                "--num_eval_samples", "8", "--eval_every", "1"],
        "rloo": ["--sft_model_path", task["base_model"], "--reward_model_path", reward_model, "--query_dataset",
                 task["sft"], "--total_episodes", "16", "--total_batch_size", "8", "--local_micro_batch_size", "2",
                 "--local_rollout_forward_batch_size", "8", "--num_eval_samples", "8", "--eval_every", "1"],
    }[script]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["sft", "dpo", "kto", "ppo", "rloo"])
def test_qlora_run_saves_a_plain_float32_model(script, synthetic_task, reward_model, tmp_path):
    from safetensors.torch import load_file

    flags = smoke_flags(script, synthetic_task, reward_model, tmp_path)
    run_ok([sys.executable, os.path.join(REPO_ROOT, f"{script}.py"), *flags, *QLORA], cwd=tmp_path, env=ENV,
           timeout=600)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")  # a plain from_pretrained, as judge.py loads it
    assert all(p.dtype == torch.float32 for p in model.parameters())
    saved, start = load_file(tmp_path / "model" / "model.safetensors"), load_file(
        os.path.join(synthetic_task["base_model"], "model.safetensors"))
    assert saved.keys() == start.keys()
    # the frozen parts are the start's, bit for bit; the blocks' linear layers are the 4-bit base plus the adapters
    adapted = [name for name in saved if ".layers." in name and name.endswith(".weight") and saved[name].dim() == 2]
    assert len(adapted) == 4 * model.config.num_hidden_layers
    assert all(torch.equal(saved[name], start[name]) for name in saved if name not in adapted)
    assert all(not torch.equal(saved[name], start[name]) for name in adapted)
    assert max((saved[name] - start[name]).abs().max() for name in adapted) < 0.5  # near the start, not noise
    rows = [json.loads(line) for line in open(tmp_path / "runs" / "smoke" / "metrics.jsonl")]
    if script == "dpo":  # the reference is the 4-bit base itself: rewards and loss start at exactly 0 and log 2
        first = next(row for row in rows if "train/loss" in row)
        assert first["train/rewards/chosen"] == first["train/rewards/rejected"] == 0.0
        assert first["train/loss"] == pytest.approx(0.6931471805599453, abs=1e-7)
    if script == "kto":  # the same reference: every log-ratio and z0 start at 0, each example's loss at 1 - sigmoid(0)
        first = next(row for row in rows if "train/loss" in row)
        assert first["train/z0"] == first["train/kl"] == 0.0
        assert first["train/loss"] == pytest.approx(0.5, abs=1e-7)
    if script in ("ppo", "rloo"):  # the reference is the policy with its adapters off: KL 0 at the first rollout
        assert next(row for row in rows if "objective/kl" in row)["objective/kl"] == 0.0


@pytest.mark.slow
def test_qlora_run_resumes_to_the_same_weights(synthetic_task, tmp_path):
    """A checkpoint of a 4-bit model holds each layer's quantization state beside its packed weight, which
    bitsandbytes does not read back by itself: --resume from the update-1 checkpoint ends with the same model."""
    from conftest import assert_same_safetensors

    command = [sys.executable, os.path.join(REPO_ROOT, "sft.py"), *smoke_flags("sft", synthetic_task, "", tmp_path),
               *QLORA, "--checkpoint_every", "1"]
    run_ok(command, cwd=tmp_path, env=ENV, timeout=600)
    (tmp_path / "model" / "model.safetensors").rename(tmp_path / "uninterrupted.safetensors")
    metrics = tmp_path / "runs" / "smoke" / "metrics.jsonl"
    first = [without_timing(json.loads(line)) for line in open(metrics)]
    assert os.listdir(tmp_path / "runs" / "smoke" / "checkpoints") == ["update_000001"]
    resumed = run_ok(command + ["--resume"], cwd=tmp_path, env=ENV, timeout=600)
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert_same_safetensors(tmp_path / "uninterrupted.safetensors", tmp_path / "model" / "model.safetensors")
    assert [without_timing(json.loads(line)) for line in open(metrics)] == first


# ------------------------------------------------------------------------------------------------
# DeepSpeed on 2 CPU processes (slow), as tests/test_multiprocess.py runs the scripts
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_qlora_under_zero2_matches_one_process(synthetic_task, tmp_path):
    """ZeRO-2 keeps the 4-bit base whole on each process and partitions the LoRA weights' gradients and AdamW state:
    2 processes log the metrics and save the model of 1 process (same tolerance as the other multi-process tests)."""
    from test_multiprocess import assert_same_run, run_probe, saved_weights, sft_flags

    flags = [*sft_flags(synthetic_task), *QLORA]
    two, two_rows, two_dir = run_probe("sft", flags, tmp_path, "two", 2, free_port(), "zero2")
    (one,), one_rows, one_dir = run_probe("sft", flags, tmp_path, "one", 1, 0)
    assert two[0]["zero_stage"] == 2 and set(two[0]["engines"]) == {"DeepSpeedEngine"}
    assert any(name.endswith(".weight.absmax") for name in one["weights"])  # the prepared model was the 4-bit one
    assert_same_run("sft", two, two_rows, one, one_rows, "sft QLoRA under zero2")
    saved, expected = saved_weights(two_dir), saved_weights(one_dir)
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=f"saved {name}")
    AutoModelForCausalLM.from_pretrained(two_dir)


@pytest.mark.slow
def test_zero3_refuses_4bit_and_saves_plain_lora(synthetic_task, tmp_path):
    """Under ZeRO-3 --load_in_4bit fails at start (4-bit weights cannot be partitioned); plain LoRA runs, and the
    model saved from the gathered partitions equals the 1-process one."""
    from test_multiprocess import DEEPSPEED_ENV, launcher_command, run_probe, saved_weights, sft_flags

    refused = subprocess.run([*launcher_command("zero3", 2, free_port()), "sft", str(tmp_path / "refused"), "--",
                              *sft_flags(synthetic_task), *QLORA, "--output_dir", str(tmp_path / "refused_model"),
                              "--run_dir_root", str(tmp_path / "refused_runs")],
                             cwd=REPO_ROOT, env=DEEPSPEED_ENV, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "--load_in_4bit cannot run under DeepSpeed ZeRO-3" in refused.stderr
    assert not (tmp_path / "refused_model").exists() and not (tmp_path / "refused_runs").exists()
    flags = [*sft_flags(synthetic_task), "--lora_rank", "8"]
    two, _, two_dir = run_probe("sft", flags, tmp_path, "two", 2, free_port(), "zero3")
    _, _, one_dir = run_probe("sft", flags, tmp_path, "one", 1, 0)
    assert two[0]["zero_stage"] == 3
    saved, expected = saved_weights(two_dir), saved_weights(one_dir)
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        assert saved[name].numel() > 0, name  # gathered, not the empty partition of rank 0
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=f"saved {name}")
