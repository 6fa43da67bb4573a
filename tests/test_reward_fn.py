"""--reward_fn path.py:function ... (issue 53, item 1; issue 63, item 4): rewards from code in ppo.py, rloo.py, grpo.py,
reinforce_pp.py and online_dpo.py, written as TRL's GRPOTrainer calls them.

The built-in task's rule (data/synthetic.py key_fact_share) by hand on a hand-made post; every bad function's one
paragraph (it raises, with the row; a wrong count; a non-number; NaN; inf; a missing file or name, refused before any
model loads); the scorers' flags; the scripts' shared function_scores on a hand-made batch (the prompt rows' columns
reach the function, token columns do not); ppo.py's critic from the SFT model when no reward model is given; online
DPO's labels from the function; the leaderboard's stage. TRL's contract (issue 63, item 4): files written for TRL
(parameters in its order, in another order, async), the old positional form refused, several functions weighted with
their Nones skipped, a response no scorer scores given its group's mean (advantage 0), columns passed by content.
--reward_fn_timeout_min (issue 64, item 3): a call that never returns (sync or async, called off the main thread) is
one paragraph naming the function, its batch and the flag; a slow call within the limit gives the same scores.
Slow: a grpo.py run scored by the rule alone (no reward model), whose sample table's scores are the rule's values on
its responses, and a ppo.py run whose reward model and rule are joined by --reward_combine sum with --reward_weights,
checked by hand on its sample table."""

import json
import math
import os
import sys
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from conftest import ENV, load_script, run_ok

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from data.synthetic import gold_breakdown, key_fact_share  # noqa: E402
from rlhf_utils.checks import RunError, load_split  # noqa: E402
from rlhf_utils.flags import RunFlags  # noqa: E402
from rlhf_utils.rewards import load_reward_fn  # noqa: E402

grpo = load_script("grpo")
RULE = "data/synthetic.py:key_fact_share"

# ------------------------------------------------------------------------------------------------
# the built-in task's rule
# ------------------------------------------------------------------------------------------------
POST = ("i have been reading this sub for a long time. so yesterday mom sold cash and i do not know what to do.\n\n"
        "last week dad broke shoes without telling me. sorry for the long post.\n\n"
        "it turns out landlord hid plants a few days ago.")
QUERY = f"SUBREDDIT: r/tifu\n\nTITLE: what do i do now\n\nPOST: {POST}\n\nTL;DR:"


def test_the_rule_is_the_share_of_the_posts_key_facts_the_summary_states():
    """Three key facts in the post. The rule counts the ones a summary states, nothing else: an invented fact, filler,
    a missing period and length cost nothing, where the gold judge takes off for each."""
    summaries = {
        "mom sold cash, dad broke shoes and landlord hid plants.": 3 / 3,
        "mom sold cash and dad broke shoes.": 2 / 3,
        # two right, one invented (sister stole jewelry), filler, no period: still 2 of 3
        "basically mom sold cash lol and landlord hid plants and sister stole jewelry and then": 2 / 3,
        "nothing happened.": 0.0,
        "mom sold cash mom sold cash mom sold cash": 1 / 3,  # a fact said three times is one fact
    }
    assert key_fact_share([QUERY] * len(summaries), list(summaries)) == pytest.approx(list(summaries.values()))
    # the query's post alone counts: facts in the title or after TL;DR: are not the post's
    assert key_fact_share(["TITLE: mom sold cash\n\nPOST: nothing here.\n\nTL;DR:"], ["mom sold cash."]) == [0.0]
    # the rule rewards what the gold judge does not: the padded summary scores as the clean one on the rule, lower on
    # gold
    clean, padded = "mom sold cash and landlord hid plants.", list(summaries)[2]
    assert key_fact_share([QUERY, QUERY], [clean, padded]) == [2 / 3, 2 / 3]
    assert gold_breakdown(QUERY, padded).score < gold_breakdown(QUERY, clean).score
    assert gold_breakdown(QUERY, padded).invented == 1 and gold_breakdown(QUERY, padded).filler == 2


def test_the_rule_loads_as_a_reward_fn():
    """The rule is called by TRL's keywords, the columns with them."""
    fns = load_reward_fn([os.path.join(REPO_ROOT, RULE)])
    assert fns.weights == [1.0] and len(fns.fns) == 1
    assert fns.fns[0](prompts=[QUERY], completions=["dad broke shoes."], completion_ids=[[4, 5, 6]],
                      trainer_state=fns.trainer_state, reference_response=["x"]) == [pytest.approx(1 / 3)]


