"""Tests of ilql.py: every loss term against a hand computation on a tiny batch, the Polyak sync of the
target heads (exactly alpha per sync, only on sync updates), the state/action indexing, the rewards,
beta = 0 sampling against the LM's own `generate`, a subprocess smoke run on the built-in task, and the
reliability checks (SIGKILL + --resume gives the uninterrupted result, the non-finite guard, and resuming from its
fallback checkpoint equals resuming from the ordinary one)."""

import json
import math
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import GenerationConfig, GPTNeoXConfig, GPTNeoXForCausalLM

from conftest import (
    assert_last_good_checkpoint,
    assert_same_checkpoint,
    assert_same_safetensors,
    kill_after_checkpoint,
    load_script,
    run_ok,
    with_nan_at,
    without_timing,
)
from rlhf_utils import checks  # noqa: E402  (the input checks the scripts import)
from rlhf_utils import flags as flags_module  # noqa: E402  (the scripts' refusals of flags)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_COLUMNS = ["query", "response", "reference", "score", "response_token_len", "has_eos"]
PAD, EOS = 1, 2




ilql = load_script("ilql")


def tiny_lm(seed: int = 0, vocab_size: int = 40) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, eos_token_id=EOS, bos_token_id=EOS, pad_token_id=PAD,
    )
    return GPTNeoXForCausalLM(config).eval()


# ------------------------------------------------------------------------------------------------
# A tiny batch: B = 2 trajectories, T = 3 action slots, V = 3 actions. Row 0 has 3 actions (the last is
# the EOS, terminal), row 1 has 2 actions and one padded slot.
# ------------------------------------------------------------------------------------------------
ACTIONS = [[0, 2, 1], [1, 0, 0]]
MASK = [[1, 1, 1], [1, 1, 0]]
REWARDS = [[0.0, 0.0, 1.5], [0.0, -0.5, 0.0]]  # the sequence reward on the last action
VALUES = [[0.2, -0.1, 0.4], [0.3, 0.6, -2.0]]
Q1 = [[[0.5, 0.1, -0.2], [0.0, 0.3, 0.7], [1.0, 0.2, -0.4]],
      [[0.1, 0.8, 0.0], [-0.3, 0.2, 0.5], [9.0, 9.0, 9.0]]]
Q2 = [[[0.4, 0.0, 0.1], [0.2, -0.1, 0.9], [0.6, 0.5, 0.3]],
      [[0.0, 0.5, 0.2], [0.1, 0.0, -0.2], [9.0, 9.0, 9.0]]]
TQ1 = [[[0.3, 0.1, 0.0], [0.1, 0.2, 0.5], [0.9, 0.1, 0.2]],
       [[0.2, 0.9, 0.1], [0.4, 0.3, 0.2], [5.0, 5.0, 5.0]]]
TQ2 = [[[0.6, 0.2, 0.3], [0.0, 0.4, 0.3], [0.8, 0.3, 0.1]],
       [[0.1, 0.7, 0.4], [0.5, 0.1, 0.0], [5.0, 5.0, 5.0]]]
LM = [[[1.0, 0.0, -1.0], [0.5, 0.5, 2.0], [0.0, 1.0, 0.0]],
      [[0.2, 0.4, 0.6], [1.5, -0.5, 0.0], [3.0, 3.0, 3.0]]]
N_ACTIONS = 5


def hand_hp(**kw):
    defaults = dict(tau=0.7, gamma=0.9, cql_scale=0.1, awac_scale=1.0, awac_beta=0.0, alpha=0.001,
                    steps_for_target_q_sync=5, two_qs=True)
    defaults.update(kw)
    return ilql.IlqlHParams(**defaults)


def run_loss(hp):
    t = torch.tensor
    return ilql.ilql_loss(
        t(LM), (t(Q1), t(Q2)), (t(TQ1), t(TQ2)), t(VALUES), t(ACTIONS), t(REWARDS), t(MASK).bool(), hp
    )


def real_steps():
    return [(b, s) for b in range(2) for s in range(3) if MASK[b][s]]


def hand_target_q(b, s):
    a = ACTIONS[b][s]
    return min(TQ1[b][s][a], TQ2[b][s][a])


def neg_log_softmax(row, a):
    return math.log(sum(math.exp(x) for x in row)) - row[a]


