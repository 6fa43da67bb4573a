"""--query_once in the group methods (issue 65): rloo.py, grpo.py and reinforce_pp.py sample k responses to each
query, so their rollout scores each query once for all of its responses (the policy's and the reference's log-probs,
the reward models' scores: response_logits, get_reward_query_once) and their update's micro batches hold whole
groups (epoch_permutation), each query running once in the training pass too. online_dpo.py's reward model scores
its sampled pairs the same way. Each path must equal the whole rows' within 1e-5 and every parameter's gradient
within 1e-4 relative, on groups whose queries differ in length. The 2-process runs of every script
(tests/test_multiprocess.py) run with the flag on, its default. Dropout is off in these scripts (Detail 7); a LoRA
adapter changes nothing (it runs in both passes), tested below."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import load_script, tiny_causal_lm

PAD, EOS, VOCAB = 1, 2, 16
GROUP_SCRIPTS = {name: load_script(name) for name in ("rloo", "grpo", "reinforce_pp")}
SCORING_SCRIPTS = {**GROUP_SCRIPTS, "online_dpo": load_script("online_dpo")}
K, QUERY_WIDTH, RESPONSE_WIDTH = 3, 7, 6


def group_rows(generator: torch.Generator, queries: int = 4) -> tuple:
    """Rollout rows: `queries` LEFT-padded queries of lengths 3 .. QUERY_WIDTH, each K times in a row (a group), and
    RIGHT-padded responses of lengths 1 .. RESPONSE_WIDTH ending in EOS. Returns the queries (B, Tq), the responses
    (B, Tr) and the rows query + response (B, Tq + Tr)."""
    query_rows, response_rows = [], []
    for i in range(queries):
        n = 3 + i % (QUERY_WIDTH - 2)
        query = [PAD] * (QUERY_WIDTH - n) + torch.randint(3, VOCAB, (n,), generator=generator).tolist()
        for _ in range(K):
            m = int(torch.randint(1, RESPONSE_WIDTH + 1, (1,), generator=generator))
            response = torch.randint(3, VOCAB, (m - 1,), generator=generator).tolist() + [EOS]
            query_rows.append(query)
            response_rows.append(response + [PAD] * (RESPONSE_WIDTH - m))
    queries, responses = torch.tensor(query_rows), torch.tensor(response_rows)
    return queries, responses, torch.cat((queries, responses), 1)


def gradients(model) -> list:
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def assert_close_gradients(whole: list, once: list) -> None:
    assert len(whole) > 0
    for a, b in zip(whole, once):
        assert (a - b).norm() <= 1e-4 * a.norm() + 1e-12, float((a - b).norm() / a.norm())


def tiny_reward_model(seed: int = 5):
    from transformers import GPTNeoXConfig, GPTNeoXForSequenceClassification

    torch.manual_seed(seed)
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS,
                           num_labels=1, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTNeoXForSequenceClassification(config).eval()


@pytest.mark.parametrize("name", sorted(GROUP_SCRIPTS))
def test_training_pass_logprobs_and_gradients_equal_whole_rows(name):
    """The update's pass (Policy, through training_logprobs) on a micro batch of whole groups cut by
    trim_micro_batch, as the update runs it, with a loss that weighs every token differently."""
    script, model = GROUP_SCRIPTS[name], tiny_causal_lm(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS)
    _, responses, query_responses = group_rows(torch.Generator().manual_seed(0))
    cut, ctx, width = script.trim_micro_batch(query_responses, responses, QUERY_WIDTH, PAD)
    mask = responses[:, :width] != PAD
    weights = torch.linspace(0.5, 1.5, mask.numel()).view(mask.shape) * mask
    model.train()
    out = []
    for query_once in (False, True):
        model.zero_grad()
        logprobs, all_logprobs, _ = script.training_logprobs(script.Policy(model, query_once), cut, ctx, 0.7, PAD)
        assert all_logprobs.shape == (len(cut), width, VOCAB)
        logprobs = torch.where(mask, logprobs, 0.0)  # a [PAD] is no action: its log-prob is -inf
        (logprobs * weights).sum().backward()
        out.append((logprobs.detach(), gradients(model)))
    (whole, whole_grads), (once, once_grads) = out
    assert torch.allclose(whole, once, atol=1e-5, rtol=0), (whole - once).abs().max()
    assert_close_gradients(whole_grads, once_grads)


@pytest.mark.parametrize("name", sorted(GROUP_SCRIPTS))
def test_rollout_logits_of_the_policy_and_its_lora_reference_equal_whole_rows(name):
    """The rollout's scoring pass (response_logits) of a LoRA policy, and of its reference (reference_logits: the
    policy with its adapters off), each query once against whole rows."""
    script = GROUP_SCRIPTS[name]
    policy = get_peft_model(tiny_causal_lm(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS),
                            LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value", "embed_out"],
                                       init_lora_weights=False)).eval()
    _, _, query_responses = group_rows(torch.Generator().manual_seed(1))
    with torch.no_grad():
        for run in (lambda lm, q: script.response_logits(lm, query_responses, PAD, QUERY_WIDTH, q),
                    lambda lm, q: script.reference_logits(None, lm, lambda ref: script.response_logits(
                        ref, query_responses, PAD, QUERY_WIDTH, q))):
            whole, once = run(policy, False), run(policy, True)
            assert whole.shape == (len(query_responses), RESPONSE_WIDTH, VOCAB)
            assert torch.allclose(whole, once, atol=1e-5, rtol=0), (whole - once).abs().max()
        adapters_off = script.reference_logits(None, policy, lambda ref: script.response_logits(
            ref, query_responses, PAD, QUERY_WIDTH, True))
        assert not torch.allclose(adapters_off, script.response_logits(policy, query_responses, PAD, QUERY_WIDTH,
                                                                       True), atol=1e-3)  # the adapters do act


@pytest.mark.parametrize("name", sorted(SCORING_SCRIPTS))
def test_reward_model_scores_equal_whole_rows(name):
    """get_score with get_reward_query_once against get_reward, through the same column cut, and the index each
    reads (the last token before the response's first [PAD], Detail 12)."""
    script, model = SCORING_SCRIPTS[name], tiny_reward_model()
    queries, responses, query_responses = group_rows(torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = script.get_score(model, queries, responses, PAD)
        once = script.get_score(model, queries, responses, PAD, script.get_reward_query_once)
        assert torch.allclose(whole, once, atol=1e-5, rtol=0), (whole - once).abs().max()
        _, rewards, index = script.get_reward(model, query_responses, PAD, QUERY_WIDTH)
        _, rewards_once, index_once = script.get_reward_query_once(model, query_responses, PAD, QUERY_WIDTH)
    assert torch.equal(index, index_once)
    assert torch.allclose(rewards, rewards_once, atol=1e-5, rtol=0)
    assert len(set(whole.tolist())) > len(whole) // 2  # the scores do differ between rows


def test_each_distinct_query_runs_once_and_all_distinct_queries_run_whole_rows():
    """4 groups of K rows run 4 queries in the queries' pass, then 12 tails; a batch of distinct queries (k = 1, as
    reinforce_pp.py's batch baseline samples) runs once, as whole rows."""
    rloo, model = GROUP_SCRIPTS["rloo"], tiny_causal_lm(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS)
    _, _, query_responses = group_rows(torch.Generator().manual_seed(3))
    batches = []
    hook = model.gpt_neox.register_forward_pre_hook(lambda _, args, kwargs: batches.append(
        tuple((args[0] if args else kwargs["input_ids"]).shape)), with_kwargs=True)
    try:
        with torch.no_grad():
            rloo.response_logits(model, query_responses, PAD, QUERY_WIDTH, True)
            assert batches == [(4, QUERY_WIDTH - 1), (4 * K, RESPONSE_WIDTH + 1)]
            batches.clear()
            distinct = query_responses[::K]
            once = rloo.response_logits(model, distinct, PAD, QUERY_WIDTH, True)
            assert batches == [(4, QUERY_WIDTH + RESPONSE_WIDTH)]
            assert torch.equal(once, rloo.response_logits(model, distinct, PAD, QUERY_WIDTH, False))
    finally:
        hook.remove()


@pytest.mark.parametrize("name", sorted(GROUP_SCRIPTS))
def test_epoch_permutation_keeps_groups_whole(name):
    script = GROUP_SCRIPTS[name]
    torch.manual_seed(0)
    order = script.epoch_permutation(24, 4, True, "cpu")
    assert sorted(order.tolist()) == list(range(24))  # a permutation of the rows
    groups = order.view(-1, 4)
    assert torch.equal(groups // 4, groups[:, :1].expand(-1, 4) // 4)  # each aligned run of 4: one group
    assert torch.equal(groups % 4, torch.arange(4).expand(6, -1))  # in its own order
    assert len({tuple(script.epoch_permutation(24, 4, True, "cpu").tolist()) for _ in range(5)}) > 1  # random
    torch.manual_seed(1)
    rows = script.epoch_permutation(24, 1, True, "cpu")  # groups of one: the row permutation itself
    torch.manual_seed(1)
    assert torch.equal(rows, torch.randperm(24))
    torch.manual_seed(1)
    assert torch.equal(script.epoch_permutation(24, 4, False, "cpu"), rows)  # off: the rows, as before
