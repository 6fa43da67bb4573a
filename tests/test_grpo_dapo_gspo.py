"""Tests of grpo.py's GSPO and DAPO options against hand computations: GSPO's sequence-level ratio and its gradient
(--grpo.ratio_level sequence), DAPO's dynamic sampling (--grpo.max_draws_per_update: which groups an update trains
on, how many prompt batches it draws and counts, the line at the cap, the data position it resumes from) and DAPO's
soft overlong punishment (--grpo.overlong_buffer) beside the EOS trick. The run with all three killed and resumed is
tests/test_grpo.py's SIGKILL test."""

import math
import types

import pytest
import torch

from conftest import load_script
from rlhf_utils.flags import RunFlags

grpo = load_script("grpo")

PAD, EOS = 19, 3


# ------------------------------------------------------------------------------------------------
# GSPO: one ratio per response
# ------------------------------------------------------------------------------------------------
def test_gspo_gradient_on_two_responses_is_the_hand_formula():
    """Two responses to one query, of 3 and 2 tokens (then padding); a linear policy theta. GSPO's ratio of response i
    is s_i = exp(mean over its tokens of log(p / p_old)), and d/dtheta of s_i A_i is s_i A_i (1 / |o_i|) sum_t
    d log p(o_it) / dtheta. Response 1 stays inside the clip range: its gradient is that formula, weighted 1 / 2
    (GRPO's mean over responses); response 2 (s_2 = e^0.3 = 1.35 > 1.2, A > 0) is clipped: none."""
    torch.manual_seed(0)
    theta = torch.randn(3, 6, requires_grad=True)  # 3 features -> logits over 6 tokens
    features, tokens = torch.randn(2, 4, 3), torch.randint(0, 6, (2, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()

    def logprobs(weights):
        return torch.log_softmax(features @ weights, -1).gather(2, tokens.unsqueeze(-1)).squeeze(-1)  # (2, 4)

    new = logprobs(theta)
    # log(p / p_old) per token; 9 where no response token is: read, it would push both ratios far out of the range
    log_ratios = torch.tensor([[0.05, -0.02, 0.03, 9.0], [0.4, 0.2, 9.0, 9.0]])
    old = (new - log_ratios).detach()
    advantages = torch.tensor([1.5, 0.8])
    weights = grpo.token_weights(mask, "response_mean", 4, None)  # 1 / (2 |o_i|) on each response's tokens
    loss, stats = grpo.grpo_loss(new, old, new.detach(), advantages, weights, 0.2, 0.2, 0.0, "sequence")
    s1, s2 = math.exp((0.05 - 0.02 + 0.03) / 3), math.exp((0.4 + 0.2) / 2)
    assert loss.item() == pytest.approx(-(1.5 * s1 + 0.8 * 1.2) / 2, rel=1e-5)
    assert stats["ratio"].item() == pytest.approx((s1 + s2) / 2, rel=1e-5) and stats["pg_clipfrac"].item() == 0.5
    (grad,) = torch.autograd.grad(loss, theta)
    token_grads = [torch.autograd.grad(logprobs(theta)[0, t], theta)[0] for t in range(3)]  # grad log p(o_1t)
    hand = -0.5 * 1.5 * s1 * (1 / 3) * sum(token_grads)
    torch.testing.assert_close(grad, hand)
    # the token-level ratio (GRPO) weighs each token by its own ratio: another gradient
    token_loss, _ = grpo.grpo_loss(logprobs(theta), old, new.detach(), advantages, weights, 0.2, 0.2, 0.0, "token")
    (token_grad,) = torch.autograd.grad(token_loss, theta)
    assert not torch.allclose(token_grad, hand)


# ------------------------------------------------------------------------------------------------
# DAPO: dynamic sampling
# ------------------------------------------------------------------------------------------------
ONE_PROCESS = types.SimpleNamespace(process_index=0, num_processes=1, gather=lambda x: x, print=print)
# 20 prompts of the query split, left-padded to 3 tokens; every 5th is a token longer (a batch without one has its
# padding column cut by rollout, so batches come in two widths)
QUERY_TOKENS = torch.tensor([[100 + r if r % 5 == 0 else PAD, 200 + r, 300 + r] for r in range(20)])
RESPONSE_LENGTH, G, BATCH_PROMPTS = 4, 2, 4


def dapo_args(max_draws: int):
    return grpo.Args(group_size=G, total_batch_size=G * BATCH_PROMPTS, response_length=RESPONSE_LENGTH,
                     grpo=grpo.GrpoHParams(max_draws_per_update=max_draws))


def batch_rows(index: int) -> list:
    """Rows of prompt batch `index` of the stream (Detail 21, seed 1, one process)."""
    return grpo.shuffled_query_batch(20, BATCH_PROMPTS, 1, index, 0, 1).tolist()


def sample_update(args, update: int, prompts_drawn: int, equal_rows: set, accelerator=ONE_PROCESS):
    """main's loop of steps 1-7 for one update, on a stand-in rollout: each group's two responses end at once (EOS)
    and the reward model scores row r's responses 1 and 1 when r is in equal_rows, else r and r + 1."""
    sampler = grpo.DynamicSampling(args, accelerator, QUERY_TOKENS, PAD)
    state = {"budget": {"budget/prompts": prompts_drawn}}
    draws = []
    for rows, queries in sampler.prompt_batches(update, state, "cpu"):
        draws.append(rows.tolist())
        queries = queries[:, grpo.real_columns(queries, PAD)]  # as rollout cuts them
        responses = torch.tensor([[EOS, PAD, PAD, PAD]]).repeat(len(queries), 1)
        scores = [[1.0, 1.0] if r in equal_rows else [float(r), r + 1.0] for r in rows.tolist()]
        data = grpo.Rollout(query_responses=torch.cat((queries, responses), 1), responses=responses,
                            logprobs=torch.zeros(len(queries), RESPONSE_LENGTH),
                            ref_logprobs=torch.zeros(len(queries), RESPONSE_LENGTH),
                            rm_scores=torch.tensor(scores).view(-1, 1))
        scored = grpo.rewards_and_advantages(args, args.grpo, data, EOS, PAD, [], lambda x: x)
        rows, data, scored = sampler.keep(rows, data, scored)
    return draws, rows, data, scored


def trained_rows(data) -> list:
    """The query-split row of each trained group, read back from its query tokens (left-padded as the split's)."""
    queries = data.query_responses[::G, :-RESPONSE_LENGTH]
    queries = torch.nn.functional.pad(queries, (QUERY_TOKENS.size(1) - queries.size(1), 0), value=PAD)
    return [int(torch.nonzero((QUERY_TOKENS == q).all(1))) for q in queries]


def test_dynamic_sampling_fills_the_batch_with_groups_of_unequal_rewards(capsys):
    """Update 2 of a run that drew 2 prompt batches before it (the data position comes from the prompts drawn,
    not from the update number): batches 2, 3 and 4 are drawn. 3 groups of batch 2 and 2 of batch 3 have equal
    rewards, so 1 + 2 groups come from them and the fourth from batch 4; its other groups are dropped too."""
    first, second, third = batch_rows(2), batch_rows(3), batch_rows(4)
    equal = set(first[:3] + second[:2])
    draws, rows, data, scored = sample_update(dapo_args(3), 2, 2 * BATCH_PROMPTS, equal)
    assert draws == [first, second, third]
    assert trained_rows(data) == [first[3], second[2], second[3], third[0]]  # full, none of equal rewards
    grouped = scored.scores.view(-1, G)
    assert len(grouped) == BATCH_PROMPTS and (grouped[:, 0] != grouped[:, 1]).all()
    assert torch.equal(scored.advantages, grpo.grpo_advantages(scored.scores, G, "group", None))
    # the budget main logs: every prompt drawn, G responses each
    assert len(rows) == 3 * BATCH_PROMPTS and len(rows) * G == 24
    # one width for every row: the query split's (3) + response_length; the shorter queries left-padded
    assert data.query_responses.shape == (BATCH_PROMPTS * G, 3 + RESPONSE_LENGTH)
    assert torch.equal(data.query_responses[:, 3:], data.responses)
    assert "dynamic sampling drew" not in capsys.readouterr().out  # filled at the third and last batch allowed


def test_dynamic_sampling_stops_at_the_cap_with_a_line(capsys):
    """The same rewards, at most 2 batches: 3 groups of unequal rewards; the fourth slot takes the first group of
    equal rewards drawn (advantage 0, as GRPO trains it), and a line says so."""
    first, second = batch_rows(2), batch_rows(3)
    draws, rows, data, scored = sample_update(dapo_args(2), 2, 2 * BATCH_PROMPTS, set(first[:3] + second[:2]))
    assert draws == [first, second] and len(rows) * G == 16
    assert trained_rows(data) == [first[3], second[2], second[3], first[0]]
    assert scored.advantages[-G:].tolist() == [0.0, 0.0]
    assert "update 2: dynamic sampling drew its 2 prompt batches (--grpo.max_draws_per_update) and 1 of the " \
           "batch's 4 group slots still hold groups of equal rewards" in capsys.readouterr().out


def test_dynamic_sampling_off_is_grpo():
    """--grpo.max_draws_per_update 1: update u samples batch u - 1 once, and trains on all of it, equal groups too."""
    first = batch_rows(4)
    draws, rows, data, scored = sample_update(dapo_args(1), 5, 123, set(first))
    assert draws == [first] and rows.tolist() == first and trained_rows(data) == first
    assert (scored.advantages == 0).all()


def test_dynamic_sampling_waits_for_every_process(capsys):
    """Process 0 of 2 (2 prompts of each batch of 4): its first batch fills its part of the batch, but the other
    process has found no group of unequal rewards (its counts, gathered, are 0), so both go on drawing to the cap;
    process 0 keeps its first groups, and the line counts the other's 2 slots."""
    other_found_none = types.SimpleNamespace(process_index=0, num_processes=2, print=print,
                                             gather=lambda x: torch.cat((x, torch.zeros_like(x))))
    draws, rows, data, _ = sample_update(dapo_args(3), 1, 0, set(), other_found_none)
    assert draws == [batch_rows(i)[:2] for i in range(3)] and len(rows) == 6
    assert trained_rows(data) == batch_rows(0)[:2]
    assert "2 of the batch's 4 group slots" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# DAPO: soft overlong punishment
# ------------------------------------------------------------------------------------------------
def test_overlong_punishment_by_hand_and_the_eos_trick():
    """response_length 8, buffer 4: responses of 3, 4, 5, 6 and 8 tokens (EOS last) and one without EOS (8 tokens),
    all scored 1 by the reward model. The penalty is 0 up to 8 - 4 = 4 tokens, then (4 - n) / 4: -0.25, -0.5, -1;
    the response without EOS gets the EOS trick's -1 and the penalty's -1 on top: -2."""
    raw = torch.full((6, 8), 7)
    for row, eos_at in enumerate([2, 3, 4, 5, 7]):
        raw[row, eos_at] = EOS
    responses = grpo.truncate_response(EOS, PAD, raw)
    data = grpo.Rollout(query_responses=torch.cat((torch.full((6, 2), 4), raw), 1), responses=responses,
                        logprobs=torch.zeros(6, 8), ref_logprobs=torch.zeros(6, 8), rm_scores=torch.ones(6, 1))
    expected = {0: [1.0, 1.0, 1.0, 1.0, 1.0, -1.0], 4: [1.0, 1.0, 0.75, 0.5, 0.0, -2.0]}
    for buffer, scores in expected.items():
        args = grpo.Args(group_size=2, response_length=8, grpo=grpo.GrpoHParams(overlong_buffer=buffer))
        out = grpo.rewards_and_advantages(args, args.grpo, data, EOS, PAD, [], lambda x: x)
        assert out.scores.tolist() == scores


def test_bad_dapo_flags_are_refused_before_anything_loads(tmp_path):
    """rlhf_utils/flags.py check_groups, called by check_flags: the model paths do not exist, so a run that got past
    the check would fail differently."""
    common = dict(total_batch_size=8, local_micro_batch_size=2, total_episodes=16,
                  run=RunFlags(run_dir_root=str(tmp_path)), sft_model_path=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="--grpo.max_draws_per_update must be >= 1"):
        grpo.main(grpo.Args(grpo=grpo.GrpoHParams(max_draws_per_update=0), **common))
    with pytest.raises(ValueError, match="--grpo.overlong_buffer >= 0"):
        grpo.main(grpo.Args(grpo=grpo.GrpoHParams(overlong_buffer=-1), **common))