def test_q_loss_by_hand():
    hp = hand_hp()
    _, stats = run_loss(hp)
    total = 0.0
    for q in (Q1, Q2):
        for b, s in real_steps():
            # the next state's value only while the episode goes on (the slot after is a real action)
            next_value = VALUES[b][s + 1] if s + 1 < 3 and MASK[b][s + 1] else 0.0
            target = REWARDS[b][s] + hp.gamma * next_value
            total += (q[b][s][ACTIONS[b][s]] - target) ** 2
    # e.g. row 0 step 2 is the EOS: target = 1.5 (no bootstrap); row 0 step 0: target = 0 + 0.9 * -0.1
    assert stats["loss_q"].item() == pytest.approx(total / N_ACTIONS, rel=1e-6)


def test_v_loss_is_the_tau_expectile_of_the_min_target_q():
    hp = hand_hp(tau=0.7)
    _, stats = run_loss(hp)
    total = 0.0
    for b, s in real_steps():
        u = hand_target_q(b, s) - VALUES[b][s]
        total += (0.7 if u >= 0 else 0.3) * u**2
    assert stats["loss_v"].item() == pytest.approx(total / N_ACTIONS, rel=1e-6)
    # tau 0.5 is half the squared error; the masked slot (row 1 step 2, target 5 vs V -2) never counts
    _, half = run_loss(hand_hp(tau=0.5))
    plain = sum((hand_target_q(b, s) - VALUES[b][s]) ** 2 for b, s in real_steps()) / N_ACTIONS
    assert half["loss_v"].item() == pytest.approx(0.5 * plain, rel=1e-6)


def test_cql_loss_is_cross_entropy_of_q_over_actions():
    _, stats = run_loss(hand_hp())
    total = sum(neg_log_softmax(q[b][s], ACTIONS[b][s]) for q in (Q1, Q2) for b, s in real_steps())
    assert stats["loss_cql"].item() == pytest.approx(total / N_ACTIONS, rel=1e-6)


def test_awac_loss_by_hand():
    # trlX's default (awac_beta 0): every weight is 1, plain next-token cross-entropy of the LM head
    _, stats = run_loss(hand_hp(awac_beta=0.0))
    plain = sum(neg_log_softmax(LM[b][s], ACTIONS[b][s]) for b, s in real_steps()) / N_ACTIONS
    assert stats["loss_awac"].item() == pytest.approx(plain, rel=1e-6)
    assert stats["awac_weight"].item() == pytest.approx(1.0)
    # awac_beta 2: weight exp(2 * (min target-Q - V)) per action
    _, weighted = run_loss(hand_hp(awac_beta=2.0))
    total = sum(
        math.exp(2.0 * (hand_target_q(b, s) - VALUES[b][s])) * neg_log_softmax(LM[b][s], ACTIONS[b][s])
        for b, s in real_steps()
    )
    assert weighted["loss_awac"].item() == pytest.approx(total / N_ACTIONS, rel=1e-6)


def test_total_loss_combines_the_terms_with_their_scales():
    loss, stats = run_loss(hand_hp(cql_scale=0.25, awac_scale=3.0))
    expected = stats["loss_q"] + stats["loss_v"] + 0.25 * stats["loss_cql"] + 3.0 * stats["loss_awac"]
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_loss_gradients_reach_only_what_each_term_trains():
    t = torch.tensor
    q1, q2 = t(Q1, requires_grad=True), t(Q2, requires_grad=True)
    tq1, tq2 = t(TQ1, requires_grad=True), t(TQ2, requires_grad=True)
    values, lm = t(VALUES, requires_grad=True), t(LM, requires_grad=True)
    loss, _ = ilql.ilql_loss(lm, (q1, q2), (tq1, tq2), values, t(ACTIONS), t(REWARDS), t(MASK).bool(), hand_hp())
    loss.backward()
    assert tq1.grad is None and tq2.grad is None  # the targets are never trained
    assert q1.grad.abs().sum() > 0 and values.grad.abs().sum() > 0 and lm.grad.abs().sum() > 0
    # the padded slot gets no gradient anywhere
    assert q1.grad[1, 2].abs().sum() == 0 and values.grad[1, 2] == 0 and lm.grad[1, 2].abs().sum() == 0


