"""offline_rl.py: the filter / RWR / DT / best-of-n math against hand computations, the fixed-length
generation config, one subprocess smoke run per method on the built-in task, and the reliability checks
(SIGKILL + --resume gives the uninterrupted result, the non-finite guard and its fallback checkpoint, a missing
column)."""

import json
import math
import os
import shutil
import subprocess
import sys
import types

import pandas as pd
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

from conftest import (
    ENV,
    assert_last_good_checkpoint,
    assert_same_checkpoint,
    assert_same_safetensors,
    kill_after_checkpoint,
    load_script,
    run_ok,
    with_nan_at,
    without_timing,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
offline_rl = load_script("offline_rl")
from rlhf_utils import flags as flags_module  # noqa: E402  (the scripts' refusals of flags)
from rlhf_utils import run as run_module  # noqa: E402  (the run infrastructure the scripts import)

PAD, EOS, VOCAB = 1, 0, 32


def tiny_lm(seed: int = 0) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS)
    model = GPTNeoXForCausalLM(config)
    offline_rl.disable_dropout(model)
    return model.eval()


def hand_token_nll(model, query_responses: torch.Tensor, context_length: int) -> list:
    """Per sample, the summed -log p of its response tokens (non-pad, after the context), one row at a time
    without padding: a plain re-computation of what the batched loss should use."""
    out = []
    for row in query_responses:
        query = row[:context_length][row[:context_length] != PAD]
        response = row[context_length:][row[context_length:] != PAD]
        ids = torch.cat((query, response)).unsqueeze(0)
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        targets = ids[0, 1:]
        picked = logprobs[torch.arange(targets.numel()), targets][query.numel() - 1 :]
        out.append((-picked.sum().item(), response.numel()))
    return out


def batch() -> tuple:
    # two left-padded queries of width 4, right-padded responses of width 4 (EOS then pads)
    queries = torch.tensor([[PAD, 5, 6, 7], [8, 9, 10, 11]])
    responses = torch.tensor([[12, 13, EOS, PAD], [14, EOS, PAD, PAD]])
    return queries, responses, torch.cat((queries, responses), 1)


def test_response_labels_cover_response_tokens_only():
    queries, responses, query_responses = batch()
    labels = offline_rl.response_labels(query_responses, queries.size(1), PAD)
    assert (labels[:, :4] == -100).all()  # the query never carries loss
    assert labels[0, 4:].tolist() == [12, 13, EOS, -100]  # EOS is a target, pads are not
    assert labels[1, 4:].tolist() == [14, EOS, -100, -100]


def test_filter_loss_is_zero_below_threshold_and_matches_hand_computation():
    model = tiny_lm()
    queries, responses, query_responses = batch()
    labels = offline_rl.response_labels(query_responses, queries.size(1), PAD)
    hand = hand_token_nll(model, query_responses, queries.size(1))
    num_tokens = sum(n for _, n in hand)

    # both samples under the threshold: zero loss and zero gradient
    weights = offline_rl.filter_weights(torch.tensor([-0.5, 0.0]), threshold=0.0)  # 0.0 is not > 0
    assert weights.tolist() == [0.0, 0.0]
    loss, _ = offline_rl.weighted_response_loss(model, query_responses, labels, weights, PAD)
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.parameters())

    # only the second sample passes: its summed NLL over the micro-batch's target tokens
    weights = offline_rl.filter_weights(torch.tensor([-0.5, 0.3]), threshold=0.0)
    loss, per_sample = offline_rl.weighted_response_loss(model, query_responses, labels, weights, PAD)
    assert loss.item() == pytest.approx(hand[1][0] / num_tokens, rel=1e-5)
    assert per_sample.tolist() == pytest.approx([hand[0][0] / hand[0][1], hand[1][0] / hand[1][1]], rel=1e-5)
    # a higher threshold lets nothing through
    assert offline_rl.filter_weights(torch.tensor([-0.5, 0.3]), threshold=0.5).sum().item() == 0


