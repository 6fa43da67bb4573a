"""Compute on real tokens: every script cuts the padding columns that all rows of a batch share before the model
reads it (`real_columns`, the same helper in every script). These tests run each script's own code on ragged
batches twice, once as it is, recording every cut it makes and requiring that at least one is narrower than its
input, and once with `real_columns` switched to the full width, and require the same numbers: losses and gradients
(or a whole update) to a relative 1e-5 and summed log-probs to an absolute 1e-4 (float32). reward.py's and
offline_rl.py's training passes run through the script's own loop: reward.py's main on the built-in task,
offline_rl.py's train_update."""

import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

from conftest import load_script, without_timing

sft, dpo, ppo, rloo = load_script("sft"), load_script("dpo"), load_script("ppo"), load_script("rloo")
ilql, offline_rl, reward, judge = (load_script("ilql"), load_script("offline_rl"), load_script("reward"),
                                   load_script("judge"))

PAD, EOS, VOCAB = 1, 2, 24
WQ, WR = 9, 8  # the data's fixed query and response widths (Detail 5)


def config() -> GPTNeoXConfig:
    return GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64, eos_token_id=EOS, bos_token_id=EOS, pad_token_id=PAD, num_labels=1,
        hidden_dropout=0.0, attention_dropout=0.0,
    )


def lm(seed: int = 0):
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(config()).eval()


def rm(seed: int = 0):
    torch.manual_seed(seed)
    return GPTNeoXForSequenceClassification(config()).eval()


def ragged_rows(query_lengths, response_lengths, seed: int = 0, eos: bool = True):
    """Left-padded queries (B, WQ) and right-padded responses (B, WR) ending in EOS; no row fills either width,
    so both sides have columns that are padding in every row."""
    g = torch.Generator().manual_seed(seed)
    queries = torch.full((len(query_lengths), WQ), PAD)
    responses = torch.full((len(query_lengths), WR), PAD)
    for i, (q, r) in enumerate(zip(query_lengths, response_lengths)):
        queries[i, WQ - q :] = torch.randint(3, VOCAB, (q,), generator=g)
        responses[i, :r] = torch.randint(3, VOCAB, (r,), generator=g)
        if eos:
            responses[i, r - 1] = EOS
    return queries, responses


def full_width(query_responses, pad_token_id):
    """The `real_columns` of a script with the trim switched off: every column."""
    return slice(0, query_responses.size(1))


def grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same(value_cut, value_full, grads_cut, grads_full):
    torch.testing.assert_close(value_cut, value_full, rtol=1e-5, atol=1e-7)
    assert grads_cut.keys() == grads_full.keys() and grads_full
    for name in grads_full:
        # an element far smaller than its tensor's largest is a sum of float32 terms that cancel: its rounding error
        # is relative to the tensor's scale, not to itself
        atol = max(1e-7, 1e-6 * grads_full[name].abs().max().item())
        torch.testing.assert_close(grads_cut[name], grads_full[name], rtol=1e-5, atol=atol, msg=name)


def record_cuts(patch, module) -> list:
    """Make `module`'s real_columns record (input width, the slice it returned, whether gradients are on) for every
    call; returns the record."""
    original, cuts = module.real_columns, []

    def recording(query_responses, pad_token_id):
        cols = original(query_responses, pad_token_id)
        cuts.append((query_responses.size(1), cols, torch.is_grad_enabled()))
        return cols

    patch.setattr(module, "real_columns", recording)
    return cuts


def assert_cut(cuts: list, training: bool = False) -> None:
    """The script's code called real_columns, and at least one call cut columns off: the trimmed pass did trim.
    training: among the calls made with gradients on (a training pass, not an evaluation under no_grad)."""
    cuts = [(width, cols) for width, cols, grad in cuts if grad or not training]
    assert cuts, "the script's code never called real_columns" + (" with gradients on" if training else "")
    assert any(cols.stop - cols.start < width for width, cols in cuts), f"no call cut a column: {cuts}"