def test_single_q_uses_its_own_target():
    t = torch.tensor
    _, two = run_loss(hand_hp())
    _, one = ilql.ilql_loss(t(LM), (t(Q1),), (t(TQ1),), t(VALUES), t(ACTIONS), t(REWARDS), t(MASK).bool(), hand_hp())
    expected = sum(neg_log_softmax(Q1[b][s], ACTIONS[b][s]) for b, s in real_steps()) / N_ACTIONS
    assert one["loss_cql"].item() == pytest.approx(expected, rel=1e-6)
    assert one["target_qvalues"].item() != pytest.approx(two["target_qvalues"].item())


# ------------------------------------------------------------------------------------------------
# rewards and indexing
# ------------------------------------------------------------------------------------------------
def test_label_rewards_are_plus_minus_one_and_normalised_over_the_dataset():
    labels = ilql.label_rewards(3)
    assert labels.tolist() == [1, 1, 1, -1, -1, -1]
    normalised = ilql.normalize_rewards(labels)
    assert normalised.mean().item() == pytest.approx(0.0, abs=1e-7)
    assert normalised.std().item() == pytest.approx(1.0, rel=1e-6)
    raw = torch.tensor([2.0, 4.0, 6.0, 0.0])
    std = math.sqrt(sum((x - 3.0) ** 2 for x in raw.tolist()) / 3)  # torch.std is the unbiased estimate
    assert ilql.normalize_rewards(raw).tolist() == pytest.approx([(x - 3.0) / std for x in raw.tolist()], rel=1e-6)


def test_terminal_reward_sits_on_the_last_action():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]).bool()
    rewards = ilql.terminal_rewards(torch.tensor([0.5, -1.0, 2.0]), mask)
    assert rewards.tolist() == [[0, 0, 0.5, 0], [-1.0, 0, 0, 0], [0, 0, 0, 2.0]]


def test_flatten_pairs_orders_chosen_then_rejected():
    raw = Dataset.from_dict({
        "query_chosen_token": [[5, 10, PAD], [6, 11, PAD]], "query_rejected_token": [[5, 12, 13], [6, 14, PAD]],
        "query_chosen_token_response_label": [[PAD, 10, PAD], [PAD, 11, PAD]],
        "query_rejected_token_response_label": [[PAD, 12, 13], [PAD, 14, PAD]],
        "query_token_len": [1, 1], "query": ["a", "b"],
    })
    flat = ilql.flatten_pairs(raw)
    assert flat["query_response"] == [[5, 10, PAD], [6, 11, PAD], [5, 12, 13], [6, 14, PAD]]
    assert flat["response_label"][2] == [PAD, 12, 13]
    assert sorted(flat.column_names) == sorted(ilql.TRAJECTORY_COLUMNS)


def test_model_reads_heads_and_lm_at_the_action_states():
    lm = tiny_lm()
    model = ilql.ILQLModel(lm, two_qs=True).eval()
    # two right-padded rows: query lengths 3 and 2, responses [8, 9, EOS] and [7, EOS]
    rows = [[5, 6, 7, 8, 9, EOS, PAD], [4, 6, 7, EOS, PAD, PAD, PAD]]
    labels = [[PAD, PAD, PAD, 8, 9, EOS, PAD], [PAD, PAD, 7, EOS, PAD, PAD, PAD]]
    tokens, labels = torch.tensor(rows), torch.tensor(labels)
    query_len = torch.tensor([3, 2])
    positions, mask = ilql.action_positions(query_len, (labels != PAD).sum(1), tokens.size(1))
    assert positions.tolist() == [[2, 3, 4], [1, 2, 3]] and mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    actions = labels.gather(1, positions + 1).masked_fill(~mask, PAD)
    assert actions.tolist() == [[8, 9, EOS], [7, EOS, PAD]]
    # a long query next to a long response: positions past the end are clamped into the row and masked
    clamped, clamped_mask = ilql.action_positions(torch.tensor([5, 1]), torch.tensor([2, 5]), 7)
    assert clamped.tolist() == [[4, 5, 5, 5, 5], [0, 1, 2, 3, 4]]
    assert clamped_mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    with torch.no_grad():
        lm_logits, qs, target_qs, values = model(tokens, PAD, positions)
        full = lm(torch.tensor([rows[0][:6]])).logits[0]  # unpadded row 0
        hidden = lm.gpt_neox(torch.tensor([rows[0][:6]])).last_hidden_state[0]
    assert lm_logits.shape == (2, 3, 40) and values.shape == (2, 3) and len(qs) == len(target_qs) == 2
    # state s_t of row 0 is position 2 + t: the LM logits there predict the response tokens
    assert torch.allclose(lm_logits[0, :3], full[2:5], atol=1e-5)
    assert torch.allclose(qs[1][0, 1], model.heads.q_heads[1](hidden[3]), atol=1e-5)
    assert torch.allclose(values[0, 2], model.heads.v_head(hidden[4]).squeeze(-1), atol=1e-5)


