"""Tests of ppo.py: the subtle math against hand computations, the Details that can be checked on
tiny models (7, 21, 22, 23), the trlX / OpenRLHF options, two subprocess smoke runs, and the reliability
features (SIGKILL + --resume, the non-finite guard, the reward-model tokenizer check)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXForSequenceClassification,
)

from conftest import (
    ENV,
    assert_same_safetensors,
    kill_after_checkpoint,
    load_script,
    run_ok,
    run_two_processes,
    without_timing,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ppo = load_script("ppo")

PAD, EOS, VOCAB = 19, 3, 20


def tiny_config(dropout: float = 0.0) -> GPTNeoXConfig:
    return GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64, eos_token_id=EOS, bos_token_id=EOS, pad_token_id=PAD,
        hidden_dropout=dropout, attention_dropout=dropout, num_labels=1,
    )


def make_args(**ppo_overrides):
    args = ppo.Args()
    for key, value in ppo_overrides.items():
        setattr(args.ppo, key, value)
    return args


def fixed_config(length: int, temperature: float = 0.7) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=length, temperature=temperature, top_k=0, top_p=1.0, do_sample=True,
                            eos_token_id=[], pad_token_id=PAD, suppress_tokens=[PAD])


# ------------------------------------------------------------------------------------------------
# GAE, reward placement, EOS trick
# ------------------------------------------------------------------------------------------------
def test_gae_matches_plain_loop_with_masks():
    torch.manual_seed(0)
    B, T, gamma, lam = 6, 9, 0.9, 0.8
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    last = torch.tensor([0, 3, 8, 5, 8, 2])  # episode ends (EOS or last token)
    mask = torch.arange(T).unsqueeze(0) <= last.unsqueeze(1)
    advantages, returns = ppo.compute_gae(rewards, values, mask, gamma, lam)
    for i in range(B):
        end = last[i].item()
        expected_adv = [0.0] * T
        running = 0.0
        for t in range(end, -1, -1):
            next_value = values[i, t + 1].item() if t < end else 0.0  # terminal after the EOS
            delta = rewards[i, t].item() + gamma * next_value - values[i, t].item()
            running = delta + gamma * lam * running
            expected_adv[t] = running
        torch.testing.assert_close(advantages[i], torch.tensor(expected_adv), atol=1e-5, rtol=1e-5)
        expected_ret = [expected_adv[t] + values[i, t].item() if t <= end else 0.0 for t in range(T)]
        torch.testing.assert_close(returns[i], torch.tensor(expected_ret), atol=1e-5, rtol=1e-5)


def shaped_example(args, scores, responses, seed=0):
    torch.manual_seed(seed)
    B, T = responses.shape
    # the raw samples (a 2-token query before each response) are not read by rewards_and_advantages
    data = ppo.Rollout(query_responses=torch.cat((torch.full((B, 2), 4), responses), 1), responses=responses,
                       logprobs=-torch.rand(B, T), ref_logprobs=-torch.rand(B, T), rm_scores=scores.unsqueeze(1),
                       values=torch.randn(B, T))
    out = vars(ppo.rewards_and_advantages(args, args.ppo, data, EOS, PAD, args.ppo.kl_coef, [ppo.RunningMoments()],
                                          lambda x: x))
    return data, out


def test_reward_at_eos_and_masking():
    args = make_args(whiten_advantages=False)
    # row 0: EOS at index 2; row 1: no EOS (score at the last token); row 2: EOS at index 0
    raw = torch.tensor([[5, 6, EOS, 7, 8], [5, 6, 7, 8, 9], [EOS, 4, 4, 4, 4]])
    responses = ppo.truncate_response(EOS, PAD, raw)
    assert responses.tolist() == [[5, 6, EOS, PAD, PAD], [5, 6, 7, 8, 9], [EOS, PAD, PAD, PAD, PAD]]
    scores = torch.tensor([2.0, 3.0, 4.0])
    data, out = shaped_example(args, scores, responses)
    assert out["last_index"].tolist() == [2, 4, 0]
    kl = data.logprobs - data.ref_logprobs
    expected = -args.ppo.kl_coef * kl * out["mask"]
    expected[0, 2] += 2.0
    expected[1, 4] += -1.0  # EOS trick: no EOS -> penalty replaces the score
    expected[2, 0] += 4.0
    torch.testing.assert_close(out["rewards"], expected)
    after_eos = ~out["mask"]
    assert after_eos.sum() == 6
    for name in ("rewards", "values", "advantages", "returns", "kl", "non_score_reward"):
        assert (out[name][after_eos] == 0).all(), name
    # a masked position carries no loss: changing it leaves the losses unchanged
    loss_inputs = [torch.randn(3, 5) for _ in range(6)]
    pg, vf, _ = ppo.ppo_losses(*loss_inputs, out["mask"], 0.2, 0.2)
    loss_inputs[0] = loss_inputs[0] + 5.0 * after_eos
    loss_inputs[3] = loss_inputs[3] + 5.0 * after_eos
    pg2, vf2, _ = ppo.ppo_losses(*loss_inputs, out["mask"], 0.2, 0.2)
    torch.testing.assert_close((pg, vf), (pg2, vf2))


def test_eos_trick_hits_exactly_the_no_eos_responses():
    responses = ppo.truncate_response(EOS, PAD, torch.tensor([[5, EOS, 7], [5, 6, 7], [EOS, 6, 6], [8, 8, 8]]))
    scores = torch.tensor([0.5, 0.6, 0.7, 0.8])
    penalised, contains_eos = ppo.apply_eos_trick(scores, responses, EOS, -1.0)
    assert contains_eos.tolist() == [True, False, True, False]
    assert penalised.tolist() == pytest.approx([0.5, -1.0, 0.7, -1.0])
    args = make_args()
    args.non_eos_penalty = False
    _, out = shaped_example(args, scores, responses)
    assert out["scores"].tolist() == pytest.approx(scores.tolist())  # flag off: raw scores kept


def test_data_order_reshuffles_each_pass():
    # Detail 21: 10 rows, global batch 4 over 2 ranks -> 2 batches per pass, the last 2 rows dropped
    def batch(index, rank):
        return ppo.shuffled_query_batch(10, 4, seed=3, index=index, process_index=rank, num_processes=2)

    passes = [torch.cat([batch(2 * p + b, r) for b in range(2) for r in range(2)]) for p in range(3)]
    for rows in passes:
        assert len(set(rows.tolist())) == 8  # without replacement within a pass
    assert passes[0].tolist() != passes[1].tolist()  # reshuffled between passes
    # the ranks split each global batch: together they hold the batch one process would draw
    one_process = [ppo.shuffled_query_batch(10, 4, seed=3, index=i, process_index=0, num_processes=1) for i in range(6)]
    assert torch.cat(one_process).tolist() == torch.cat(passes).tolist()
    # a batch is a function of its index: drawing batch 5 directly (a resumed run) gives what a run that drew
    # batches 0-4 first gets
    assert batch(5, 1).tolist() == passes[2][6:8].tolist()


# ------------------------------------------------------------------------------------------------
# trlX / OpenRLHF options: each changes the computation
# ------------------------------------------------------------------------------------------------
def test_kl_estimators():
    logprobs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    k1 = ppo.kl_per_token(logprobs, ref, "k1")
    k3 = ppo.kl_per_token(logprobs, ref, "k3")
    torch.testing.assert_close(k1, torch.tensor([[0.5, -1.0]]))
    r = torch.exp(ref - logprobs)
    torch.testing.assert_close(k3, r - 1 - torch.log(r))
    assert (k3 >= 0).all()
    responses = torch.tensor([[5, 6, EOS, PAD]])
    outs = [shaped_example(make_args(kl_estimator=e), torch.tensor([1.0]), responses)[1] for e in ("k1", "k3")]
    assert not torch.allclose(outs[0]["rewards"], outs[1]["rewards"])


def test_adaptive_kl_controller():
    controller = ppo.AdaptiveKLController(0.05, target=6.0, horizon=1000)
    controller.update(current_kl=9.0, num_episodes=100)  # error 0.5 clipped to 0.2
    assert controller.value == pytest.approx(0.05 * (1 + 0.2 * 100 / 1000))
    controller.update(current_kl=5.4, num_episodes=100)  # error -0.1
    assert controller.value == pytest.approx(0.05 * 1.02 * (1 - 0.1 * 0.1))
    # --resume --accept_changed_flags with a new --ppo.kl_coef: the restored value is replaced by it (Run tells it)
    controller.flags_changed({"lr": (3e-6, 1e-5)})
    assert controller.value == pytest.approx(0.05 * 1.02 * (1 - 0.1 * 0.1))
    controller.flags_changed({"ppo.kl_coef": (0.05, 0.5)})
    assert controller.value == 0.5


def test_running_std_reward_scaling_and_clip():
    moments = ppo.RunningMoments()
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, -4.0])
    moments.update(a)
    moments.update(b)
    both = torch.cat([a, b])
    assert moments.mean == pytest.approx(both.mean().item())
    assert moments.std == pytest.approx(both.std(unbiased=False).item(), rel=1e-6)
    responses = torch.tensor([[5, EOS, PAD], [5, 6, EOS]])
    scores = torch.tensor([4.0, -2.0])
    plain = shaped_example(make_args(), scores, responses)[1]["scores"]
    scaled = shaped_example(make_args(scale_rewards=True), scores, responses)[1]["scores"]
    torch.testing.assert_close(scaled, scores / scores.std(unbiased=False))  # first batch: its own std
    clipped = shaped_example(make_args(reward_clip=1.5), scores, responses)[1]["scores"]
    assert plain.tolist() == [4.0, -2.0] and clipped.tolist() == [1.5, -1.5]


def test_reward_whitening_changes_rewards():
    responses = torch.tensor([[5, EOS, PAD], [5, 6, EOS]])
    scores = torch.tensor([4.0, -2.0])
    plain = shaped_example(make_args(), scores, responses)[1]
    whitened = shaped_example(make_args(whiten_rewards=True), scores, responses)[1]
    masked = whitened["rewards"][plain["mask"]]
    assert masked.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    # Detail 24 whitens the rewards without shifting their mean (shift_mean=False): the masked mean is the plain one's
    plain_mean = plain["rewards"][plain["mask"]].mean().item()
    assert abs(plain_mean) > 0.1 and masked.mean().item() == pytest.approx(plain_mean, abs=1e-5)
    assert not torch.allclose(plain["rewards"], whitened["rewards"])


def test_ptx_loss_is_nll_on_labels_only():
    torch.manual_seed(0)
    logits = torch.randn(1, 4, VOCAB)
    labels = torch.tensor([[PAD, PAD, 7, EOS]])
    logp = torch.log_softmax(logits, -1)
    expected = -(logp[0, 1, 7] + logp[0, 2, EOS]) / 2
    # the update reads the logits only at the positions that predict a label (1 and 2), in row order: (N, V)
    torch.testing.assert_close(ppo.sft_loss(logits[0, 1:3], labels, PAD), expected)


# ------------------------------------------------------------------------------------------------
# Tiny models: generation (Detail 23), Detail 7, Detail 22, Hydra / LoRA references
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def tiny_rollout(accelerator, policy, critic, reward_model, ref_policy, length=6, batch=6):
    torch.manual_seed(1)
    queries = torch.randint(4, 18, (batch, 5))
    queries[:3, :2] = PAD  # left padding
    args = ppo.Args(response_length=length, local_rollout_forward_batch_size=4)
    model = ppo.PolicyAndValue(policy, critic)
    timers = {"generation": 0.0, "scoring": 0.0}
    tok = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    model.eval()
    data = ppo.rollout(args, accelerator, model, ref_policy, [reward_model], queries, tok, fixed_config(length), timers,
                       bring_frozen_to=None, reward_fn=None, prompts=None,  # no --reward_fn
                       rows=torch.arange(len(queries)))  # with a critic, the rollout holds its values too (Detail 22)
    return model, queries, data


def test_generation_fixed_length_and_eos_can_appear(accelerator):
    torch.manual_seed(0)
    policy = GPTNeoXForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        policy.get_output_embeddings().weight[EOS] += 4.0  # EOS very likely, also right after an EOS
    queries = torch.tensor([[PAD, PAD, 5, 6], [7, 8, 9, 10]])
    query_responses = ppo.generate(policy, queries, PAD, fixed_config(12))
    responses = query_responses[:, 4:]
    assert responses.shape == (2, 12) and torch.equal(query_responses[:, :4], queries)
    assert (responses == EOS).any()
    eos_rows = (responses == EOS).any(1)
    first_eos = ppo.first_true_indices(responses == EOS)
    assert (first_eos[eos_rows] < 11).any()  # generation went on after an EOS
    assert not (responses == PAD).any()  # [PAD] is never sampled


@pytest.mark.parametrize("dropout_off", [True, False])
def test_detail7_first_ratio_is_one_only_without_dropout(accelerator, dropout_off):
    torch.manual_seed(0)
    policy = GPTNeoXForCausalLM(tiny_config(dropout=0.3))
    critic = GPTNeoXForSequenceClassification(tiny_config(dropout=0.3))
    reward_model = GPTNeoXForSequenceClassification(tiny_config()).eval()
    ref = GPTNeoXForCausalLM(tiny_config()).eval()
    if dropout_off:
        ppo.disable_dropout(policy)
        ppo.disable_dropout(critic)
    model, queries, data = tiny_rollout(accelerator, policy, critic, reward_model, ref)
    mask, _ = ppo.response_mask(data.responses, PAD)
    model.train()
    torch.manual_seed(5)
    idx = torch.randperm(queries.size(0))[:4]  # the first micro batch of the first epoch
    new_logprobs, _, _, _ = ppo.training_logprobs_and_values(model, data.query_responses[idx], 5, 0.7, PAD)
    ratio = torch.exp(new_logprobs - data.logprobs[idx])[mask[idx]]
    if dropout_off:
        assert (ratio - 1).abs().max().item() < 1e-5
    else:
        assert (ratio - 1).abs().max().item() > 1e-2


def test_detail22_values_and_eos_advantage_ppo_uses_at_init(accelerator, tmp_path):
    """Detail 22 at initialisation: the critic is the RM, so the value PPO gives each response token (the
    critic's reading at the token before it: the state the action is taken in) is the RM's per-token reading
    there. The EOS action's value is the RM's reading at the token before the EOS, not the score: the reading
    at the EOS (the state after the last action, Figure 11) is terminal and masked. With gamma = lambda = 1 and
    no KL at initialisation, the advantage of every kept action, the EOS action's included, is score - V(state);
    the returns are the score. The fresh head of --critic_init sft matches none of it."""
    torch.manual_seed(0)
    GPTNeoXForSequenceClassification(tiny_config()).save_pretrained(tmp_path / "rm")
    GPTNeoXForCausalLM(tiny_config()).save_pretrained(tmp_path / "sft")
    reward_model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", num_labels=1).eval()
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    with torch.no_grad():
        policy.get_output_embeddings().weight[EOS] += 2.0
    args = make_args(gamma=1.0, lam=1.0, whiten_advantages=False)
    context_length, rows = 5, torch.arange(6)
    gaps = {}
    for init in ("reward", "sft"):
        torch.manual_seed(0)
        critic = AutoModelForSequenceClassification.from_pretrained(tmp_path / init if init == "sft" else
                                                                    tmp_path / "rm", num_labels=1).eval()
        # the reference is the policy itself: KL 0, as at initialisation
        _, _, data = tiny_rollout(accelerator, policy, critic, reward_model, policy)
        out = vars(ppo.rewards_and_advantages(args, args.ppo, data, EOS, PAD, args.ppo.kl_coef,
                                              [ppo.RunningMoments()], lambda x: x))
        mask, last, scores = out["mask"], out["last_index"], out["scores"]
        assert (out["kl"] == 0).all()
        # the RM's per-token readings (B, Tq + T) of query + truncated response; [i, j] reads tokens 0..j
        sequences = torch.cat((data.query_responses[:, :context_length], data.responses), 1)
        rm_readings, rm_scores, _ = ppo.get_reward(reward_model, sequences, PAD, context_length)
        state_readings = rm_readings[:, context_length - 1 : -1]  # (B, T) the RM at the token before each action
        gaps[init] = (out["values"] - state_readings)[mask].abs().max().item()
        if init == "sft":
            continue
        contains_eos = out["contains_eos"]
        assert contains_eos.sum() >= 2 and (last[contains_eos] < 5).all()  # EOS actions with [PAD] after them
        torch.testing.assert_close(out["values"], state_readings * mask, atol=1e-5, rtol=0)
        # the EOS action's value is the reading at the token before the EOS; the reading at the EOS (the score)
        # sits at value index last + 1, which PPO masks
        eos_value = out["values"][rows, last]
        torch.testing.assert_close(eos_value, rm_readings[rows, context_length + last - 1], atol=1e-5, rtol=0)
        torch.testing.assert_close(rm_scores[contains_eos], data.rm_scores[contains_eos, 0], atol=1e-5, rtol=0)
        assert (eos_value - scores)[contains_eos].abs().min() > 1e-3
        assert (out["values"][rows[contains_eos], last[contains_eos] + 1] == 0).all()
        # gamma = lambda = 1, no KL: A_t = score - V_t on every kept token; the EOS action: score - V(before EOS)
        torch.testing.assert_close(out["advantages"], (scores.unsqueeze(1) - out["values"]) * mask, atol=1e-5, rtol=0)
        torch.testing.assert_close(out["advantages"][rows, last], scores - rm_readings[rows, context_length + last - 1],
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(out["returns"], scores.unsqueeze(1) * mask, atol=1e-5, rtol=0)
    assert gaps["reward"] < 1e-5
    assert gaps["sft"] > 1e-3  # the ablation's fresh head does not read like the RM


def train_a_few_steps(model, data, context_length=5):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(3):
        new_logprobs, _, vpred, _ = ppo.training_logprobs_and_values(model, data.query_responses, context_length, 0.7,
                                                                     PAD)
        loss = -new_logprobs.mean() + vpred.pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("mode", ["hydra", "lora"])
def test_shared_reference_equals_frozen_sft_copy(accelerator, tmp_path, mode):
    torch.manual_seed(0)
    GPTNeoXForCausalLM(tiny_config()).save_pretrained(tmp_path / "sft")
    sft_copy = AutoModelForCausalLM.from_pretrained(tmp_path / "sft").eval()
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    if mode == "hydra":
        ref = ppo.build_hydra_reference(policy, num_layers_unfrozen=1)
        layers = ppo.decoder_layers(policy)
        assert ppo.decoder_layers(ref)[0] is layers[0] and ppo.decoder_layers(ref)[2] is not layers[2]
        trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
        assert trainable and all("layers.0." not in n and "layers.1." not in n for n in trainable)
    else:
        from peft import LoraConfig, get_peft_model  # ppo.py imports peft inside lora_policy only

        policy = get_peft_model(policy, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
        ref = None
    critic = GPTNeoXForSequenceClassification(tiny_config())
    reward_model = GPTNeoXForSequenceClassification(tiny_config()).eval()
    model, queries, data = tiny_rollout(accelerator, policy, critic, reward_model, ref)
    train_a_few_steps(model, data)
    model.eval()
    with torch.no_grad():
        qr = data.query_responses
        ref_logits = ppo.reference_logits(ref, model.policy, lambda lm: ppo.forward(lm, qr, PAD, slice(None)).logits)
        sft_logits = ppo.forward(sft_copy, qr, PAD, slice(None)).logits
        policy_logits = ppo.forward(model.policy, qr, PAD, slice(None)).logits
    keep = qr != PAD
    torch.testing.assert_close(ref_logits[keep], sft_logits[keep], atol=1e-5, rtol=1e-5)
    assert (policy_logits[keep] - sft_logits[keep]).abs().max() > 1e-3  # the policy did move


def test_frozen_actor_takes_no_adamw_step(accelerator):
    """--ppo.freeze_actor_updates (OpenRLHF), done as ppo_update does it with ActorFreeze (actor lr 0, policy loss
    x 0, then ActorFreeze.before_step drops the actor's gradients before each step): the frozen updates leave the
    actor's weights and AdamW state exactly as they were, and the actor's steps after the freeze equal those of a run
    that never froze (critic aside: it trained meanwhile, but the policy loss does not depend on it), so their size
    ratio is 1."""
    torch.manual_seed(0)
    policy, critic = GPTNeoXForCausalLM(tiny_config()), GPTNeoXForSequenceClassification(tiny_config())
    initial = {name: {key: tensor.clone() for key, tensor in module.state_dict().items()}
               for name, module in (("policy", policy), ("critic", critic))}
    reward_model = GPTNeoXForSequenceClassification(tiny_config()).eval()
    ref = GPTNeoXForCausalLM(tiny_config()).eval()
    _, _, data = tiny_rollout(accelerator, policy, critic, reward_model, ref)
    args = make_args()
    out = vars(ppo.rewards_and_advantages(args, args.ppo, data, EOS, PAD, 0.05, [ppo.RunningMoments()], lambda x: x))
    steps_per_update = 2

    def train(frozen_updates: int, unfrozen_updates: int):
        """Fresh copies of the initial models; returns the actor's weights after each unfrozen step and AdamW."""
        policy.load_state_dict(initial["policy"])
        critic.load_state_dict(initial["critic"])
        model = ppo.PolicyAndValue(policy, critic).train()
        actor = [p for p in policy.parameters() if p.requires_grad]
        critic_params = [p for p in critic.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW([{"params": actor, "name": "actor"}, {"params": critic_params, "name": "critic"}],
                                      lr=1e-3, eps=1e-5, weight_decay=0.01)  # the two groups of main()
        freeze = ppo.ActorFreeze(frozen_updates, actor, accelerator)  # no DeepSpeed plugin
        after_steps = []
        for update in range(1, frozen_updates + unfrozen_updates + 1):
            frozen = update <= frozen_updates
            freeze.set_lr(optimizer, update, 1e-3)
            assert [g["lr"] for g in optimizer.param_groups] == [0.0 if frozen else 1e-3, 1e-3]
            for _ in range(steps_per_update):
                new_logprobs, _, vpred, _ = ppo.training_logprobs_and_values(model, data.query_responses, 5, 0.7,
                                                                             PAD)
                pg_loss, vf_loss, _ = ppo.ppo_losses(new_logprobs, data.logprobs, out["advantages"], vpred,
                                                     out["values"], out["returns"], out["mask"], 0.2, 0.2)
                (freeze.policy_loss_weight(update) * pg_loss + 0.1 * vf_loss).backward()
                freeze.before_step(update)
                optimizer.step()
                optimizer.zero_grad()
                if not frozen:
                    after_steps.append([p.detach().clone() for p in actor])
            if frozen and update == frozen_updates:
                # AdamW's state of the actor equals its initial state (none), its weights are untouched,
                # while the critic has taken every step
                assert all(len(optimizer.state.get(p, {})) == 0 for p in actor)
                for name, tensor in policy.state_dict().items():
                    assert torch.equal(tensor, initial["policy"][name]), name
                assert all(optimizer.state[p]["step"] == frozen_updates * steps_per_update for p in critic_params)
        return after_steps, [optimizer.state[p] for p in actor]

    never_frozen, never_frozen_state = train(0, 2)
    after_freeze, after_freeze_state = train(3, 2)
    initial_actor = [initial["policy"][name] for name, p in policy.named_parameters() if p.requires_grad]
    previous = {"never": initial_actor, "after": initial_actor}
    for step, (weights_never, weights_after) in enumerate(zip(never_frozen, after_freeze)):
        size_never = torch.cat([(w - b).flatten() for w, b in zip(weights_never, previous["never"])]).norm()
        size_after = torch.cat([(w - b).flatten() for w, b in zip(weights_after, previous["after"])]).norm()
        assert size_never > 0 and (size_after / size_never).item() == 1.0, f"unfrozen step {step + 1}"
        assert all(torch.equal(a, b) for a, b in zip(weights_after, weights_never)), f"unfrozen step {step + 1}"
        previous = {"never": weights_never, "after": weights_after}
    for state_after, state_never in zip(after_freeze_state, never_frozen_state):
        assert state_after.keys() == state_never.keys()
        assert all(torch.equal(state_after[key], state_never[key]) for key in state_after)


# ------------------------------------------------------------------------------------------------
# Subprocess smoke runs on the built-in task
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models(synthetic_task, tmp_path_factory):
    """The base model stands in for the SFT policy; an RM is the base model with a fresh scalar head."""
    root = tmp_path_factory.mktemp("ppo_models")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(synthetic_task["base_model"])
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(synthetic_task["base_model"], num_labels=1)
    rm.save_pretrained(root / "rm")
    tokenizer.save_pretrained(root / "rm")
    return {"sft": synthetic_task["base_model"], "rm": str(root / "rm")}


def ppo_flags(synthetic_task, tiny_models, root, run_name="smoke", output_dir="policy", total_episodes=16,
              eval_every=1, reward_model_path=None, extra=()):
    """Flags of a small PPO run on the built-in task: updates of 8 episodes, 2 epochs x 2 minibatches x 2 micro
    batches; outputs in root/runs/{run_name} and root/{output_dir}."""
    task = json.load(open(synthetic_task["task_json"]))
    return [
        "--sft_model_path", tiny_models["sft"], "--reward_model_path", reward_model_path or tiny_models["rm"],
        "--query_dataset", synthetic_task["sft"], "--response_length", str(task["sft_response_length"]),
        "--total_episodes", str(total_episodes), "--total_batch_size", "8", "--local_micro_batch_size", "2",
        "--local_rollout_forward_batch_size", "8", "--ppo.num_ppo_epochs", "2", "--ppo.num_mini_batches", "2",
        "--num_eval_samples", "8", "--eval_every", str(eval_every), "--output_dir", str(root / output_dir),
        "--run_dir_root", str(root / "runs"), "--run_name", run_name, *extra,
    ]


def smoke_command(synthetic_task, tiny_models, tmp_path, extra):
    return ppo_flags(synthetic_task, tiny_models, tmp_path, extra=extra)


def check_run(tmp_path):
    run_dir = tmp_path / "runs" / "smoke"
    summary = json.load(open(run_dir / "summary.json"))
    for key in ("eval/score", "eval/eos_rate", "objective/kl", "episodes_per_second", "wall_time_s"):
        assert key in summary
    lines = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [m for m in lines if "ppo/val/ratio" in m]
    assert len(train) == 2
    # each update's wall time (issue 51): the one episodes_per_second divides the batch by (8 responses)
    assert all(m["time/update_s"] == pytest.approx(8 / m["episodes_per_second"]) for m in train)
    # the budget it claims (--total_episodes 16: sampled responses) is what it sampled, counted on every process
    assert [m["budget/responses_sampled"] for m in train] == [8, 16] and summary["budget/responses_sampled"] == 16
    assert summary["budget/prompts"] == 16 and summary["budget/updates"] == 2
    for key in ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                "objective/scores", "ppo/policy/approxkl_avg", "ppo/policy/clipfrac_avg", "ppo/loss/policy_avg",
                "ppo/loss/value_avg", "ppo/val/clipfrac_avg", "ppo/val/ratio", "ppo/val/ratio_var",
                "ppo/val/num_eos_tokens", "train/lr", "episode", "episodes_per_second"):
        assert key in train[0], key
    import pandas as pd

    table = pd.read_csv(run_dir / "samples.csv")
    assert list(table.columns) == ["query", "response", "reference", "score", "response_token_len", "has_eos"]
    assert len(table) == 8
    assert (run_dir / "samples" / "step_000001.csv").exists()
    assert (tmp_path / "policy" / "model.safetensors").exists()
    return summary, train


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_smoke_single_process_with_options(synthetic_task, tiny_models, tmp_path):
    extra = ["--ppo.kl_estimator", "k3", "--ppo.adaptive_kl", "--ppo.scale_rewards", "--ppo.reward_clip", "5",
             "--ppo.ptx_coef", "0.1"]
    cmd = [sys.executable, os.path.join(REPO_ROOT, "ppo.py"), *smoke_command(synthetic_task, tiny_models, tmp_path,
                                                                               extra)]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    _, train = check_run(tmp_path)
    assert train[1]["objective/kl_coef"] != train[0]["objective/kl_coef"]  # the adaptive controller moved
    assert train[0]["ppo/loss/ptx_avg"] > 0


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_smoke_two_processes_frozen_actor(synthetic_task, tiny_models, tmp_path):
    """2 processes (gloo on CPU); the actor stays frozen for both updates, so the saved policy must
    equal the SFT policy bit for bit while the critic trains, and the actor takes no AdamW step (DDP included)."""
    extra = ["--ppo.freeze_actor_updates", "2", "--checkpoint_every", "1"]
    run_two_processes(os.path.join(REPO_ROOT, "ppo.py"), *smoke_command(synthetic_task, tiny_models, tmp_path, extra))
    _, train = check_run(tmp_path)
    assert train[0]["ppo/loss/value_avg"] > 0
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").state_dict()
    original = AutoModelForCausalLM.from_pretrained(tiny_models["sft"]).state_dict()
    assert saved.keys() == original.keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, original[name], atol=0, rtol=0)
    # the update-1 checkpoint's AdamW: no state for the actor's group (its initial state), while the critic's
    # group has taken the update's 4 steps (2 epochs x 2 minibatches)
    optimizer_state = torch.load(tmp_path / "runs" / "smoke" / "checkpoints" / "update_000001" / "optimizer.bin",
                                 weights_only=True)
    actor_ids, critic_ids = (group["params"] for group in optimizer_state["param_groups"])
    assert actor_ids and not any(i in optimizer_state["state"] for i in actor_ids)
    assert all(optimizer_state["state"][i]["step"] == 4 for i in critic_ids)


# ------------------------------------------------------------------------------------------------
# Reliability: resumable checkpoints, non-finite guard, bad input
# ------------------------------------------------------------------------------------------------
def read_metrics(run_dir) -> list:
    return [without_timing(json.loads(line)) for line in open(run_dir / "metrics.jsonl") if line.strip()]


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(synthetic_task, tiny_models, tmp_path):
    """5 updates, a checkpoint every 2. One run is killed (SIGKILL) during update 3, right after its update-2
    checkpoint appeared, and resumed; it must end exactly like a run that was never interrupted: the same final
    policy, the same update-4 checkpoint (policy + critic, AdamW, KL controller, reward statistics), the same
    metrics and summary apart from timings, the same final samples. The adaptive KL controller, reward scaling
    and PPO-ptx are on, so each piece of state that a resume could lose changes the numbers."""
    extra = ["--ppo.adaptive_kl", "--ppo.scale_rewards", "--ppo.ptx_coef", "0.1", "--checkpoint_every", "2",
             "--print_sample_every", "0"]

    def command(name, *more):
        flags = ppo_flags(synthetic_task, tiny_models, tmp_path, run_name=name, output_dir=f"policy_{name}",
                          total_episodes=40, eval_every=3, extra=extra)
        return [sys.executable, os.path.join(REPO_ROOT, "ppo.py"), *flags, *more]

    run_ok(command("full"), cwd=REPO_ROOT, env=ENV)

    run_dir = tmp_path / "runs" / "killed"
    kill_after_checkpoint(command("killed"), run_dir / "checkpoints" / "update_000002", cwd=REPO_ROOT, env=ENV)
    assert not (tmp_path / "policy_killed" / "model.safetensors").exists()

    resumed = run_ok(command("killed", "--resume"), cwd=REPO_ROOT, env=ENV)
    assert "resumed from" in resumed.stdout and "update_000002" in resumed.stdout, resumed.stdout[-2000:]

    full_dir = tmp_path / "runs" / "full"
    assert_same_safetensors(tmp_path / "policy_full" / "model.safetensors",
                            tmp_path / "policy_killed" / "model.safetensors")
    # the update-4 checkpoint was written by the resumed part: the critic, AdamW and the small state agree too
    full_ckpt, resumed_ckpt = full_dir / "checkpoints" / "update_000004", run_dir / "checkpoints" / "update_000004"
    assert_same_safetensors(full_ckpt / "model.safetensors", resumed_ckpt / "model.safetensors")
    optimizers = [torch.load(c / "optimizer.bin", weights_only=False)["state"] for c in (full_ckpt, resumed_ckpt)]
    assert optimizers[0].keys() == optimizers[1].keys()
    for key in optimizers[0]:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizers[0][key][name], optimizers[1][key][name])
    for custom in ("custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl"):  # KL controller, reward statistics
        assert torch.load(full_ckpt / custom) == torch.load(resumed_ckpt / custom)
    states = [json.load(open(c / "trainer_state.json")) for c in (full_ckpt, resumed_ckpt)]
    for state in states:
        state.pop("wall_time_s"), state.pop("totals")
        state["metrics"] = without_timing(state["metrics"])
    assert states[0] == states[1]
    assert states[0]["update"] == 4 and states[0]["metrics"]["episode"] == 4 * 8

    full_metrics, resumed_metrics = read_metrics(full_dir), read_metrics(run_dir)
    assert len(full_metrics) == 5 + 1 + 1  # 5 updates, the evaluation at update 3, the final evaluation
    assert resumed_metrics == full_metrics
    kl_coefs = [row["objective/kl_coef"] for row in full_metrics if "objective/kl_coef" in row]
    assert len(set(kl_coefs)) == 5  # the adaptive controller moved at every update: its state matters
    summaries = [without_timing(json.load(open(d / "summary.json"))) for d in (full_dir, run_dir)]
    assert summaries[0] == summaries[1]
    assert open(full_dir / "samples.csv").read() == open(run_dir / "samples.csv").read()


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_how_often_and_how_much_a_run_evaluates_never_changes_what_it_trains(synthetic_task, tiny_models, tmp_path):
    """Two 2-update runs that differ only in their evaluation (every update on 8 queries; only the final one on 16)
    end with the same policy bit for bit: evaluation samples from its own random stream (run_module.evaluation_rng),
    so the rollouts of update 2 draw what they would have drawn without the evaluation after update 1."""
    for name, every, samples in (("often", 1, 8), ("final", 0, 16)):
        flags = ppo_flags(synthetic_task, tiny_models, tmp_path, run_name=name, output_dir=f"policy_{name}",
                          eval_every=every, extra=["--print_sample_every", "0"])
        flags[flags.index("--num_eval_samples") + 1] = str(samples)
        run_ok([sys.executable, os.path.join(REPO_ROOT, "ppo.py"), *flags], cwd=REPO_ROOT, env=ENV)
    assert (tmp_path / "runs" / "often" / "samples" / "step_000001.csv").exists()
    assert not (tmp_path / "runs" / "final" / "samples" / "step_000001.csv").exists()
    assert_same_safetensors(tmp_path / "policy_often" / "model.safetensors",
                            tmp_path / "policy_final" / "model.safetensors")