def test_rwr_weights_follow_exp_r_over_beta_then_normalise_and_clip():
    rewards = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    raw, used = offline_rl.rwr_weights(rewards, beta=5.0, max_weight=10.0)
    assert raw.tolist() == pytest.approx([math.exp(r / 5.0) for r in rewards.tolist()], rel=1e-6)
    # self-normalised over the batch: same ratios as exp(R / beta), mean 1 (no clip binds here)
    assert used.mean().item() == pytest.approx(1.0, rel=1e-6)
    assert (used / used[0]).tolist() == pytest.approx((raw / raw[0]).tolist(), rel=1e-5)
    # a small beta makes one sample dominate: the clip bounds it, the others keep their ratios
    raw, used = offline_rl.rwr_weights(torch.tensor([0.0, 0.0, 0.0, 3.0]), beta=0.1, max_weight=2.0)
    assert raw[3].item() == pytest.approx(math.exp(30.0), rel=1e-5)
    assert used[3].item() == 2.0 and used[:3].tolist() == pytest.approx([used[0].item()] * 3)
    assert used[0].item() == pytest.approx(4 / (3 + math.exp(30.0)), rel=1e-4)
    # huge rewards do not overflow the normalised weights
    _, used = offline_rl.rwr_weights(torch.tensor([1000.0, 999.0]), beta=1.0, max_weight=10.0)
    assert torch.isfinite(used).all()