def twice(monkeypatch, module, model, compute):
    """compute(model) with the script's trim (which must cut columns) and with real_columns switched to the full
    width; returns both results and both gradient sets."""
    out = []
    for trim in (True, False):
        model.zero_grad()
        with monkeypatch.context() as m:
            if trim:
                cuts = record_cuts(m, module)
            else:
                m.setattr(module, "real_columns", full_width)
            value = compute(model)
            value.sum().backward()
        if trim:
            assert_cut(cuts, training=True)
        out.append((value.detach(), grads(model)))
    return out


def test_real_columns_cuts_only_shared_padding():
    queries, responses = ragged_rows([3, 5, 2], [2, 6, 4])
    rows = torch.cat((queries, responses), 1)
    cols = sft.real_columns(rows, PAD)
    assert (cols.start, cols.stop) == (WQ - 5, WQ + 6)  # the longest query, the longest response
    assert torch.equal((rows != PAD).sum(), (rows[:, cols] != PAD).sum())  # no real token lost
    assert sft.real_columns(torch.full((2, 4), PAD), PAD) == slice(0, 4)


@pytest.mark.parametrize("mode", ["response", "sequence"])
def test_sft_loss_and_gradients_equal_with_and_without_the_trim(monkeypatch, mode):
    queries, responses = ragged_rows([3, 5, 2, 4], [2, 6, 4, 3])
    rows = torch.cat((queries, responses), 1)
    labels = rows.clone() if mode == "sequence" else torch.cat((torch.full_like(queries, PAD), responses), 1)
    labels = sft.sft_labels(labels, PAD)
    (cut, g_cut), (full, g_full) = twice(
        monkeypatch, sft, lm(), lambda model: sft.next_token_loss(model, rows, labels, PAD)[0]
    )
    assert_same(cut, full, g_cut, g_full)


def test_dpo_summed_logprobs_loss_and_gradients_equal_with_and_without_the_trim(monkeypatch):
    q, chosen = ragged_rows([3, 5, 2], [2, 6, 4], seed=1)
    _, rejected = ragged_rows([3, 5, 2], [5, 3, 2], seed=2)
    pad_query = torch.full_like(q, PAD)
    batch = {
        "query_chosen_token": torch.cat((q, chosen), 1), "query_rejected_token": torch.cat((q, rejected), 1),
        "query_chosen_token_response_label": torch.cat((pad_query, chosen), 1),
        "query_rejected_token_response_label": torch.cat((pad_query, rejected), 1),
    }
    model, ref = lm(0), lm(1)
    logps = {}
    for trim in (True, False):
        with monkeypatch.context() as m:
            if trim:
                cuts = record_cuts(m, dpo)
            else:
                m.setattr(dpo, "real_columns", full_width)
            logps[trim] = torch.stack(dpo.concatenated_logprobs(ref, batch, PAD)).detach()
        if trim:
            assert_cut(cuts)
    torch.testing.assert_close(logps[True], logps[False], rtol=0, atol=1e-4)
    ref_c, ref_r = logps[False]

    def loss(m):
        c, r = dpo.concatenated_logprobs(m, batch, PAD)
        return dpo.dpo_loss(c, r, ref_c, ref_r, 0.1, "sigmoid")[0].mean()

    (cut, g_cut), (full, g_full) = twice(monkeypatch, dpo, model, loss)
    assert_same(cut, full, g_cut, g_full)


