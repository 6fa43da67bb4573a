"""The LM head only where a loss reads it: every script's `forward(model, query_responses, pad_token_id, read)` runs
the output layer (hidden -> vocabulary) at the positions `read` marks, not at every position. These tests run each
script's own loss code twice, once as it is and once with its `forward` swapped for the full-width computation (the
head at every position, then the same positions picked from the logits), and require the same numbers: losses and
gradients to a relative 1e-5 (absolute 1e-4 near zero), summed log-probs to an absolute 1e-4, float32. A hook on the
output layer counts the rows it is given, so a `read` that is silently ignored (every position computed) fails.
Also: a LoRA adapter on the output layer still applies, and DPO's reference of a LoRA run (AdaptersOff) works."""

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

from conftest import load_script

sft, dpo, kto, online_dpo = load_script("sft"), load_script("dpo"), load_script("kto"), load_script("online_dpo")
ppo, rloo, grpo, offline_rl = load_script("ppo"), load_script("rloo"), load_script("grpo"), load_script("offline_rl")
PAIR_SCRIPTS = {"dpo": dpo, "kto": kto, "online_dpo": online_dpo}
POLICY_SCRIPTS = {"ppo": ppo, "rloo": rloo, "grpo": grpo}

PAD, EOS, VOCAB = 1, 2, 40
WQ, WR = 9, 8  # query and response widths


def lm(seed: int = 0):
    torch.manual_seed(seed)
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=64, eos_token_id=EOS, bos_token_id=EOS,
                           pad_token_id=PAD, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTNeoXForCausalLM(config).eval()


def critic(seed: int = 1):
    """ppo.py's critic: a scalar head (num_labels 1) on a model of lm's shape."""
    config = lm(seed).config
    config.num_labels = 1
    torch.manual_seed(seed)
    return GPTNeoXForSequenceClassification(config).eval()


def rows(seed: int = 0, query_lengths=(9, 5, 7, 3), response_lengths=(8, 3, 6, 1)):
    """Left-padded queries (B, WQ) + right-padded responses (B, WR) ending in EOS, side by side, and the response
    labels (the same with every query token a [PAD])."""
    g = torch.Generator().manual_seed(seed)
    queries, responses = torch.full((len(query_lengths), WQ), PAD), torch.full((len(query_lengths), WR), PAD)
    for i, (q, r) in enumerate(zip(query_lengths, response_lengths)):
        queries[i, WQ - q :] = torch.randint(3, VOCAB, (q,), generator=g)
        responses[i, :r] = torch.randint(3, VOCAB, (r,), generator=g)
        responses[i, r - 1] = EOS
    return torch.cat((queries, responses), 1), torch.cat((torch.full_like(queries, PAD), responses), 1)


def full_width_forward(model, query_responses, pad_token_id, read):
    """The computation before: the head at every position, then the positions `read` picked from its logits."""
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.long().cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return SimpleNamespace(logits=logits[:, read] if isinstance(read, slice) else logits[read])


class HeadRows:
    """Counts the rows (positions) the model's output layer computes (the rows of its output), while active."""

    def __init__(self, model):
        self.head, self.rows, self.calls = model.get_output_embeddings(), 0, 0

    def __enter__(self):
        def count(_, inputs, output):  # after the layer: whatever picked its inputs has run
            self.rows += output.shape[:-1].numel()
            self.calls += 1
        self.handle = self.head.register_forward_hook(count)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def both_ways(module, monkeypatch, compute, seed: int = 0):
    """compute(model) -> a tuple of tensors, run with the script's forward and with the full-width one, each on a fresh
    copy of the same model; returns (ours, full, our gradients, full gradients, rows our head computed)."""
    results = []
    for full in (False, True):
        model = lm(seed)
        with monkeypatch.context() as patch:
            if full:
                patch.setattr(module, "forward", full_width_forward)
            with HeadRows(model) as seen:
                outputs = compute(model)
        sum(o.float().sum() for o in outputs if o.requires_grad).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((tuple(o.detach() for o in outputs), grads, seen.rows))
    (ours, our_grads, rows_seen), (full, full_grads, _) = results
    return ours, full, our_grads, full_grads, rows_seen