def test_rwr_loss_weights_each_sample_by_its_weight():
    model = tiny_lm(1)
    queries, responses, query_responses = batch()
    labels = offline_rl.response_labels(query_responses, queries.size(1), PAD)
    hand = hand_token_nll(model, query_responses, queries.size(1))
    weights = torch.tensor([0.25, 1.75])
    loss, _ = offline_rl.weighted_response_loss(model, query_responses, labels, weights, PAD)
    expected = (0.25 * hand[0][0] + 1.75 * hand[1][0]) / (hand[0][1] + hand[1][1])
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_the_gradient_of_an_update_does_not_depend_on_the_micro_batch_size():
    """train_update divides every micro batch's loss by the target tokens of the whole update batch: micro batches of
    2 (4 accumulation steps) and one micro batch of 8 give the same gradient (SGD with lr 1: the weights move by
    minus the gradient), and that gradient is the one of the batch's weighted token mean. Averaging per-micro-batch
    token means, as the script did before, gives another gradient for these responses of unequal lengths."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    torch.manual_seed(0)
    queries = torch.randint(3, VOCAB, (8, 4))
    queries[::3, 0] = PAD  # some left padding
    responses = torch.full((8, 6), PAD)
    for i, length in enumerate([1, 6, 2, 5, 3, 6, 1, 4]):  # responses of very unequal lengths, each ended by EOS
        responses[i, : length - 1] = torch.randint(3, VOCAB, (length - 1,))
        responses[i, length - 1] = EOS
    rows = torch.tensor([5, 0, 7, 2, 6, 1, 4, 3])  # an update batch in shuffled order
    weights = torch.tensor([0.5, 1.5, 1.0, 0.0, 2.0, 1.0, 0.25, 1.75])  # per row of `rows` (RWR-like)
    accelerator = Accelerator(cpu=True)

    def weights_after_one_update(micro_batch_size: int) -> dict:
        model = tiny_lm(3)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        accelerator.gradient_accumulation_steps = 8 // micro_batch_size
        accelerator.step = 0  # micro-step counter of accelerate's accumulation, from a fresh update
        prepared, optimizer = accelerator.prepare(model, optimizer)
        prepared.train()
        args = SimpleNamespace(local_micro_batch_size=micro_batch_size,
                               gradient_accumulation_steps=8 // micro_batch_size)
        run = SimpleNamespace(accelerator=accelerator)
        run.guard = lambda update, **quantities: run_module.Run.guard(run, update, **quantities)
        loss, tokens = offline_rl.train_update(args, accelerator, prepared, optimizer, run, 1, queries, responses, rows,
                                               weights, PAD)
        return loss, tokens, {name: p.detach().clone()
                              for name, p in accelerator.unwrap_model(prepared).named_parameters()}

    start = dict(tiny_lm(3).named_parameters())
    loss_2, tokens_2, after_2 = weights_after_one_update(2)
    loss_8, tokens_8, after_8 = weights_after_one_update(8)
    assert tokens_2 == tokens_8 == int((queries != PAD).sum() + (responses != PAD).sum())
    assert loss_2 == pytest.approx(loss_8, rel=1e-6)
    moved = [name for name in start if not torch.equal(after_8[name], start[name].detach())]
    assert moved, "the update changed no weight"
    for name in start:
        torch.testing.assert_close(after_2[name], after_8[name], rtol=1e-5, atol=1e-7, msg=name)

    # the batch's weighted token mean, by hand, gives the same loss and the same gradient
    model = tiny_lm(3).train()
    hand = hand_token_nll(model, torch.cat((queries[rows], responses[rows]), 1), queries.size(1))
    num_tokens = sum(n for _, n in hand)
    assert loss_8 == pytest.approx(sum(w * nll for w, (nll, _) in zip(weights.tolist(), hand)) / num_tokens, rel=1e-5)
    query_responses = torch.cat((queries[rows], responses[rows]), 1)
    labels = offline_rl.response_labels(query_responses, queries.size(1), PAD)
    offline_rl.weighted_response_loss(model, query_responses, labels, weights, PAD)[0].backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(start[name].detach() - p.grad, after_8[name], rtol=1e-5, atol=1e-7, msg=name)

    # the mean of per-micro-batch token means (micro batches of 2) is another objective: its gradient differs
    model.zero_grad()
    for micro in range(0, 8, 2):
        part = slice(micro, micro + 2)
        loss, _ = offline_rl.weighted_response_loss(model, query_responses[part], labels[part], weights[part], PAD)
        (loss / 4).backward()
    differs = [name for name, p in model.named_parameters()
               if not torch.allclose(start[name].detach() - p.grad, after_2[name], rtol=1e-3, atol=1e-5)]
    assert differs, "per-micro-batch means would give the same update: the test cannot tell the two apart"


def test_gradient_accumulation_steps_is_checked_against_the_batch_sizes():
    args = offline_rl.Args(total_batch_size=16, local_micro_batch_size=4, gradient_accumulation_steps=2)
    args.world_size = 1
    with pytest.raises(ValueError, match=r"--gradient_accumulation_steps 2 does not match .* = 4"):
        flags_module.check_offline_flags(args, 4)
    args.gradient_accumulation_steps = 4
    flags_module.check_offline_flags(args, 4)  # the value the batch sizes give is accepted, as is None (derived)
    args.gradient_accumulation_steps = None
    flags_module.check_offline_flags(args, 4)


def test_dt_reward_prompt_format():
    assert offline_rl.dt_reward_prompt(1.26) == " <rm_score> 1.3"
    assert offline_rl.dt_reward_prompt(5) == " <rm_score> 5.0"
    assert offline_rl.dt_reward_prompt(-2.04) == " <rm_score> -2.0"
    assert offline_rl.dt_reward_prompt(-0.04) == " <rm_score> 0.0"  # no "-0.0"


def test_dt_percentile_targets_are_the_mixture_percentiles_as_the_prompt_writes_them():
    rewards = [x / 10 for x in range(-50, 51)]  # -5.0 ... 5.0
    targets = offline_rl.dt_percentile_targets(rewards, (10, 50, 90, 99))
    assert targets == {10.0: -4.0, 50.0: 0.0, 90.0: 4.0, 99.0: 4.9}
    assert str(offline_rl.dt_percentile_targets([-0.04, -0.02], (50,))[50.0]) == "0.0"  # one spelling of zero
    assert offline_rl.dt_percentile_targets(rewards, ()) == {}


def test_dt_prompt_identical_at_training_and_inference_and_masked_from_loss(synthetic_task):
    tokenizer = AutoTokenizer.from_pretrained(synthetic_task["base_model"])
    pad = tokenizer.pad_token_id
    query = "SUBREDDIT: r/test\n\nTITLE: a title\n\nPOST: my cat ate my homework.\n\nTL;DR:"
    response_text = " my cat ate my homework."
    response = tokenizer.encode(response_text) + [tokenizer.eos_token_id]
    responses = torch.tensor([response + [pad] * 3])

    # training: the sample's own reward; inference: the target. The same builder gives the same bytes.
    train_query = offline_rl.dt_queries(tokenizer, [query], [4.96], pad)
    infer_query = offline_rl.dt_queries(tokenizer, [query], [5.0], pad)
    assert torch.equal(train_query, infer_query)
    assert tokenizer.decode(infer_query[0]) == query + " <rm_score> 5.0"

    # the training sequence reads query + reward prompt + response, and only the response carries loss
    query_responses = torch.cat((offline_rl.dt_queries(tokenizer, [query], [1.26], pad), responses), 1)
    context_length = query_responses.size(1) - responses.size(1)
    assert tokenizer.decode(query_responses[0][query_responses[0] != pad], skip_special_tokens=True) == (
        query + " <rm_score> 1.3" + response_text
    )
    labels = offline_rl.response_labels(query_responses, context_length, pad)
    assert labels[0][labels[0] != -100].tolist() == response
    prompt_tokens = len(tokenizer.encode(query + " <rm_score> 1.3")) - len(tokenizer.encode(query))
    assert prompt_tokens > 0
    assert (labels[0, context_length - prompt_tokens : context_length] == -100).all()


def test_best_of_n_keeps_the_arg_max_per_prompt():
    n = 4
    scores = torch.tensor([0.1, 0.9, -0.3, 0.2, 5.0, -1.0, 4.9, 0.0, -2.0, -3.0, -1.5, -2.5])
    responses = torch.arange(12).unsqueeze(1).repeat(1, 3)  # row r holds the value r
    kept, best_scores, best = offline_rl.best_of_n_select(scores, responses, n)
    assert best.tolist() == [1, 0, 2]
    assert kept[:, 0].tolist() == [1, 4, 10]
    assert best_scores.tolist() == pytest.approx([0.9, 5.0, -1.5])


def test_generation_is_fixed_length_and_eos_can_appear():
    """Detail 23: exactly L new tokens come back, greedy or sampled, even when EOS is the likeliest token; [PAD] is
    never chosen (the one generation config of every script, sampling_config)."""
    model = tiny_lm()
    with torch.no_grad():  # make EOS the arg-max at every step
        model.gpt_neox.final_layer_norm.weight.zero_()
        model.gpt_neox.final_layer_norm.bias.fill_(1.0)
        model.get_output_embeddings().weight.zero_()
        model.get_output_embeddings().weight[EOS] = 10.0
    queries = torch.tensor([[PAD, 5, 6, 7], [8, 9, 10, 11]])
    tokenizer = types.SimpleNamespace(pad_token_id=PAD)
    for temperature in (0.0, 0.7):
        config = offline_rl.sampling_config(types.SimpleNamespace(response_length=6), tokenizer, temperature)
        assert config.do_sample == (temperature > 0) and config.suppress_tokens == [PAD]
        query_responses = offline_rl.generate(model, queries, PAD, config)
        responses = query_responses[:, 4:]
        assert responses.shape == (2, 6) and torch.equal(query_responses[:, :4], queries)
        assert not (responses == PAD).any()
        assert (responses == EOS).any(1).all()
        truncated = offline_rl.truncate_response(EOS, PAD, responses)
        first = offline_rl.first_true_indices(responses == EOS)
        for i in range(2):
            assert truncated[i, first[i]] == EOS and (truncated[i, first[i] + 1 :] == PAD).all()


def test_mixture_counts_follow_the_weights():
    assert offline_rl.mixture_counts(100, (1.0, 1.0, 1.0)) == (33, 33, 34)
    assert offline_rl.mixture_counts(10, (2.0, 0.0, 3.0)) == (4, 0, 6)
    with pytest.raises(ValueError):
        offline_rl.mixture_counts(10, (0.0, 0.0, 0.0))


# ------------------------------------------------------------------------------------------------
# Smoke runs: the base model stands in for the SFT model, an untrained one-label head for the RM.
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_setup(synthetic_task, tmp_path_factory):
    root = tmp_path_factory.mktemp("offline_rl")
    rm_path = str(root / "rm")
    rm = AutoModelForSequenceClassification.from_pretrained(synthetic_task["base_model"], num_labels=1)
    rm.save_pretrained(rm_path)
    AutoTokenizer.from_pretrained(synthetic_task["base_model"]).save_pretrained(rm_path)
    return {"root": root, "rm": rm_path, "task": synthetic_task}


def run_method(setup: dict, method: str, *extra: str) -> tuple[dict, str]:
    task, root = setup["task"], setup["root"]
    run_name = f"smoke_{method}"
    cmd = [
        sys.executable, os.path.join(REPO_ROOT, "offline_rl.py"), "--method", method,
        "--sft_model_path", task["base_model"], "--reward_model_path", setup["rm"],
        "--query_dataset", task["sft"], "--preference_dataset", task["preference"],
        "--response_length", str(task["task"]["sft_response_length"]),
        "--cache_dir", str(root / "cache"), "--run_dir_root", str(root / "runs"), "--run_name", run_name,
        "--output_dir", str(root / f"model_{method}"),
        "--mixture_size", "32", "--total_batch_size", "8", "--local_micro_batch_size", "4",
        "--num_eval_samples", "4", "--local_rollout_batch_size", "16", "--lr", "1e-4", *extra,
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = str(root / "runs" / run_name)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    samples = pd.read_csv(os.path.join(run_dir, "samples.csv"))
    assert list(samples.columns) == ["query", "response", "reference", "score", "response_token_len", "has_eos"]
    assert len(samples) == 4 and samples["score"].notna().all()
    assert os.path.exists(os.path.join(root, f"model_{method}", "model.safetensors"))
    for key in ("cost/generation_s", "cost/labelling_s", "cost/training_s", "wall_time_s"):
        assert summary[key] > 0, key
    # each update's wall time (issue 51): its training, which the summary's cost/training_s adds up
    train = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if "train/loss" in line]
    assert train and sum(m["time/update_s"] for m in train) == pytest.approx(summary["cost/training_s"])
    return summary, run_dir


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_smoke_dt_then_filter_and_rwr_reuse_the_cache(smoke_setup):
    summary, run_dir = run_method(smoke_setup, "dt", "--dt_eval_targets", "-5", "0", "5",
                                  "--dt_target_percentile", "90")
    assert summary["mixture/cache_hit"] == 0 and summary["mixture/size"] == 32
    for target in ("-5.0", "+0.0", "+5.0"):
        assert os.path.exists(os.path.join(run_dir, f"samples_target_{target}.csv"))
        assert f"eval/target_{target}/score" in summary
    # and at the 10th / 50th / 90th / 99th percentiles of the mixture's own normalised rewards
    at = [summary[f"dt/target_at_percentile_{p}"] for p in (10, 50, 90, 99)]
    assert at == sorted(at) and at[0] < at[-1], at
    for target in at:
        assert os.path.exists(os.path.join(run_dir, f"samples_target_{target:+.1f}.csv"))
        assert f"eval/target_{target:+.1f}/score" in summary
    # --dt_target_percentile 90: the inference target (the main table, samples.csv) is the 90th percentile
    target = summary["dt/target_at_percentile_90"]
    assert summary["dt/target"] == target == json.load(open(os.path.join(run_dir, "args.json")))["dt_target"]
    assert summary["eval/score"] == summary[f"eval/target_{target:+.1f}/score"]

    summary, _ = run_method(smoke_setup, "filter")
    assert summary["mixture/cache_hit"] == 1  # the same mixture arguments: no second labelling pass
    assert 0 < summary["filter/num_pass"] < 32

    summary, _ = run_method(smoke_setup, "rwr")
    assert summary["mixture/cache_hit"] == 1
    assert summary["train/updates"] == 4  # 32 samples / batch 8
    assert summary["budget/updates"] == 4 and summary["budget/rows_read"] == 32 == summary["mixture/size"]


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_smoke_best_of_n_two_iterations(smoke_setup):
    summary, run_dir = run_method(smoke_setup, "best_of_n", "--n", "2", "--bon_num_prompts", "8", "--iterations", "2")
    assert summary["train/updates"] == 2
    # the budget it claims (n x bon_num_prompts a round, 2 rounds) is what it sampled, every candidate counted
    assert summary["budget/responses_sampled"] == 2 * 8 * 2 and summary["budget/prompts"] == 16
    assert summary["budget/updates"] == 2 and summary["budget/rows_read"] == 16
    rounds = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))
              if "best_of_n/iteration" in line]
    assert [m["budget/responses_sampled"] for m in rounds] == [16, 32]
    for iteration in (1, 2):
        assert (summary[f"best_of_n/score_mean_best_iter{iteration}"]
                >= summary[f"best_of_n/score_mean_all_iter{iteration}"])


def test_lr_schedule_curves():
    for kind, expected in (("cosine", [1.0, 0.5, 0.0]), ("linear", [1.0, 0.5, 0.0]), ("constant", [1.0, 1.0, 1.0])):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        scheduler = offline_rl.lr_schedule(optimizer, kind, num_updates=4)
        seen = []
        for step in range(5):
            if step in (0, 2, 4):
                seen.append(scheduler.get_last_lr()[0] / 2.0)
            optimizer.step()
            scheduler.step()
        assert seen == pytest.approx(expected, abs=1e-9), kind


# ------------------------------------------------------------------------------------------------
# Checkpoints and bad input
# ------------------------------------------------------------------------------------------------
def resumable_command(setup: dict, root, run_name: str, *extra: str) -> list:
    """rwr on a 32-sample mixture: 3 passes of 4 updates (12 updates), evaluations at 4 and 8, checkpoints every 3."""
    task = setup["task"]
    return [
        sys.executable, os.path.join(REPO_ROOT, "offline_rl.py"), "--method", "rwr",
        "--sft_model_path", task["base_model"], "--reward_model_path", setup["rm"],
        "--query_dataset", task["sft"], "--preference_dataset", task["preference"],
        "--response_length", str(task["task"]["sft_response_length"]),
        "--cache_dir", str(root / "cache"), "--run_dir_root", str(root / "runs"), "--run_name", run_name,
        "--output_dir", str(root / f"model_{run_name}"),
        "--mixture_size", "32", "--total_batch_size", "8", "--local_micro_batch_size", "4", "--num_train_epochs", "3",
        "--num_eval_samples", "4", "--local_rollout_batch_size", "16", "--lr", "1e-4",
        "--eval_every", "4", "--checkpoint_every", "3", *extra,
    ]


def comparable(record: dict) -> dict:
    """A metrics line or summary without what may differ between two correct runs: wall-clock seconds and
    speeds (conftest's without_timing), and whether this process found the mixture in the cache."""
    return {k: v for k, v in without_timing(record).items() if k != "mixture/cache_hit"}


@pytest.mark.slow
def test_rwr_sigkill_then_resume_matches_an_uninterrupted_run(smoke_setup, tmp_path):
    runs = tmp_path / "runs"
    # the uninterrupted run (it also builds the cached mixture the other two reuse)
    run_ok(resumable_command(smoke_setup, tmp_path, "full"), cwd=REPO_ROOT, timeout=600)

    # the interrupted run: killed as soon as its update-3 checkpoint exists (mid-pass: the next update reads the
    # 4th batch of the saved permutation; 9 updates and 3 evaluations remain)
    checkpoint = runs / "killed" / "checkpoints" / "update_000003"
    kill_after_checkpoint(resumable_command(smoke_setup, tmp_path, "killed"), checkpoint,
                          cwd=REPO_ROOT)  # really killed mid-way, not finished
    assert checkpoint.is_dir() and not (runs / "killed" / "summary.json").exists()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["update"] == 3 and state["method"] == "rwr" and state["num_updates"] == 12

    resumed = run_ok(resumable_command(smoke_setup, tmp_path, "killed", "--resume"), cwd=REPO_ROOT, timeout=600)
    assert "update_000003" in resumed.stdout

    # the same final weights, bit for bit
    assert_same_safetensors(tmp_path / "model_full" / "model.safetensors",
                            tmp_path / "model_killed" / "model.safetensors")
    # the same metrics, line by line (the lines the killed run wrote after update 3 are replaced, not repeated)
    lines = {run: [comparable(json.loads(line)) for line in (runs / run / "metrics.jsonl").read_text().splitlines()]
             for run in ("full", "killed")}
    assert lines["killed"] == lines["full"]
    assert [line["step"] for line in lines["full"] if "train/loss" in line] == list(range(1, 13))
    summaries = {run: comparable(json.loads((runs / run / "summary.json").read_text())) for run in ("full", "killed")}
    assert summaries["killed"] == summaries["full"]
    assert pd.read_csv(runs / "killed" / "samples.csv").equals(pd.read_csv(runs / "full" / "samples.csv"))


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_non_finite_loss_stops_with_the_last_good_checkpoint(smoke_setup, tmp_path):
    # lr 1e30: update 1 is finite, its step throws the weights to inf, so update 2's loss is not finite
    result = subprocess.run(resumable_command(smoke_setup, tmp_path, "poisoned", "--lr", "1e30"), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "offline_rl.py: error: update 2: train/loss is not finite" in result.stderr
    assert_last_good_checkpoint(tmp_path / "runs" / "poisoned" / "checkpoints", 1)
    assert not (tmp_path / "model_poisoned" / "model.safetensors").exists()


@pytest.mark.slow
def test_resuming_from_the_non_finite_fallback_equals_resuming_from_the_ordinary_checkpoint(smoke_setup, tmp_path):
    """best_of_n, 3 rounds of 2 updates: a NaN RM score in round 2 (update 3), after the round has drawn its prompts and
    sampled its candidates. The run stops and saves the state after update 2 as its checkpoint (the weights, AdamW,
    the schedule, the data order, the RNG states, accelerate's micro-step count and the counters), the same as the
    ordinary checkpoint of update 2 of the same run without the NaN. Resumed from either, the run ends with the same
    weights and metrics."""
    runs = tmp_path / "runs"
    flags = ["--method", "best_of_n", "--n", "2", "--bon_num_prompts", "8", "--iterations", "3",
             "--num_train_epochs", "2",
             "--checkpoint_every", "1", "--checkpoint_keep", "0"]  # a checkpoint after every update, all kept
    poisoned = subprocess.run(with_nan_at(resumable_command(smoke_setup, tmp_path, "poisoned", *flags), update=3),
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert poisoned.returncode != 0 and "offline_rl.py: error: update 3: best_of_n/scores" in poisoned.stderr
    assert sorted(os.listdir(runs / "poisoned" / "checkpoints")) == ["update_000001", "update_000002"]
    run_ok(resumable_command(smoke_setup, tmp_path, "ordinary", *flags), cwd=REPO_ROOT, timeout=600)
    assert_same_checkpoint(runs / "ordinary" / "checkpoints" / "update_000002",
                           runs / "poisoned" / "checkpoints" / "update_000002")

    # both resumed from update 2: the ordinary run without its newer checkpoints
    for update in range(3, 6):
        shutil.rmtree(runs / "ordinary" / "checkpoints" / f"update_{update:06d}")
    for run in ("poisoned", "ordinary"):
        resumed = run_ok(resumable_command(smoke_setup, tmp_path, run, *flags, "--resume"), cwd=REPO_ROOT, timeout=600)
        assert "update_000002" in resumed.stdout
    assert_same_safetensors(tmp_path / "model_ordinary" / "model.safetensors",
                            tmp_path / "model_poisoned" / "model.safetensors")
    lines = {run: [comparable(json.loads(line)) for line in (runs / run / "metrics.jsonl").read_text().splitlines()]
             for run in ("ordinary", "poisoned")}
    assert lines["poisoned"] == lines["ordinary"]


def test_a_missing_column_is_one_clear_error(smoke_setup, tmp_path):
    from datasets import load_from_disk

    # a preference split without chosen_token_len, which the mixture reads to leave out too-long responses
    column = "chosen_token_len"
    splits = load_from_disk(smoke_setup["task"]["preference"])
    splits["train"] = splits["train"].remove_columns(column)
    broken = str(tmp_path / f"preference_without_{column}")
    splits.save_to_disk(broken)
    cmd = resumable_command(smoke_setup, tmp_path, "broken")
    cmd[cmd.index("--preference_dataset") + 1] = broken
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    # the error of check_columns: the split, the missing column and the fix, not a KeyError deep in a library
    assert last_line.startswith(
        f"offline_rl.py: error: {broken} split 'train' lacks the column(s) [{column!r}]"), last_line
    assert "data/prepare.py" in last_line
    # refused before anything was written: the output folder is not claimed, so a fixed rerun is not blocked
    assert not (tmp_path / "model_broken").exists() and not (tmp_path / "runs" / "broken" / "checkpoints").exists()