@pytest.mark.parametrize("script", ["ppo", "rloo"])
def test_policy_training_pass_equal_with_and_without_the_trim(monkeypatch, script):
    """ppo.py / rloo.py: the micro batch keeps the columns from its longest query to its last EOS. The raw samples
    go on after the EOS (fixed-length generation, Detail 23) and those tokens stay in the full-width pass; the
    loss masks them, so both passes give the same loss and gradients."""
    module = {"ppo": ppo, "rloo": rloo}[script]
    queries, truncated = ragged_rows([3, 5, 2, 4], [2, 6, 4, 3], seed=3)
    g = torch.Generator().manual_seed(4)
    raw = torch.where(truncated == PAD, torch.randint(3, VOCAB, truncated.shape, generator=g), truncated)
    query_responses = torch.cat((queries, raw), 1)
    mask, _ = module.response_mask(truncated, PAD)
    torch.manual_seed(5)
    old_logprobs = -torch.rand(truncated.shape) * mask
    advantages = torch.randn(truncated.shape) * mask
    if script == "ppo":
        model = ppo.PolicyAndValue(lm(0), rm(1))
        values, returns = torch.randn(truncated.shape) * mask, torch.randn(truncated.shape) * mask
    else:
        model = rloo.Policy(lm(0), False)
        advantages = torch.randn(truncated.size(0))

    def loss(m):
        cut, ctx, width = module.trim_micro_batch(query_responses, truncated, WQ, PAD)
        if script == "ppo":
            new_logprobs, _, vpred, _ = ppo.training_logprobs_and_values(m, cut, ctx, 0.7, PAD)
            pg, vf, _ = ppo.ppo_losses(new_logprobs, old_logprobs[:, :width], advantages[:, :width], vpred,
                                       values[:, :width], returns[:, :width], mask[:, :width], 0.2, 0.2)
            return torch.stack([pg, vf])
        new_logprobs, _, _ = rloo.training_logprobs(m, cut, ctx, 0.7, PAD)
        return rloo.rloo_loss(new_logprobs, old_logprobs[:, :width], advantages, mask[:, :width], 0.2)[0]

    cut_q, _, width = module.trim_micro_batch(query_responses, truncated, WQ, PAD)
    assert cut_q.size(1) == 5 + 6 and width == 6  # the trim did cut: longest query 5, last EOS at column 6
    (cut, g_cut), (full, g_full) = twice(monkeypatch, module, model, loss)
    assert_same(cut, full, g_cut, g_full)


@pytest.mark.parametrize("script", ["ppo", "rloo", "ilql", "offline_rl"])
def test_reward_model_scores_equal_with_and_without_the_trim(monkeypatch, script):
    module = {"ppo": ppo, "rloo": rloo, "ilql": ilql, "offline_rl": offline_rl}[script]
    queries, responses = ragged_rows([3, 5, 2, 4], [2, 6, 4, 3], seed=6)
    model = rm(2)
    with torch.no_grad(), monkeypatch.context() as m:
        cuts = record_cuts(m, module)
        cut = module.get_score(model, queries, responses, PAD)
    assert_cut(cuts)
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(module, "real_columns", full_width)
        full = module.get_score(model, queries, responses, PAD)
    torch.testing.assert_close(cut, full, rtol=1e-5, atol=1e-6)


REWARD_FLAGS = ["--total_episodes", "32", "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-4",
                "--num_eval_samples", "8", "--num_normalization_samples", "8", "--eval_every", "0", "--log_every", "1",
                "--checkpoint_every", "0"]