def assert_same(ours, full, our_grads, full_grads):
    for a, b in zip(ours, full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    assert our_grads.keys() == full_grads.keys() and our_grads
    for name in our_grads:
        torch.testing.assert_close(our_grads[name], full_grads[name], rtol=1e-5, atol=1e-4, msg=name)


def test_sft_loss_reads_only_the_target_positions(monkeypatch):
    query_responses, response_labels = rows()
    labels = sft.sft_labels(response_labels, PAD)
    ours, full, g1, g2, seen = both_ways(sft, monkeypatch,
                                         lambda m: sft.next_token_loss(m, query_responses, labels, PAD))
    assert_same(ours, full, g1, g2)
    targets = int((labels[:, 1:] != -100).sum())
    assert ours[1] == targets and seen == targets  # the head saw the target positions and nothing else
    assert seen < query_responses.numel() / 2


@pytest.mark.parametrize("name", sorted(PAIR_SCRIPTS))
def test_sequence_logprobs_read_only_the_response_positions(monkeypatch, name):
    module = PAIR_SCRIPTS[name]
    query_responses, response_labels = rows()
    ours, full, g1, g2, seen = both_ways(
        module, monkeypatch, lambda m: (module.sequence_logprobs(m, query_responses, response_labels, PAD),))
    assert_same(ours, full, g1, g2)
    assert seen == int((response_labels[:, 1:] != PAD).sum())  # each response token, predicted from the one before


def test_offline_rl_weighted_loss_reads_only_the_target_positions(monkeypatch):
    query_responses, _ = rows()
    labels = offline_rl.response_labels(query_responses, WQ, PAD)
    weights = torch.tensor([1.0, 0.0, 2.5, 0.5])
    ours, full, g1, g2, seen = both_ways(
        offline_rl, monkeypatch, lambda m: offline_rl.weighted_response_loss(m, query_responses, labels, weights, PAD))
    assert_same(ours, full, g1, g2)
    assert seen == int((labels[:, 1:] != -100).sum())


@pytest.mark.parametrize("name", sorted(POLICY_SCRIPTS))
def test_policy_update_and_ptx_read_only_the_action_and_target_positions(monkeypatch, name):
    """The update's pass (ppo.py's PolicyAndValue with its critic, rloo.py's and grpo.py's Policy) and its ptx batch,
    and the rollout's reference pass. The critic is a model of its own (its scalar head, not the policy's LM head)."""
    module = POLICY_SCRIPTS[name]
    query_responses, _ = rows(seed=1, response_lengths=(8, 8, 8, 8))  # rollouts: every response WR tokens long
    ptx_tokens, ptx_labels = rows(seed=2)

    def update(model):
        if module is ppo:
            wrapped = ppo.PolicyAndValue(model, critic())
            logprobs, all_logprobs, values, ptx_logits = ppo.training_logprobs_and_values(
                wrapped, query_responses, WQ, 0.7, PAD, ptx_tokens, ptx_labels)
            assert values.shape == (4, WR)  # the critic's value before each response token
        else:
            logprobs, all_logprobs, ptx_logits = module.training_logprobs(
                module.Policy(model, False), query_responses, WQ, 0.7, PAD, ptx_tokens, ptx_labels)
        assert logprobs.shape == (4, WR) and all_logprobs.shape == (4, WR, VOCAB)
        return logprobs, module.sft_loss(ptx_logits, ptx_labels, PAD)

    ours, full, g1, g2, seen = both_ways(module, monkeypatch, update)
    assert_same(ours, full, g1, g2)
    assert seen == 4 * WR + int((ptx_labels[:, 1:] != PAD).sum())

    ours, full, g1, g2, seen = both_ways(module, monkeypatch, lambda m: (module.reference_logits(
        m, None, lambda lm: module.forward(lm, query_responses, PAD, slice(WQ - 1, -1)).logits
    ).float().log_softmax(-1),))
    assert_same(ours, full, g1, g2)
    assert seen == 4 * WR


def test_a_lora_adapter_on_the_output_layer_still_applies_and_adapters_off_reads_the_base():
    """LoRA on embed_out (randomly initialised, so it changes the logits): the picked positions go through the
    adapter; DPO's AdaptersOff reference reads the same positions of the base model."""
    query_responses, response_labels = rows()
    base = lm()
    expected_base = dpo.sequence_logprobs(base, query_responses, response_labels, PAD)
    policy = get_peft_model(lm(), LoraConfig(r=4, lora_alpha=8, target_modules=["embed_out", "query_key_value"],
                                             init_lora_weights=False))
    with HeadRows(policy) as seen:
        with_adapters = dpo.sequence_logprobs(policy, query_responses, response_labels, PAD)
    targets = int((response_labels[:, 1:] != PAD).sum())
    assert seen.rows == targets and seen.calls == 1
    full = full_width_forward(policy, query_responses, PAD,
                              torch.nn.functional.pad(response_labels[:, 1:] != PAD, (0, 1)))
    picked = full.logits.log_softmax(-1).gather(1, response_labels[:, 1:][response_labels[:, 1:] != PAD].unsqueeze(-1))
    sums = torch.zeros(4).index_add(0, (response_labels[:, 1:] != PAD).nonzero()[:, 0], picked.squeeze(-1))
    torch.testing.assert_close(with_adapters, sums, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(with_adapters, expected_base, atol=1e-3)  # the adapters did apply
    with HeadRows(policy) as seen:
        adapters_off = dpo.sequence_logprobs(dpo.AdaptersOff(policy), query_responses, response_labels, PAD)
    assert seen.rows == targets
    torch.testing.assert_close(adapters_off, expected_base, rtol=1e-5, atol=1e-4)


def test_no_hook_is_left_on_the_output_layer_after_a_forward_even_one_that_fails():
    model = lm()
    query_responses, response_labels = rows()
    dpo.sequence_logprobs(model, query_responses, response_labels, PAD)
    with pytest.raises(IndexError):  # a mask of the wrong shape fails inside the model ...
        dpo.forward(model, query_responses, PAD, torch.ones(2, 3, dtype=torch.bool))
    assert not model.get_output_embeddings()._forward_pre_hooks  # ... and leaves no hook behind