# ------------------------------------------------------------------------------------------------
# target heads
# ------------------------------------------------------------------------------------------------
def test_target_heads_move_towards_online_by_exactly_alpha_per_sync():
    torch.manual_seed(0)
    heads = ilql.ILQLHeads(hidden_size=4, vocab_size=6, two_qs=True)
    assert len(heads.q_heads) == len(heads.target_q_heads) == 2
    for head, target in zip(heads.q_heads, heads.target_q_heads):  # targets start as copies, frozen
        for p, tp in zip(head.parameters(), target.parameters()):
            assert torch.equal(p, tp) and not tp.requires_grad and p.requires_grad
    with torch.no_grad():  # pretend the online heads were trained
        for p in heads.q_heads.parameters():
            p.add_(torch.randn_like(p))
    online = [p.detach().clone() for p in heads.q_heads.parameters()]
    before = [p.detach().clone() for p in heads.target_q_heads.parameters()]
    heads.sync_target_q_heads(0.25)
    after = [p.detach().clone() for p in heads.target_q_heads.parameters()]
    for o, b, a in zip(online, before, after):
        assert torch.allclose(a - b, 0.25 * (o - b), atol=1e-6)  # a step of exactly alpha of the gap
    for o, p in zip(online, heads.q_heads.parameters()):
        assert torch.equal(o, p)  # the online heads are untouched
    # a second sync closes the gap again by alpha: remaining gap (1 - alpha)^2 of the original
    heads.sync_target_q_heads(0.25)
    for o, b, p in zip(online, before, heads.target_q_heads.parameters()):
        assert torch.allclose(o - p, 0.75**2 * (o - b), atol=1e-6)
    # alpha 0 leaves the targets as they are, alpha 1 copies the online heads
    heads.sync_target_q_heads(1.0)
    for o, p in zip(online, heads.target_q_heads.parameters()):
        assert torch.allclose(o, p)


def test_bf16_targets_still_move_by_alpha():
    torch.manual_seed(0)
    heads = ilql.ILQLHeads(hidden_size=4, vocab_size=6, two_qs=False).to(torch.bfloat16)
    with torch.no_grad():
        for p in heads.q_heads.parameters():
            p.add_(1.0)  # a gap of exactly 1 everywhere
    start = [p.detach().float().clone() for p in heads.target_q_heads.parameters()]
    for _ in range(100):
        heads.sync_target_q_heads(0.001)
    # 100 syncs close 1 - 0.999^100 = 9.5% of the gap; bf16 arithmetic alone would round every step away
    moved = 1 - 0.999**100
    for s, p in zip(start, heads.target_q_heads.parameters()):
        assert p.dtype == torch.bfloat16
        assert torch.allclose(p.float() - s, torch.full_like(s, moved), atol=0.02)


def test_target_sync_happens_on_optimizer_updates_only():
    assert [u for u in range(1, 13) if ilql.should_sync_target(u, 5)] == [5, 10]
    assert [u for u in range(1, 4) if ilql.should_sync_target(u, 1)] == [1, 2, 3]


# ------------------------------------------------------------------------------------------------
# sampling
# ------------------------------------------------------------------------------------------------
LEFT_PADDED_QUERIES = torch.tensor([[PAD, PAD, 5, 6, 7], [3, 4, 5, 6, 7], [PAD, 9, 10, 11, 12]])