def test_reward_training_loop_trains_alike_with_and_without_the_trim(monkeypatch, synthetic_task, tmp_path):
    """reward.py's own main on the built-in task (2 updates of 2 micro batches; chosen and rejected are one right-padded
    batch, context length 0), once as it is and once with real_columns at the full width: the same logged training
    metrics and the same saved reward model."""
    import json

    import tyro
    from safetensors.torch import load_file

    monkeypatch.setitem(sys.modules, "reward", reward)  # tyro reads the docstrings of nested dataclasses through it
    rows, weights = {}, {}
    for trim in (True, False):
        name = "trimmed" if trim else "full"
        flags = ["--sft_model_path", synthetic_task["base_model"], "--preference_dataset", synthetic_task["preference"],
                 "--query_dataset", synthetic_task["sft"], *REWARD_FLAGS, "--output_dir", str(tmp_path / name),
                 "--run_dir_root", str(tmp_path / "runs"), "--run_name", name]
        with monkeypatch.context() as m:
            if trim:
                cuts = record_cuts(m, reward)
            else:
                m.setattr(reward, "real_columns", full_width)
            reward.main(tyro.cli(reward.Args, args=flags))
        if trim:
            assert_cut(cuts, training=True)  # the training loop's own cut, not only the evaluation's
        rows[trim] = [without_timing(json.loads(line)) for line in open(tmp_path / "runs" / name / "metrics.jsonl")]
        weights[trim] = load_file(tmp_path / name / "model.safetensors")
    train = [[row for row in rows[trim] if "train/loss" in row] for trim in (True, False)]
    assert len(train[0]) == len(train[1]) == 2
    for cut, full in zip(*train):
        assert cut.keys() == full.keys()
        for key in (k for k in full if k.startswith("train/")):
            assert cut[key] == pytest.approx(full[key], rel=1e-5, abs=1e-6), (full["step"], key)
    assert weights[True].keys() == weights[False].keys()
    for name, tensor in weights[False].items():
        torch.testing.assert_close(weights[True][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_offline_rl_update_equal_with_and_without_the_trim(monkeypatch):
    """offline_rl.py's own update loop (train_update: micro batches of the update's rows, their weighted response
    loss, backward and the optimizer step) from the same model, trimmed and at the full width: the same loss and the
    same update of every weight (plain SGD, so the update is the gradient's image)."""
    from accelerate import Accelerator

    queries, responses = ragged_rows([3, 5, 2, 4], [2, 6, 4, 3], seed=9)
    args = offline_rl.Args(local_micro_batch_size=2, gradient_accumulation_steps=2)
    run = SimpleNamespace(guard=lambda update, **quantities: None)  # the non-finite guard: nothing is non-finite here
    global_batch, batch_weights = torch.tensor([2, 0, 3, 1]), torch.tensor([1.0, 0.5, 2.0, 0.25])
    start = {name: p.detach().clone() for name, p in lm(4).named_parameters()}
    results = []
    for trim in (True, False):
        model = lm(4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        with monkeypatch.context() as m:
            if trim:
                cuts = record_cuts(m, offline_rl)
            else:
                m.setattr(offline_rl, "real_columns", full_width)
            loss, _ = offline_rl.train_update(args, Accelerator(cpu=True), model, optimizer, run, 1, queries, responses,
                                              global_batch, batch_weights, PAD)
        if trim:
            assert_cut(cuts, training=True)
        results.append((torch.tensor(loss), {name: p.detach() - start[name] for name, p in model.named_parameters()}))
    (cut, update_cut), (full, update_full) = results
    assert any(u.abs().max() > 0 for u in update_full.values())  # the update moved the weights
    assert_same(cut, full, update_cut, update_full)


def test_ilql_loss_and_gradients_equal_with_and_without_the_trim(monkeypatch):
    """ilql.py's rows are right-padded trajectories (unpadded query, response, EOS, pads)."""
    query_lengths, response_lengths = torch.tensor([3, 5, 2]), torch.tensor([2, 4, 3])
    width = WQ + WR
    rows, labels = torch.full((3, width), PAD), torch.full((3, width), PAD)
    g = torch.Generator().manual_seed(10)
    for i, (q, r) in enumerate(zip(query_lengths.tolist(), response_lengths.tolist())):
        rows[i, : q + r] = torch.randint(3, VOCAB, (q + r,), generator=g)
        rows[i, q + r - 1] = EOS
        labels[i, q : q + r] = rows[i, q : q + r]
    torch.manual_seed(11)
    model = ilql.ILQLModel(lm(5), two_qs=True)
    hp = ilql.IlqlHParams()
    rewards = torch.tensor([0.5, -1.0, 2.0])

    def loss(m):
        cols = ilql.real_columns(rows, PAD)
        query_responses, cut_labels = rows[:, cols], labels[:, cols]
        positions, mask = ilql.action_positions(query_lengths, (cut_labels != PAD).sum(1), cut_labels.size(1))
        actions = cut_labels.gather(1, positions + 1).masked_fill(~mask, PAD)
        lm_logits, qs, target_qs, values = m(query_responses, PAD, positions)
        return ilql.ilql_loss(lm_logits, qs, target_qs, values, actions, ilql.terminal_rewards(rewards, mask), mask,
                              hp)[0]

    assert ilql.real_columns(rows, PAD) == slice(0, 9)  # the longest trajectory is 9 tokens of 17
    (cut, g_cut), (full, g_full) = twice(monkeypatch, ilql, model, loss)
    assert_same(cut, full, g_cut, g_full)


def test_judge_rm_scores_equal_with_and_without_the_trim():
    _, rows = ragged_rows([1, 1, 1], [5, 7, 3], seed=12)
    model = rm(4)
    with torch.no_grad():
        cut = judge.get_reward(model, rows[:, judge.real_columns(rows, PAD)], PAD, 0)[1]
        full = judge.get_reward(model, rows, PAD, 0)[1]
    torch.testing.assert_close(cut, full, rtol=1e-5, atol=1e-6)
