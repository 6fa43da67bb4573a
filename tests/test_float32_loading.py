"""Every trained model is loaded with float32 master weights, whatever dtype its checkpoint was saved in: Pythia's hub
weights are float16, and a float16 policy would train with float16 AdamW updates (bf16 runs autocast instead)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from conftest import load_script


@pytest.fixture(scope="module")
def float16_checkpoints(synthetic_task, tmp_path_factory):
    """The built-in base model saved in float16, as a causal LM and as a reward model (with its tokenizer)."""
    root = tmp_path_factory.mktemp("float16")
    tokenizer = AutoTokenizer.from_pretrained(synthetic_task["base_model"])
    for name, cls in (("lm", AutoModelForCausalLM), ("rm", AutoModelForSequenceClassification)):
        model = cls.from_pretrained(synthetic_task["base_model"], **({"num_labels": 1} if name == "rm" else {}))
        model.to(torch.float16).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        assert cls.from_pretrained(root / name).dtype == torch.float16  # the checkpoint really is float16
    return str(root / "lm"), str(root / "rm"), tokenizer


def trained_dtypes(*models):
    return {p.dtype for m in models for p in m.parameters() if p.requires_grad}


@pytest.mark.parametrize("name", ["ppo", "rloo", "grpo"])
def test_policy_and_critic_of_the_online_methods_load_in_float32(name, float16_checkpoints):
    module = load_script(name)
    lm, rm, tokenizer = float16_checkpoints
    args = module.Args(sft_model_path=lm, reward_model_path=[rm])
    policy, reward_models, ref_policy = module.load_models(args, tokenizer, False)
    # ppo.py's critic (--critic_init reward: from the reward model's float16 checkpoint); rloo.py and grpo.py have none
    critics = [module.load_critic(args, tokenizer)] if name == "ppo" else []
    assert trained_dtypes(policy, *critics) == {torch.float32}
    assert {p.dtype for m in (*reward_models, ref_policy) for p in m.parameters()} == {torch.float32}


def test_offline_rl_policy_loads_in_float32(float16_checkpoints):
    offline_rl = load_script("offline_rl")
    lm, rm, tokenizer = float16_checkpoints
    policy, reward_model = offline_rl.load_offline_models(offline_rl.Args(sft_model_path=lm, reward_model_path=rm),
                                                          tokenizer)[:2]
    assert trained_dtypes(policy) == {torch.float32}
    assert {p.dtype for p in reward_model.parameters()} == {torch.float32}


def test_sft_model_loads_in_float32(float16_checkpoints):
    sft = load_script("sft")
    lm, _, tokenizer = float16_checkpoints
    assert trained_dtypes(sft.load_sft_model(sft.Args(base_model=lm), tokenizer)) == {torch.float32}