# ------------------------------------------------------------------------------------------------
# the scripts' copy of function_scores on a hand-made batch, and every bad function's paragraph
# ------------------------------------------------------------------------------------------------
FUNCTIONS = '''
import math

SEEN = []


def good(prompts, completions, answer, **kwargs):
    SEEN.append((list(prompts), list(completions), sorted(kwargs)))
    return [float(a in r) + 0.25 for r, a in zip(completions, answer)]


def raises_on_cash(completions, **kwargs):
    out = []
    for response in completions:
        if "cash" in response:
            raise ValueError("no cash here")
        out.append(1.0)
    return out


def raises_on_pairs(completions, **kwargs):
    if len(completions) > 1:
        raise RuntimeError("one at a time")
    return [1.0]


def too_few(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def not_a_number(completions, **kwargs):
    return [1.0, "high", 2.0]


def nan(completions, **kwargs):
    return [0.0, 0.5, math.nan]


def inf(completions, **kwargs):
    return [-math.inf, 0.5, 0.0]


def one_float(completions, **kwargs):
    return 1.0


def needs_a_column(completions, difficulty, **kwargs):
    return [1.0] * len(completions)


def old_style_with_columns(queries, responses, **columns):
    return [1.0] * len(responses)


def no_kwargs(prompts, completions):
    return [1.0] * len(completions)


NOT_A_FUNCTION = 3
'''
WORDS = ["[PAD]", "mom", "sold", "cash", "dad", "broke", "shoes", "query", "one", "two", "three"]


class WordTokenizer:
    """What function_scores reads of a tokenizer: batch_decode of token rows, [PAD] (id 0) skipped."""

    pad_token_id = 0

    def batch_decode(self, rows, skip_special_tokens):
        assert skip_special_tokens
        return [" " + " ".join(WORDS[i] for i in row.tolist() if i != 0) for row in rows]


def hand_batch():
    from datasets import Dataset

    queries = torch.tensor([[0, 7, 8], [7, 8, 8], [0, 0, 7]])  # left-padded
    responses = torch.tensor([[1, 2, 3], [4, 5, 0], [4, 5, 6]])  # right-padded
    # columns of token ids (lists of integers, whatever their name) are not passed; integers are, "_token" or not
    prompts = Dataset.from_dict({"query_token": [[1, 2]] * 5, "answer": ["a", "dad broke", "shoes", "zzz", "mom"],
                                 "query_reference_response_token_len": [2] * 5, "max_tokens": [10, 11, 12, 13, 14],
                                 "hint_ids": [[3, 4]] * 5})
    return queries, responses, prompts, [4, 3, 2]  # the prompt rows of the 3 responses