def test_beta_zero_sampling_equals_sampling_from_the_lm_head_alone():
    lm = tiny_lm(seed=1)
    model = ilql.ILQLModel(lm, two_qs=True).eval()
    with torch.no_grad():  # non-trivial advantages, so beta 0 must really switch them off
        for p in model.heads.parameters():
            p.mul_(5.0)
    length, temperature, top_k = 12, 0.8, 20
    torch.manual_seed(123)
    ours = ilql.ilql_generate(model, LEFT_PADDED_QUERIES, PAD, EOS, length, 0.0, temperature, top_k)
    # the LM alone through transformers' own sampler: same warpers, EOS does not stop, [PAD] suppressed
    config = GenerationConfig(max_new_tokens=length, do_sample=True, temperature=temperature, top_k=top_k,
                              top_p=1.0, eos_token_id=[], pad_token_id=PAD, suppress_tokens=[PAD])
    torch.manual_seed(123)
    mask = LEFT_PADDED_QUERIES != PAD
    reference = lm.generate(input_ids=LEFT_PADDED_QUERIES.masked_fill(~mask, 0), attention_mask=mask,
                            generation_config=config)
    context = LEFT_PADDED_QUERIES.size(1)
    assert ours.shape == (3, context + length)
    assert torch.equal(ours[:, :context], LEFT_PADDED_QUERIES)
    ours_kept = ilql.truncate_response(EOS, PAD, ours[:, context:])
    reference_kept = ilql.truncate_response(EOS, PAD, reference[:, context:])
    assert torch.equal(ours_kept, reference_kept)
    # a large beta changes the samples (same seed): the heads really enter the policy
    torch.manual_seed(123)
    shifted = ilql.ilql_generate(model, LEFT_PADDED_QUERIES, PAD, EOS, length, 50.0, temperature, top_k)
    assert not torch.equal(ilql.truncate_response(EOS, PAD, shifted[:, context:]), ours_kept)


def test_advantage_shifted_scores_by_hand():
    lm_logits = torch.tensor([[1.0, 2.0, 0.5, 0.0]])
    tq = (torch.tensor([[0.0, 1.0, 3.0, 0.2]]), torch.tensor([[0.5, 0.5, 2.0, 0.1]]))
    value = torch.tensor([0.5])
    scores = ilql.advantage_shifted_scores(lm_logits, tq, value, beta=2.0, top_k=2, pad_token_id=3)
    log_z = math.log(sum(math.exp(x) for x in [1.0, 2.0, 0.5, 0.0]))
    # min target-Q - V = [-0.5, 0, 1.5, -0.4]; the pad (index 3) is removed; top 2 of the rest survive
    full = [1.0 - log_z + 2 * -0.5, 2.0 - log_z + 0.0, 0.5 - log_z + 2 * 1.5]
    assert scores[0, 1].item() == pytest.approx(full[1], rel=1e-6)
    assert scores[0, 2].item() == pytest.approx(full[2], rel=1e-6)
    assert scores[0, 0].item() == float("-inf") and scores[0, 3].item() == float("-inf")


def test_sampling_keeps_the_fixed_length_and_pads_after_an_early_eos():
    lm = tiny_lm(seed=2)
    model = ilql.ILQLModel(lm, two_qs=False).eval()
    context = LEFT_PADDED_QUERIES.size(1)
    torch.manual_seed(0)
    out = ilql.ilql_generate(model, LEFT_PADDED_QUERIES, PAD, EOS, 30, 0.0, 1.0, 0)
    assert out.shape == (3, context + 30) and not (out[:, context:] == PAD).any()  # [PAD] is never sampled
    with torch.no_grad():  # a target-Q head that makes EOS (almost) certain at beta 1
        last = model.heads.target_q_heads[0][2]
        last.weight.zero_()
        last.bias.zero_()
        last.bias[EOS] = 100.0
    out = ilql.ilql_generate(model, LEFT_PADDED_QUERIES, PAD, EOS, 30, 1.0, 1.0, 0)
    assert out.shape == (3, context + 30)  # the loop stops once every row has its EOS, the shape stays fixed
    assert (out[:, context] == EOS).all() and (out[:, context + 1:] == PAD).all()


