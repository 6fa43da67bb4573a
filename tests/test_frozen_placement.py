"""--offload without ZeRO-3 (issue 52, item 2): the frozen models (the reference policy, the reward models) wait in CPU
memory and come to the device once per phase (a rollout, an evaluation), not around every chunk of it. On the CPU
the by-hand offload is off (the models already live there), so these tests give the placement its target device
themselves: the CPU, to count the moves of a rollout and an evaluation on tiny models (a move to the CPU computes
what a move to a GPU computes); where a GPU is present, the pinned copies are checked too. placed_on lives once, in
rlhf_utils/models.py; rollout and eval_samples, which call it, are copies in ppo.py, rloo.py, grpo.py and
reinforce_pp.py (tests/test_shared_helpers.py keeps them identical), so ppo.py's stand for all."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import GenerationConfig, GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

from conftest import load_script
from rlhf_utils import models

ppo = load_script("ppo")
PAD, EOS, VOCAB = 19, 3, 20


def tiny(cls, seed: int):
    torch.manual_seed(seed)
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=64, eos_token_id=EOS, bos_token_id=EOS,
                           pad_token_id=PAD, num_labels=1)
    return cls(config).eval()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and asynchronous copies need a GPU")
def test_placed_on_pins_once_on_a_gpu():
    """The weights are on the GPU for the phase and back on the CPU after it, in pinned memory, equal; a second phase
    pins nothing new and copies nothing back (the very storage of the first)."""
    ref = tiny(GPTNeoXForCausalLM, 2)
    values = [p.detach().clone() for p in ref.parameters()]
    with models.placed_on((ref, None), torch.device("cuda")):  # None: LoRA's reference, nothing to move
        assert all(p.is_cuda for p in ref.parameters())
    pinned = [p.data_ptr() for p in ref.parameters()]
    assert all(p.is_pinned() and not p.is_cuda and torch.equal(p, v) for p, v in zip(ref.parameters(), values))
    with models.placed_on((ref,), torch.device("cuda")):
        assert all(p.is_cuda for p in ref.parameters())
    assert [p.data_ptr() for p in ref.parameters()] == pinned  # pinned at the first move only


def test_offload_moves_the_frozen_models_once_per_rollout_and_once_per_evaluation(monkeypatch):
    """An update with an evaluation: the rollout (3 chunks) and the evaluation (3 chunks) each bring the frozen models
    to the device once, 2 moves per update (before: 2 per chunk, the reference and the reward model each), and the
    samples and scores are those of a run without --offload."""
    accelerator = Accelerator(cpu=True)
    policy, critic = tiny(GPTNeoXForCausalLM, 0), tiny(GPTNeoXForSequenceClassification, 3)
    reward_model, ref = tiny(GPTNeoXForSequenceClassification, 1), tiny(GPTNeoXForCausalLM, 2)
    model = ppo.PolicyAndValue(policy, critic).eval()
    args = ppo.Args(response_length=4, local_rollout_forward_batch_size=2, num_eval_samples=6)
    config = GenerationConfig(max_new_tokens=4, temperature=0.7, top_k=0, top_p=1.0, do_sample=True, eos_token_id=[],
                              pad_token_id=PAD, suppress_tokens=[PAD])
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS,
                                decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids.tolist())))
    torch.manual_seed(1)
    queries = torch.randint(4, 18, (6, 5))
    eval_dataset = Dataset.from_dict({"query_token": queries.tolist(), "reference_response": ["r"] * 6})
    moves, original = [], models.placed_on

    @contextlib.contextmanager
    def counted(models, device):
        moves.extend([[type(m).__name__ for m in models if m is not None]] if device is not None else [])
        with original(models, device):
            yield

    def phases(device):
        torch.manual_seed(0)
        data = ppo.rollout(args, accelerator, model, ref, [reward_model], queries, tokenizer, config,
                           {"generation": 0.0, "scoring": 0.0}, bring_frozen_to=device, reward_fn=None, prompts=None,
                           rows=torch.arange(len(queries)))
        return data, ppo.eval_samples(args, accelerator, model, [reward_model], eval_dataset, tokenizer, config,
                                      bring_frozen_to=device, reward_fn=None)

    monkeypatch.setattr(models, "placed_on", counted)  # (ppo.py calls models.placed_on)
    plain = phases(None)
    assert moves == []
    offloaded = phases(torch.device("cpu"))
    assert moves == [["GPTNeoXForCausalLM", "GPTNeoXForSequenceClassification"], ["GPTNeoXForSequenceClassification"]]
    for name in ("query_responses", "logprobs", "ref_logprobs", "rm_scores", "values"):
        assert torch.equal(getattr(plain[0], name), getattr(offloaded[0], name)), name
    assert plain[1] == offloaded[1]