@pytest.fixture
def functions(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(FUNCTIONS)
    return str(path)


def scores_of(functions, name, fn=None):
    queries, responses, prompts, rows = hand_batch()
    scores = torch.tensor([[1.0], [2.0], [3.0]])  # a reward model's column
    return grpo.function_scores(scores, fn or load_reward_fn([f"{functions}:{name}"]), WordTokenizer(), queries,
                                responses, prompts, rows)


def test_function_scores_join_the_functions_column_with_the_rows_columns(functions, capsys):
    good = load_reward_fn([f"{functions}:good"])
    scores = scores_of(functions, "good", good)
    # the answers of rows 4, 3, 2: "mom" is in "mom sold cash", "zzz" not in "dad broke", "shoes" in "dad broke shoes"
    assert scores.tolist() == [[1.0, 1.25], [2.0, 0.25], [3.0, 1.25]] and scores.dtype == torch.float32
    seen = good.fns[0].__globals__["SEEN"]
    # decoded and stripped; TRL's keywords, and of the columns those that hold no token ids (the answer by name): the
    # integers max_tokens and query_reference_response_token_len are passed, the lists of ids query_token and
    # hint_ids are not, and the log says so once
    assert seen == [(["query one", "query one one", "query"], ["mom sold cash", "dad broke", "dad broke shoes"],
                     ["completion_ids", "max_tokens", "query_reference_response_token_len", "trainer_state"])]
    assert "the columns query_token, hint_ids are not passed to the functions" in capsys.readouterr().out
    scores_of(functions, "good", good)
    assert "are not passed" not in capsys.readouterr().out
    # no function: the reward models' scores as they are
    queries, responses, prompts, rows = hand_batch()
    assert grpo.function_scores(torch.ones(3, 2), None, WordTokenizer(), queries, responses, prompts,
                                rows).shape == (3, 2)


RAISE_LINE = FUNCTIONS.splitlines().index('            raise ValueError("no cash here")') + 1


@pytest.mark.parametrize("name, expected", [
    ("raises_on_cash", r"--reward_fn .*my_rewards.py:raises_on_cash raised ValueError: no cash here \(at "
                       rf".*my_rewards.py:{RAISE_LINE}\) on row 0 of the batch \(prompt='query one', "
                       r"completion='mom sold cash', answer='mom'"),
    ("raises_on_pairs", r"raises_on_pairs raised RuntimeError: one at a time on a batch of 3 responses, but on none of "
                        r"them alone"),
    ("too_few", r"too_few returned 2 values for a batch of 3 responses; it must return one finite number, or None "
                r"where it does not apply, per completion"),
    ("not_a_number", r"not_a_number returned 'high' \(str\), not a number for row 1 of the batch \(prompt='query one "
                     r"one', completion='dad broke'"),
    ("nan", r"nan returned nan for row 2 of the batch \(prompt='query', completion='dad broke shoes', "
            r"answer='shoes'"),
    ("inf", r"inf returned -inf for row 0 "),
    ("one_float", r"one_float returned float 1.0, not one number per response \(3 here\)"),
    # a parameter no keyword gives, or keywords a function without **kwargs cannot take: refused before the call
    ("needs_a_column", r"needs_a_column\(completions, difficulty, \*\*kwargs\) cannot be called with the keywords "
                       r".*missing a required argument: 'difficulty'.*fn\(prompts=\[...\], completions="),
    ("old_style_with_columns", r"old_style_with_columns\(queries, responses, \*\*columns\) cannot be called .*"
                               r"missing a required argument: 'queries'"),
    ("no_kwargs", r"no_kwargs\(prompts, completions\) cannot be called .*unexpected keyword argument"),
])
def test_a_bad_function_is_one_paragraph_naming_it_and_the_row(functions, name, expected):
    with pytest.raises(RunError, match=expected) as error:
        scores_of(functions, name)
    assert ("docs/usage.md" in str(error.value) or "TRL's GRPOTrainer" in str(error.value)) \
        and "\n" not in str(error.value)


def test_a_missing_file_or_name_is_refused_with_its_name(functions, tmp_path):
    with pytest.raises(RunError, match=r"--reward_fn .*nowhere.py:f: there is no file .*nowhere.py"):
        load_reward_fn(f"{tmp_path}/nowhere.py:f")
    with pytest.raises(RunError, match=r"my_rewards.py defines no function 'missing'; pass path.py:function"):
        load_reward_fn(f"{functions}:missing")
    with pytest.raises(RunError, match=r"defines no function 'NOT_A_FUNCTION' \('NOT_A_FUNCTION' is a int\)"):
        load_reward_fn(f"{functions}:NOT_A_FUNCTION")
    with pytest.raises(RunError, match=r"there is no file 'my_rewards'"):
        load_reward_fn("my_rewards")  # no path.py:function at all
    assert load_reward_fn(None) is None and load_reward_fn([]) is None


def small_args(script, tmp_path, **flags):
    module = load_script(script)
    return module, module.Args(sft_model_path=str(tmp_path / "no_model"), output_dir=str(tmp_path / "out"),
                               total_episodes=16, total_batch_size=8, local_micro_batch_size=2,
                               run=RunFlags(run_dir_root=str(tmp_path / "runs")), **flags)


@pytest.mark.parametrize("script", ["ppo", "rloo", "grpo", "online_dpo"])
@pytest.mark.parametrize("bad", ["file", "name"])
def test_a_missing_file_or_name_stops_the_run_before_any_model_loads(script, bad, functions, tmp_path):
    """No model exists at --sft_model_path: a run that got as far as loading one would fail there, not here. Nor is
    the run folder made."""
    spec = f"{tmp_path}/nowhere.py:good" if bad == "file" else f"{functions}:missing"
    judge = {"judge": "reward_fn"} if script == "online_dpo" else {}
    module, args = small_args(script, tmp_path, reward_fn=[spec], **judge)
    with pytest.raises(RunError, match="there is no file" if bad == "file" else "defines no function 'missing'"):
        module.main(args)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_the_scorers_flags(functions, tmp_path):
    """At least one scorer; --reward_weights one per scorer, the reward models' then the function's."""
    module, args = small_args("ppo", tmp_path, reward_model_path=[])
    with pytest.raises(RunError, match="no reward: pass --reward_model_path"):
        module.main(args)
    module, args = small_args("grpo", tmp_path, reward_fn=[f"{functions}:good", f"{functions}:too_few"],
                              reward_combine="sum", reward_weights=[0.5])
    with pytest.raises(RunError, match=r"one weight per scorer, each --reward_model_path then --reward_fn's functions "
                                       r"as one \(2\), got \[0.5\]"):
        module.main(args)
    # --reward_fn_weights: one per function, and only with functions
    module, args = small_args("rloo", tmp_path, reward_fn=[f"{functions}:good", f"{functions}:too_few"],
                              reward_fn_weights=[0.5, 1.0, 2.0])
    with pytest.raises(RunError, match=r"--reward_fn_weights needs one weight per --reward_fn function \(2: .*"
                                       r"my_rewards.py:good .*my_rewards.py:too_few\), got 3: \[0.5, 1.0, 2.0\]"):
        module.main(args)
    module, args = small_args("ppo", tmp_path, reward_fn_weights=[1.0])
    with pytest.raises(RunError, match=r"--reward_fn_weights \[1.0\] weighs --reward_fn functions, and there are none"):
        module.main(args)
    # online DPO: --judge reward_fn and --reward_fn go together
    for flags in ({"judge": "reward_fn"}, {"reward_fn": [f"{functions}:good"]}):
        module, args = small_args("online_dpo", tmp_path, **flags)
        with pytest.raises(RunError, match="--judge reward_fn labels each pair with the functions --reward_fn"):
            module.main(args)


# ------------------------------------------------------------------------------------------------
# ppo.py's critic without a reward model; online DPO's labels from the function
# ------------------------------------------------------------------------------------------------
def test_ppo_critic_starts_from_the_sft_model_without_a_reward_model(synthetic_task, capsys):
    """Detail 22's critic is the reward model; with --reward_fn alone there is none: the SFT model with a fresh scalar
    head, and the log says so."""
    from transformers import AutoModelForSequenceClassification

    ppo = load_script("ppo")
    base = synthetic_task["base_model"]
    tokenizer = ppo.load_tokenizer(base, False)
    critic = ppo.load_critic(ppo.Args(sft_model_path=base, reward_model_path=[], reward_fn=[RULE]), tokenizer)
    assert f"critic (Detail 22): a fresh scalar head on {base}" in capsys.readouterr().out
    sft = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    trunk = {k: v for k, v in sft.state_dict().items() if not k.startswith("score") and "embed" not in k}
    assert all(torch.equal(critic.state_dict()[k], v) for k, v in trunk.items()) and len(trunk) > 10


def test_online_dpo_labels_pairs_with_the_function(synthetic_task, tmp_path):
    """--judge reward_fn: each process scores its own prompts' two responses with the function (given the prompt rows'
    columns); the higher score is chosen, equal scores are a tie (EOS rule off here: every pair goes to the judge)."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    online = load_script("online_dpo")
    (tmp_path / "fn.py").write_text(
        "def length_and_reference(completions, reference_response, **kwargs):\n"
        "    return [len(r) + 0.5 * bool(ref) for r, ref in zip(completions, reference_response)]\n")
    fn = load_reward_fn([f"{tmp_path}/fn.py:length_and_reference"])
    base = synthetic_task["base_model"]
    args = online.Args(sft_model_path=base, judge="reward_fn", reward_fn=[f"{tmp_path}/fn.py:length_and_reference"],
                       pairs_per_round=6, local_rollout_forward_batch_size=4, response_length=8, non_eos_penalty=False)
    tokenizer = online.load_tokenizer(base, False)
    prompts = online.with_row_index(load_split(synthetic_task["sft"], "train"), ["query_token"])
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(base)
    guarded = []
    run = SimpleNamespace(guard=lambda update, **quantities: guarded.append(quantities))
    pairs = online.draw_pairs(args, Accelerator(cpu=True), run, policy, None, fn, prompts, tokenizer, 1, 1)
    texts = [[tokenizer.decode(r, skip_special_tokens=True).strip() for r in pair] for pair in pairs.responses]
    assert pairs.scores.tolist() == [[len(a) + 0.5, len(b) + 0.5] for a, b in texts]
    assert torch.equal(guarded[0]["online/scores"], pairs.scores)
    by_eos, _, asked = online.judged_pairs((pairs.responses == tokenizer.eos_token_id).any(2),
                                           (pairs.responses[:, 0] == pairs.responses[:, 1]).all(1), False)
    for i, (a, b) in enumerate(texts):
        if asked[i]:
            assert (pairs.keep[i] == (len(a) != len(b))
                    and (not pairs.keep[i] or pairs.chosen[i] == int(len(b) > len(a))))
    assert asked.any()


# ------------------------------------------------------------------------------------------------
# TRL's contract (issue 63, item 4): files written for TRL's GRPOTrainer run unchanged
# ------------------------------------------------------------------------------------------------
TRL_FILE = '''
import asyncio


def trl_style(completions, **kwargs):
    return [float(len(c)) for c in completions]


def trl_order(prompts, completions, completion_ids, **kwargs):
    return [1000 * len(p) + 10 * len(c) + sum(ids) for p, c, ids in zip(prompts, completions, completion_ids)]


def other_order(completion_ids, completions, prompts, **kw):
    return [1000 * len(p) + 10 * len(c) + sum(ids) for p, c, ids in zip(prompts, completions, completion_ids)]


async def awaited(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def steps(completions, trainer_state, **kwargs):
    return [trainer_state.global_step + trainer_state.epoch + trainer_state.max_steps] * len(completions)


def budget(completions, max_tokens, **kwargs):
    return [float(m) for m in max_tokens]


def old_style(queries, responses):
    return [1.0] * len(responses)
'''
# the hand batch (rows 4, 3, 2): prompts of 9, 13 and 5 characters, completions of 13, 9 and 15, token ids summing to
# 6, 9 and 15: 1000 x 9 + 10 x 13 + 6 and so on; any two of the three swapped give other numbers (or fail)
BY_HAND = [9136.0, 13099.0, 5165.0]


@pytest.fixture
def trl_file(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_FILE)
    return str(path)


@pytest.mark.parametrize("name, expected", [
    ("trl_style", [13.0, 9.0, 15.0]),
    ("trl_order", BY_HAND),  # TRL's documented order
    ("other_order", BY_HAND),  # the same parameters in another order: by keyword, the same values
    ("awaited", [13.0, 9.0, 15.0]),  # async def: awaited
    ("budget", [14.0, 13.0, 12.0]),  # a user's integer column max_tokens, rows 4, 3, 2
])
def test_a_function_written_for_trl_gets_its_keywords(trl_file, name, expected):
    scores = scores_of(trl_file, name)
    assert scores[:, 1].tolist() == expected and scores[:, 0].tolist() == [1.0, 2.0, 3.0]


def test_the_trainer_state_stand_in(trl_file):
    """The script sets global_step, epoch and max_steps before each update's rollout (RewardFunctions.at)."""
    fns = load_reward_fn([f"{trl_file}:steps"])
    assert scores_of(trl_file, "steps", fns)[:, 1].tolist() == [0.0] * 3  # before the first update
    fns.at(global_step=6, epoch=0.5, max_steps=20)
    assert scores_of(trl_file, "steps", fns)[:, 1].tolist() == [26.5] * 3
    assert fns.trainer_state.is_world_process_zero and not hasattr(fns.trainer_state, "log_history")


def test_the_positional_form_is_refused_at_load_naming_the_contract(trl_file):
    with pytest.raises(RunError, match=r"trl_rewards.py:old_style: old_style\(queries, responses\) takes neither "
                                       r"`completions` nor \*\*kwargs, so TRL's keywords cannot reach it: the contract "
                                       r"is fn\(prompts=\[...\], completions=\[...\], completion_ids=.*The positional "
                                       r"form fn\(queries, responses, \*\*columns\) is gone") as error:
        load_reward_fn([f"{trl_file}:trl_style", f"{trl_file}:old_style"])
    assert "\n" not in str(error.value)


# several functions: TRL's weighted sum, a None skipped; a response that no function and no reward model scores
def first(completions, **kwargs):
    return [1.0, None, 3.0, None, None, None]


def second(completions, **kwargs):
    return [2.0, None, None, None, None, None]


def grouped_batch():
    """Six responses in two groups of three (prompt rows 4 and 2), as a group method's rollout holds them."""
    queries, responses, prompts, _ = hand_batch()
    return queries.repeat(2, 1), responses.repeat(2, 1), prompts, [4, 4, 4, 2, 2, 2]


def test_several_functions_are_a_weighted_sum_with_their_nones_skipped(capsys):
    """--reward_fn first second --reward_fn_weights 0.5 2, by hand: response 0 is 0.5 x 1 + 2 x 2 = 4.5, response 2
    is 0.5 x 3 = 1.5 (second's None skipped). Beside a reward model, a response no function scores has the functions'
    score 0 (TRL's sum over nothing); alone, it takes the mean of its group's scored responses, (4.5 + 1.5) / 2 = 3,
    and a group none scores is 0: GRPO's and RLOO's advantages of each such response are 0, a line counts them."""
    from rlhf_utils.rewards import RewardFunctions

    rloo = load_script("rloo")
    queries, responses, prompts, rows = grouped_batch()
    fns = RewardFunctions([first, second], [0.5, 2.0])
    with_rm = grpo.function_scores(torch.full((6, 1), 7.0), fns, WordTokenizer(), queries, responses, prompts, rows)
    assert with_rm[:, 1].tolist() == [4.5, 0.0, 1.5, 0.0, 0.0, 0.0] and "scored by no function" not in \
        capsys.readouterr().out
    alone = grpo.function_scores(torch.zeros((6, 0)), fns, WordTokenizer(), queries, responses, prompts, rows)
    assert alone[:, 0].tolist() == [4.5, 3.0, 1.5, 0.0, 0.0, 0.0]
    assert "4 of 6 responses were scored by no function (each returned None) and no reward model (4 so far)" in \
        capsys.readouterr().out
    for advantages in (grpo.grpo_advantages(alone[:, 0], 3, "group", None), rloo.rloo_advantages(alone[:, 0], 3)):
        assert advantages[1].item() == 0.0 and advantages[3:].tolist() == [0.0] * 3
        assert advantages[0].item() > 0 > advantages[2].item()
    # online DPO's pairs are groups of two: an unscored response ties with its pair's, which drops the pair
    pairs = load_script("online_dpo").function_scores(torch.zeros((6, 0)), fns, WordTokenizer(), queries,
                                                      responses, prompts, [4, 4, 3, 3, 2, 2])
    assert pairs.view(-1, 2).tolist() == [[4.5, 4.5], [1.5, 1.5], [0.0, 0.0]]


# ------------------------------------------------------------------------------------------------
# the leaderboard's stage
# ------------------------------------------------------------------------------------------------
def test_the_leaderboard_runs_grpo_with_the_rule_alone_at_grpos_budget(tmp_path):
    import pipeline
    import report

    p = pipeline.Pipeline(pipeline.Args(mode="leaderboard", out=str(tmp_path / "out")))
    assert p.stages[p.stages.index("grpo") + 1] == "grpo_rule" and "grpo_rule" in p.policies_order()
    rule, grpo_cmd = p.command("grpo_rule"), p.command("grpo")
    assert rule[1].endswith("/grpo.py") and rule[rule.index("--reward_fn") + 1] == RULE
    # an empty --reward_model_path: no reward model loads
    assert rule[rule.index("--reward_model_path") + 1] == "--query_dataset"
    assert "--reward_fn" not in grpo_cmd
    for flag in ("--total_episodes", "--total_batch_size", "--eval_split", "--num_eval_samples"):
        assert rule[rule.index(flag) + 1] == grpo_cmd[grpo_cmd.index(flag) + 1], flag
    assert report.NAMES["grpo_rule"] == "GRPO (rule reward)"
    assert "grpo_rule" in pipeline.Pipeline(pipeline.Args(mode="ci", out=str(tmp_path / "ci"))).stages


# ------------------------------------------------------------------------------------------------
# runs on the built-in task
# ------------------------------------------------------------------------------------------------
def run_flags(synthetic_task, tmp_path, script, *extra):
    task = json.load(open(synthetic_task["task_json"]))
    return [sys.executable, os.path.join(REPO_ROOT, script), "--sft_model_path", synthetic_task["base_model"],
            "--query_dataset", synthetic_task["sft"], "--response_length", str(task["sft_response_length"]),
            "--total_episodes", "8", "--total_batch_size", "8", "--local_micro_batch_size", "4",
            "--local_rollout_forward_batch_size", "8", "--num_eval_samples", "8", "--eval_every", "0",
            "--output_dir", str(tmp_path / "policy"), "--run_dir_root", str(tmp_path / "runs"), "--run_name", "fn",
            "--print_sample_every", "0", "--reward_fn", RULE, *extra]


def rule_of(table: pd.DataFrame) -> list:
    return key_fact_share(list(table["query"]), [r if isinstance(r, str) else "" for r in table["response"]])


@pytest.mark.slow
def test_grpo_scored_by_the_rule_alone(synthetic_task, tmp_path):
    """No reward model: the eval table's score of each response is the rule's value on it, and the function's time is
    logged as a part of the scoring time."""
    run_ok(run_flags(synthetic_task, tmp_path, "grpo.py", "--reward_model_path", "--grpo.num_ppo_epochs", "1"),
           cwd=REPO_ROOT, env=ENV)
    run_dir = tmp_path / "runs" / "fn"
    assert json.load(open(run_dir / "args.json"))["reward_model_path"] == []
    table = pd.read_csv(run_dir / "samples.csv")
    assert len(table) == 8 and "score_rm0" not in table.columns
    assert table["score"].tolist() == pytest.approx(rule_of(table), abs=1e-6)
    train = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if "grpo/val/ratio" in line]
    assert len(train) == 1 and 0 < train[0]["time/reward_fn_share"] <= train[0]["time/scoring_share"]
    assert -1.0 <= train[0]["objective/scores"] <= 1.0  # the rule's share, or the EOS trick's -1