# ------------------------------------------------------------------------------------------------
# smoke run
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_smoke_run_on_the_builtin_task(synthetic_task, tmp_path):
    run_name = "ilql_smoke"
    output_dir = tmp_path / "model"
    task = synthetic_task["task"]
    cmd = [
        sys.executable, os.path.join(REPO_ROOT, "ilql.py"),
        "--init_from", "base", "--model_path", synthetic_task["base_model"],
        # the base model with a fresh scalar head stands in for an RM: it exercises the RM-labelled path
        "--reward_source", "rm", "--reward_model_path", synthetic_task["base_model"],
        "--preference_dataset", synthetic_task["preference"], "--query_dataset", synthetic_task["sft"],
        "--output_dir", str(output_dir), "--run_dir_root", str(tmp_path / "runs"), "--run_name", run_name,
        "--total_episodes", "48", "--total_batch_size", "8", "--local_micro_batch_size", "4",
        "--ilql.steps_for_target_q_sync", "2", "--num_eval_samples", "6", "--local_eval_batch_size", "3",
        "--response_length", str(task["sft_response_length"]), "--eval_every", "3", "--log_every", "2",
        "--eval_betas", "0", "1", "4", "--beta", "1",
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / run_name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_updates"] == 6
    assert summary["budget/updates"] == 6 and summary["budget/rows_read"] == 48  # the budget as spent
    # synced on optimizer updates 2, 4, 6 (a once-per-epoch sync would give 0 here: 48 of 512 trajectories)
    assert summary["num_target_syncs"] == 3
    assert summary["wall_time_s"] > 0 and math.isfinite(summary["train/loss"])
    # RM rewards (not the +-1 labels: some pairs out of order) z-normalised over the dataset: with as many chosen as
    # rejected rows, the two sides' means sum to 0, which the raw RM scores' do not
    assert summary["data/pair_order_agreement"] < 1
    assert summary["data/reward_chosen_mean"] + summary["data/reward_rejected_mean"] == pytest.approx(0.0, abs=1e-5)
    assert abs(summary["data/raw_reward_mean"]) > 1e-4
    for beta in ("0", "1", "4"):
        table = pd.read_csv(run_dir / f"samples_beta{beta}.csv")
        assert list(table.columns) == SAMPLE_COLUMNS and len(table) == 6
        assert table["score"].notna().all()
        assert (table["response_token_len"] <= task["sft_response_length"]).all()
        assert f"eval/beta_{beta}/eos_rate" in summary
    final = pd.read_csv(run_dir / "samples.csv")
    assert final.equals(pd.read_csv(run_dir / "samples_beta1.csv"))
    assert (run_dir / "samples" / "step_000003.csv").exists() and (run_dir / "samples" / "step_000006.csv").exists()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss_cql" in line for line in lines) and all("step" in line for line in lines)
    train = [line for line in lines if "train/loss" in line]
    assert train and all(0 < line["time/update_s"] < summary["wall_time_s"] for line in train)  # issue 51
    # the LM and the heads are saved next to each other
    assert (output_dir / "model.safetensors").exists() and (output_dir / "tokenizer.json").exists()
    heads = load_file(str(output_dir / "ilql_heads.safetensors"))
    assert {"v_head.0.weight", "q_heads.1.2.weight", "target_q_heads.1.2.weight"} <= set(heads)
    assert heads["v_head.0.weight"].shape[0] == 2 * heads["v_head.0.weight"].shape[1]  # width 2 x hidden
    # the online Q heads were trained, the targets trail them (3 syncs of alpha 0.001)
    assert not torch.equal(heads["q_heads.0.2.weight"], heads["target_q_heads.0.2.weight"])
    args = json.loads((run_dir / "args.json").read_text())
    assert args["model_path"] == synthetic_task["base_model"] and args["ilql"]["tau"] == 0.7


# ------------------------------------------------------------------------------------------------
# checkpoints: SIGKILL mid-run, --resume, and the same result as a run that was never interrupted
# ------------------------------------------------------------------------------------------------
def small_preference_task(synthetic_task, root) -> str:
    """16 preference pairs = 32 trajectories = 4 updates of 8 per pass, so a short run crosses passes (epochs)."""
    from datasets import DatasetDict, load_from_disk

    full = load_from_disk(synthetic_task["preference"])
    path = str(root / "preference16")
    DatasetDict({"train": full["train"].select(range(16))}).save_to_disk(path)
    return path


def resumable_ilql_command(synthetic_task, preference, root, run_name, *extra):
    return [
        sys.executable, os.path.join(REPO_ROOT, "ilql.py"),
        "--init_from", "base", "--model_path", synthetic_task["base_model"],
        "--preference_dataset", preference, "--query_dataset", synthetic_task["sft"],
        "--output_dir", str(root / f"model_{run_name}"), "--run_dir_root", str(root / "runs"), "--run_name", run_name,
        # 12 updates over 3 passes; logging (3), target syncs (3) and evaluations (3) do not line up with the
        # checkpoint (5), so the resumed run must restore a half-filled logging interval and the mid-pass data position
        "--total_episodes", "96", "--total_batch_size", "8", "--local_micro_batch_size", "4",
        "--ilql.steps_for_target_q_sync", "3", "--log_every", "3", "--eval_every", "3", "--checkpoint_every", "5",
        "--num_eval_samples", "6", "--local_eval_batch_size", "3", "--eval_betas", "0", "4", "--beta", "1",
        "--response_length", str(synthetic_task["task"]["sft_response_length"]), *extra,
    ]


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(synthetic_task, tmp_path):
    preference = small_preference_task(synthetic_task, tmp_path)
    runs = tmp_path / "runs"

    # the interrupted run: killed as soon as its update-5 checkpoint exists (7 updates and 4 evaluations remain)
    checkpoint = runs / "killed" / "checkpoints" / "update_000005"
    kill_after_checkpoint(resumable_ilql_command(synthetic_task, preference, tmp_path, "killed"), checkpoint,
                          cwd=REPO_ROOT)  # really killed mid-way, not finished
    assert checkpoint.is_dir() and not (runs / "killed" / "summary.json").exists()
    # the checkpoint holds the LM and every head, the target-Q heads included, and the sync counter
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert any(k.startswith("lm.") for k in saved)
    assert {"heads.v_head.0.weight", "heads.q_heads.1.2.weight", "heads.target_q_heads.1.2.weight"} <= set(saved)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["update"] == 5 and state["num_target_syncs"] == 1 and state["steps_for_target_q_sync"] == 3
    assert len(state["interval_stats"]["train/loss"]) == 2  # updates 4 and 5 of the logging interval 4-6

    resumed = run_ok(resumable_ilql_command(synthetic_task, preference, tmp_path, "killed", "--resume"), cwd=REPO_ROOT)
    assert "resumed from" in resumed.stdout and "update_000005" in resumed.stdout
    run_ok(resumable_ilql_command(synthetic_task, preference, tmp_path, "full"), cwd=REPO_ROOT)

    # the same final weights, bit for bit: the LM, and the V, Q and target-Q heads
    for name in ("model.safetensors", "ilql_heads.safetensors"):
        assert_same_safetensors(tmp_path / "model_full" / name, tmp_path / "model_killed" / name)
    # the same metrics, line by line (each logged once: the lines the killed run wrote after update 5 are gone)
    lines = {run: [without_timing(json.loads(line)) for line in (runs / run / "metrics.jsonl").read_text().splitlines()]
             for run in ("full", "killed")}
    assert lines["killed"] == lines["full"]
    assert [line["step"] for line in lines["full"] if "train/loss" in line] == [3, 6, 9, 12]
    summaries = {run: without_timing(json.loads((runs / run / "summary.json").read_text()))
                 for run in ("full", "killed")}
    assert summaries["killed"] == summaries["full"]
    assert summaries["full"]["num_target_syncs"] == 4 and summaries["full"]["num_updates"] == 12
    for name in ("samples.csv", "samples_beta4.csv"):
        assert pd.read_csv(runs / "killed" / name).equals(pd.read_csv(runs / "full" / name))


def test_non_finite_loss_stops_with_the_last_good_checkpoint_and_no_model(synthetic_task, tmp_path):
    preference = small_preference_task(synthetic_task, tmp_path)
    # lr 1e30: update 1 is finite, its step throws the weights to inf, so update 2's loss is not finite
    result = subprocess.run(resumable_ilql_command(synthetic_task, preference, tmp_path, "poisoned", "--lr", "1e30",
                                                   "--eval_every", "0"),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "ilql.py: error: update 2: train/loss" in result.stderr and "Traceback" not in result.stderr
    # the last good update, nothing after it
    assert_last_good_checkpoint(tmp_path / "runs" / "poisoned" / "checkpoints", 1)
    assert not (tmp_path / "model_poisoned" / "model.safetensors").exists()
    assert not (tmp_path / "model_poisoned" / "ilql_heads.safetensors").exists()


@pytest.mark.slow
def test_resuming_from_the_non_finite_fallback_equals_resuming_from_the_ordinary_checkpoint(synthetic_task, tmp_path):
    """A NaN in the loss of the second micro batch of update 5 (the first update of the second pass; its first micro
    batch has already gone backward): the run stops and saves the state after update 4 as its checkpoint, the same as
    the ordinary checkpoint of update 4 of the same run without the NaN. Resumed from either, the run ends with the
    same weights and metrics."""
    preference = small_preference_task(synthetic_task, tmp_path)
    runs = tmp_path / "runs"
    # 6 updates, a checkpoint after each (all kept)
    flags = ["--total_episodes", "48", "--checkpoint_every", "1", "--checkpoint_keep", "0"]
    poisoned = subprocess.run(with_nan_at(resumable_ilql_command(synthetic_task, preference, tmp_path, "poisoned",
                                                                 *flags),
                                          update=5, call=2), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert poisoned.returncode != 0 and "ilql.py: error: update 5: train/loss" in poisoned.stderr
    assert sorted(os.listdir(runs / "poisoned" / "checkpoints")) == [f"update_{u:06d}" for u in range(1, 5)]
    run_ok(resumable_ilql_command(synthetic_task, preference, tmp_path, "ordinary", *flags), cwd=REPO_ROOT)
    assert_same_checkpoint(runs / "ordinary" / "checkpoints" / "update_000004",
                           runs / "poisoned" / "checkpoints" / "update_000004")

    # both resumed from update 4: the ordinary run without its newer checkpoint
    shutil.rmtree(runs / "ordinary" / "checkpoints" / "update_000005")
    for run in ("poisoned", "ordinary"):
        resumed = run_ok(resumable_ilql_command(synthetic_task, preference, tmp_path, run, *flags, "--resume"),
                         cwd=REPO_ROOT)
        assert "update_000004" in resumed.stdout
    for name in ("model.safetensors", "ilql_heads.safetensors"):
        assert_same_safetensors(tmp_path / "model_ordinary" / name, tmp_path / "model_poisoned" / name)
    lines = {run: [without_timing(json.loads(line)) for line in (runs / run / "metrics.jsonl").read_text().splitlines()]
             for run in ("ordinary", "poisoned")}
    assert lines["poisoned"] == lines["ordinary"]


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------
def test_a_response_that_does_not_start_at_query_token_len_is_one_clear_error(synthetic_task, tmp_path):
    """action_positions takes each response's start from query_token_len, the loss its tokens from the label column:
    a row where the two disagree stops the run before anything is written, naming the row, the side and the fix."""
    from datasets import DatasetDict, load_from_disk
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(synthetic_task["base_model"]).pad_token_id
    pairs = load_from_disk(synthetic_task["preference"])["train"].select(range(16))
    checks.check_response_starts(pairs, pad, "pairs")  # the prepared data agrees

    # row 11's query_token_len one too large: the response's first token would be read as part of the query
    shifted = pairs.map(lambda row, i: {"query_token_len": row["query_token_len"] + (i == 11)}, with_indices=True)
    query_length = pairs[11]["query_token_len"]
    with pytest.raises(ValueError, match=rf"^pairs row 11 \(chosen\): query_token_len is {query_length + 1} but "
                                         rf"'query_chosen_token_response_label' has its first response token at "
                                         rf"index {query_length}; .*data/prepare.py"):
        checks.check_response_starts(shifted, pad, "pairs")

    # a [PAD] inside row 6's rejected response: the label mask is no longer one run from query_token_len
    column = "query_rejected_token_response_label"
    start, length = pairs[6]["query_token_len"], pairs[6]["rejected_token_len"]
    assert length >= 3  # the [PAD] goes strictly inside the response

    def gap(row, i):
        if i == 6:
            row[column] = row[column][: start + 1] + [pad] + row[column][start + 2 :]
        return row

    with pytest.raises(ValueError, match=r"^pairs row 6 \(rejected\): .*\[PAD\] gaps inside the response"):
        checks.check_response_starts(pairs.map(gap, with_indices=True), pad, "pairs")

    # in a run: refused at the data checks, before the output folder is claimed
    broken = str(tmp_path / "preference_shifted")
    DatasetDict({"train": shifted}).save_to_disk(broken)
    result = subprocess.run(resumable_ilql_command(synthetic_task, broken, tmp_path, "shifted"), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"ilql.py: error: {broken} split 'train' row 11 (chosen): query_token_len"), last_line
    assert not (tmp_path / "model_shifted").exists() and not (tmp_path / "runs" / "shifted" / "checkpoints").exists()


def test_gradient_accumulation_steps_is_checked_against_the_batch_sizes():
    args = ilql.Args(total_batch_size=16, local_micro_batch_size=4, gradient_accumulation_steps=2)
    args.world_size = 1
    with pytest.raises(ValueError, match=r"--gradient_accumulation_steps 2 does not match .* = 4"):
        flags_module.check_ilql_flags(args, 4)
    args.gradient_accumulation_steps = 4
    flags_module.check_ilql_flags(args, 4)  # the value the batch sizes give is accepted, as is None (derived)
    args.gradient_accumulation_steps = None
    flags_module.check_ilql_flags(args, 4)