def test_nan_reward_model_is_refused_at_load(synthetic_task, tiny_models, tmp_path):
    """A reward model whose score head holds a NaN: the run stops as it loads it, naming the file and the tensor,
    before any update; it writes no checkpoint and saves no policy (no checkpoint ever holds non-finite weights)."""
    from transformers import AutoTokenizer

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_models["rm"], num_labels=1)
    with torch.no_grad():
        rm.score.weight[0, 0] = float("nan")
    rm.save_pretrained(tmp_path / "nan_rm")
    AutoTokenizer.from_pretrained(tiny_models["rm"]).save_pretrained(tmp_path / "nan_rm")
    flags = ppo_flags(synthetic_task, tiny_models, tmp_path, reward_model_path=str(tmp_path / "nan_rm"))
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "ppo.py"), *flags], cwd=REPO_ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("ppo.py: error: "), result.stderr[-3000:]
    assert str(tmp_path / "nan_rm" / "model.safetensors") in error and "score.weight" in error, error
    assert "update 1" not in result.stdout + result.stderr  # stopped at load, before any rollout
    assert not (tmp_path / "policy" / "model.safetensors").exists()
    checkpoints = tmp_path / "runs" / "smoke" / "checkpoints"
    assert not checkpoints.exists() or not os.listdir(checkpoints)
    assert not (tmp_path / "runs" / "smoke" / "summary.json").exists()


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_nan_loss_after_a_step_saves_nothing(synthetic_task, tiny_models, tmp_path):
    """--lr 1e30: the first minibatch step of update 1 blows the weights up, the loss of a later minibatch is
    not finite. Those weights must not be saved: no checkpoint and no policy, and the message says so."""
    flags = ppo_flags(synthetic_task, tiny_models, tmp_path, extra=["--lr", "1e30", "--checkpoint_every", "1"])
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "ppo.py"), *flags], cwd=REPO_ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "ppo.py: error: update 1: ppo/loss (epoch" in output, output[-3000:]
    assert "those weights are NOT saved" in output
    checkpoints = tmp_path / "runs" / "smoke" / "checkpoints"
    assert not checkpoints.exists() or not [d for d in os.listdir(checkpoints) if d.startswith("update_")]
    assert not (tmp_path / "policy" / "model.safetensors").exists()


@pytest.mark.parametrize("mismatch", ["vocabulary", "pad_id"])
def test_reward_model_with_another_tokenizer_is_refused(synthetic_task, tiny_models, tmp_path, mismatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["rm"])
    if mismatch == "vocabulary":
        tokenizer.add_tokens(["<a_token_the_policy_lacks>"])
    else:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(5)  # same vocabulary, another pad id
    AutoModelForSequenceClassification.from_pretrained(tiny_models["rm"], num_labels=1).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    flags = ppo_flags(synthetic_task, tiny_models, tmp_path, reward_model_path=str(tmp_path / "rm"))
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "ppo.py"), *flags], cwd=REPO_ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("ppo.py: error: the reward model"), result.stderr[-3000:]
    assert str(tmp_path / "rm") in error and tiny_models["sft"] in error  # both paths
    assert f"reward.py --sft_model_path {tiny_models['sft']}" in error  # the fix
    assert ("vocab_size" in error) == (mismatch == "vocabulary")
    assert ("pad_token_id" in error) == (mismatch == "pad_id")
    assert not (tmp_path / "policy").exists()  # refused before the output folder is claimed