@pytest.mark.slow
def test_ppo_joins_a_reward_model_and_the_rule_by_weighted_sum(synthetic_task, tmp_path):
    """--reward_combine sum --reward_weights 0.5 2: each eval row's score is 0.5 x the reward model's + 2 x the rule's,
    the rule's column its value on the response (by hand from the table's texts)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(synthetic_task["base_model"], num_labels=1).save_pretrained(
        tmp_path / "rm")
    AutoTokenizer.from_pretrained(synthetic_task["base_model"]).save_pretrained(tmp_path / "rm")
    run_ok(run_flags(synthetic_task, tmp_path, "ppo.py", "--reward_model_path", str(tmp_path / "rm"),
                     "--reward_combine", "sum", "--reward_weights", "0.5", "2", "--ppo.num_ppo_epochs", "1"),
           cwd=REPO_ROOT, env=ENV)
    table = pd.read_csv(tmp_path / "runs" / "fn" / "samples.csv")
    assert table["score_rm1"].tolist() == pytest.approx(rule_of(table), abs=1e-6)
    assert table["score"].tolist() == pytest.approx((0.5 * table["score_rm0"] + 2 * table["score_rm1"]).tolist(),
                                                    abs=1e-5)
    assert table["score_rm0"].std() > 0 and not math.isnan(table["score_rm0"].iloc[0])


# --reward_fn_timeout_min (issue 64, item 3): a call that never returns stops the run with one paragraph; a slow call
# within the limit changes nothing. The limit is in minutes; these tests give it fractions of a second.
SLOW_FILE = '''
import asyncio
import threading
import time

RELEASE = threading.Event()  # set by the test when it is done: the stuck calls' threads end with it


def hangs(completions, **kwargs):
    RELEASE.wait()
    return [1.0] * len(completions)


async def hangs_async(completions, **kwargs):
    while not RELEASE.is_set():
        await asyncio.sleep(0.02)
    return [1.0] * len(completions)


def slow(completions, **kwargs):
    time.sleep(0.3)
    return [float(len(r)) for r in completions]


async def slow_async(completions, **kwargs):
    await asyncio.sleep(0.3)
    return [float(len(r)) for r in completions]


def fast(completions, **kwargs):
    return [float(len(r)) for r in completions]
'''


@pytest.fixture
def slow_file(tmp_path):
    path = tmp_path / "slow_rewards.py"
    path.write_text(SLOW_FILE)
    yield str(path)
    sys.modules.pop("slow_rewards", None)


@pytest.mark.parametrize("name", ["hangs", "hangs_async"])
def test_a_function_that_never_returns_is_one_paragraph_naming_it_the_batch_and_the_flag(slow_file, name, tmp_path):
    import threading
    import time

    from datasets import Dataset, DatasetDict

    fns = load_reward_fn([f"{slow_file}:{name}"], timeout_min=0.2 / 60)  # 0.2 s
    fns.at(global_step=6, epoch=0.5, max_steps=20)
    queries, responses, prompts, rows = hand_batch()
    evaluation = Dataset.from_dict(prompts.to_dict(), split="validation")  # a split that names itself
    results = {}

    def off_the_main_thread():  # as under a launcher's worker thread: signal.alarm could not work here
        try:
            grpo.function_scores(torch.zeros((3, 0)), fns, WordTokenizer(), queries, responses, evaluation, rows)
        except RunError as error:
            results["error"] = error

    started = time.monotonic()
    caller = threading.Thread(target=off_the_main_thread)
    caller.start()
    caller.join(4)
    try:
        assert not caller.is_alive() and time.monotonic() - started < 2
        assert str(results["error"]) == (
            f"--reward_fn {slow_file}:{name} did not return within --reward_fn_timeout_min {0.2 / 60:g} (minutes) on "
            "prompt rows 2-4 of the 'validation' split, at optimizer step 6 of 20 (trainer_state.global_step); a "
            "function that waits on something that never answers (a network call without its own timeout) stops the "
            "run: give its calls a timeout, or raise --reward_fn_timeout_min for a function that is slow by design")
        # no split name
        with pytest.raises(RunError, match=r"on prompt rows 2-4 of the prompts, at optimizer step 6 of 20"):
            grpo.function_scores(torch.zeros((3, 0)), fns, WordTokenizer(), queries, responses, prompts, rows)
        # a split as data/prepare.py saves it, read back with load_split: named by its folder (its split is None)
        DatasetDict(validation=prompts).save_to_disk(str(tmp_path / "data"))
        saved = load_split(str(tmp_path / "data"), "validation").with_format(None)
        with pytest.raises(RunError, match=rf"on prompt rows 2-4 of {tmp_path / 'data' / 'validation'}, at optimizer"):
            grpo.function_scores(torch.zeros((3, 0)), fns, WordTokenizer(), queries, responses, saved, rows)
    finally:
        fns.fns[0].__globals__["RELEASE"].set()


def test_the_batch_a_stuck_call_names():
    """A shuffled draw's rows (a tensor, a group's rows repeated) are named by the first few; a range as a range."""
    from rlhf_utils.rewards import TrainerState, batch_of

    state = TrainerState(global_step=3, max_steps=9)
    assert batch_of(None, torch.tensor([9, 1, 1, 5]), state) == (
        "prompt rows 1, 5, 9 (3) of the prompts, at optimizer step 3 of 9 (trainer_state.global_step)")
    assert batch_of(None, list(range(20, 0, -2)), state).startswith("prompt rows 2, 4, 6, 8, 10, 12, ... (10) of")
    assert batch_of(None, range(96, 112), state).startswith("prompt rows 96-111 of the prompts")


@pytest.mark.parametrize("name", ["slow", "slow_async"])
def test_a_slow_call_within_the_limit_changes_nothing(slow_file, name):
    queries, responses, prompts, rows = hand_batch()
    expected = grpo.function_scores(torch.zeros((3, 0)), load_reward_fn([f"{slow_file}:fast"]), WordTokenizer(),
                                    queries, responses, prompts, rows)
    assert expected[:, 0].tolist() == [13.0, 9.0, 15.0]  # len("mom sold cash"), len("dad broke"), ...
    for minutes in (1.5 / 60, None):  # 1.5 s for a 0.3 s call, or no limit
        fns = load_reward_fn([f"{slow_file}:{name}"], timeout_min=minutes)
        got = grpo.function_scores(torch.zeros((3, 0)), fns, WordTokenizer(), queries, responses, prompts, rows)
        assert torch.equal(got, expected)


def test_the_timeout_must_be_positive(slow_file):
    for minutes in (0, -1.0):
        with pytest.raises(RunError, match=rf"--reward_fn_timeout_min {minutes} is how many minutes .* pass a "
                                           r"positive number"):
            load_reward_fn([f"{slow_file}:fast"], timeout_min=minutes)


def test_an_exception_in_the_worker_thread_keeps_its_row_and_line(functions):
    """The function runs in a worker thread; what it raises is still named with its row and its file's line."""
    with pytest.raises(RunError, match=rf"raises_on_cash raised ValueError: no cash here \(at .*my_rewards.py:"
                                       rf"{RAISE_LINE}\) on row 0 of the batch"):
        scores_of(functions, "raises_on_cash", load_reward_fn([f"{functions}:raises_on_cash"], timeout_min=1.0))
