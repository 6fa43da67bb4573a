"""--reward_fn path.py:function (issue 53, item 1): a reward from code in ppo.py, rloo.py, grpo.py and online_dpo.py.

The built-in task's rule (data/synthetic.py key_fact_share) by hand on a hand-made post; every bad function's one
paragraph (it raises, with the row; a wrong count; a non-number; NaN; inf; a missing file or name, refused before any
model loads); the scorers' flags; the scripts' shared function_scores on a hand-made batch (the prompt rows' columns
reach the function, token columns do not); ppo.py's critic from the SFT model when no reward model is given; online
DPO's labels from the function; the leaderboard's stage. Slow: a grpo.py run scored by the rule alone (no reward
model), whose sample table's scores are the rule's values on its responses, and a ppo.py run whose reward model and
rule are joined by --reward_combine sum with --reward_weights, checked by hand on its sample table."""

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
    fn = load_reward_fn(os.path.join(REPO_ROOT, RULE))
    assert fn([QUERY], ["dad broke shoes."], reference_response=["x"]) == [pytest.approx(1 / 3)]


# ------------------------------------------------------------------------------------------------
# the scripts' copy of function_scores on a hand-made batch, and every bad function's paragraph
# ------------------------------------------------------------------------------------------------
FUNCTIONS = '''
import math

SEEN = []


def good(queries, responses, answer, **columns):
    SEEN.append((list(queries), list(responses), sorted(columns)))
    return [float(a in r) + 0.25 for r, a in zip(responses, answer)]


def raises_on_cash(queries, responses, **columns):
    out = []
    for response in responses:
        if "cash" in response:
            raise ValueError("no cash here")
        out.append(1.0)
    return out


def raises_on_pairs(queries, responses, **columns):
    if len(responses) > 1:
        raise RuntimeError("one at a time")
    return [1.0]


def too_few(queries, responses, **columns):
    return [1.0] * (len(responses) - 1)


def not_a_number(queries, responses, **columns):
    return [1.0, "high", 2.0]


def nan(queries, responses, **columns):
    return [0.0, 0.5, math.nan]


def inf(queries, responses, **columns):
    return [-math.inf, 0.5, 0.0]


def one_float(queries, responses, **columns):
    return 1.0


NOT_A_FUNCTION = 3
'''
WORDS = ["[PAD]", "mom", "sold", "cash", "dad", "broke", "shoes", "query", "one", "two", "three"]


class WordTokenizer:
    """What function_scores reads of a tokenizer: batch_decode of token rows, [PAD] (id 0) skipped."""

    def batch_decode(self, rows, skip_special_tokens):
        assert skip_special_tokens
        return [" " + " ".join(WORDS[i] for i in row.tolist() if i != 0) for row in rows]


def hand_batch():
    from datasets import Dataset

    queries = torch.tensor([[0, 7, 8], [7, 8, 8], [0, 0, 7]])  # left-padded
    responses = torch.tensor([[1, 2, 3], [4, 5, 0], [4, 5, 6]])  # right-padded
    prompts = Dataset.from_dict({"query_token": [[1, 2]] * 5, "answer": ["a", "dad broke", "shoes", "zzz", "mom"],
                                 "query_reference_response_token_len": [2] * 5})
    return queries, responses, prompts, [4, 3, 2]  # the prompt rows of the 3 responses


@pytest.fixture
def functions(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(FUNCTIONS)
    return str(path)


def scores_of(functions, name, fn=None):
    queries, responses, prompts, rows = hand_batch()
    scores = torch.tensor([[1.0], [2.0], [3.0]])  # a reward model's column
    return grpo.function_scores(scores, fn or load_reward_fn(f"{functions}:{name}"), WordTokenizer(), queries,
                                responses, prompts, rows)


def test_function_scores_join_the_functions_column_with_the_rows_columns(functions):
    good = load_reward_fn(f"{functions}:good")
    scores = scores_of(functions, "good", good)
    # the answers of rows 4, 3, 2: "mom" is in "mom sold cash", "zzz" not in "dad broke", "shoes" in "dad broke shoes"
    assert scores.tolist() == [[1.0, 1.25], [2.0, 0.25], [3.0, 1.25]] and scores.dtype == torch.float32
    seen = good.__globals__["SEEN"]
    assert seen == [(["query one", "query one one", "query"], ["mom sold cash", "dad broke", "dad broke shoes"],
                     [])]  # decoded and stripped; of the columns only the answer, which good() names (no token ids)
    # no function: the reward models' scores as they are
    queries, responses, prompts, rows = hand_batch()
    assert grpo.function_scores(torch.ones(3, 2), None, WordTokenizer(), queries, responses, prompts,
                                rows).shape == (3, 2)


RAISE_LINE = FUNCTIONS.splitlines().index('            raise ValueError("no cash here")') + 1


@pytest.mark.parametrize("name, expected", [
    ("raises_on_cash", r"--reward_fn .*my_rewards.py:raises_on_cash raised ValueError: no cash here \(at "
                       rf".*my_rewards.py:{RAISE_LINE}\) on row 0 of the batch \(query='query one', "
                       r"response='mom sold cash', answer='mom'"),
    ("raises_on_pairs", r"raises_on_pairs raised RuntimeError: one at a time on a batch of 3 responses, but on none of "
                        r"them alone"),
    ("too_few", r"too_few returned 2 values for a batch of 3 responses; it must return one finite number per response"),
    ("not_a_number", r"not_a_number returned 'high' \(str\), not a number for row 1 of the batch \(query='query one "
                     r"one', response='dad broke'"),
    ("nan", r"nan returned nan for row 2 of the batch \(query='query', response='dad broke shoes', answer='shoes'"),
    ("inf", r"inf returned -inf for row 0 "),
    ("one_float", r"one_float returned float 1.0, not one number per response \(3 here\)"),
])
def test_a_bad_function_is_one_paragraph_naming_it_and_the_row(functions, name, expected):
    with pytest.raises(RunError, match=expected) as error:
        scores_of(functions, name)
    assert "docs/usage.md" in str(error.value) and "\n" not in str(error.value)


def test_a_missing_file_or_name_is_refused_with_its_name(functions, tmp_path):
    with pytest.raises(RunError, match=r"--reward_fn .*nowhere.py:f: there is no file .*nowhere.py"):
        load_reward_fn(f"{tmp_path}/nowhere.py:f")
    with pytest.raises(RunError, match=r"my_rewards.py defines no function 'missing'; pass path.py:function"):
        load_reward_fn(f"{functions}:missing")
    with pytest.raises(RunError, match=r"defines no function 'NOT_A_FUNCTION' \('NOT_A_FUNCTION' is a int\)"):
        load_reward_fn(f"{functions}:NOT_A_FUNCTION")
    with pytest.raises(RunError, match=r"there is no file 'my_rewards'"):
        load_reward_fn("my_rewards")  # no path.py:function at all
    assert load_reward_fn(None) is None


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
    module, args = small_args(script, tmp_path, reward_fn=spec, **judge)
    with pytest.raises(RunError, match="there is no file" if bad == "file" else "defines no function 'missing'"):
        module.main(args)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_the_scorers_flags(functions, tmp_path):
    """At least one scorer; --reward_weights one per scorer, the reward models' then the function's."""
    module, args = small_args("ppo", tmp_path, reward_model_path=[])
    with pytest.raises(RunError, match="no reward: pass --reward_model_path"):
        module.main(args)
    module, args = small_args("grpo", tmp_path, reward_fn=f"{functions}:good", reward_combine="sum",
                              reward_weights=[0.5])
    with pytest.raises(RunError, match=r"one weight per scorer, each --reward_model_path then --reward_fn \(2\), got "
                                       r"\[0.5\]"):
        module.main(args)
    # online DPO: --judge reward_fn and --reward_fn go together
    for flags in ({"judge": "reward_fn"}, {"reward_fn": f"{functions}:good"}):
        module, args = small_args("online_dpo", tmp_path, **flags)
        with pytest.raises(RunError, match="--judge reward_fn labels each pair with the function --reward_fn"):
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
    critic = ppo.load_critic(ppo.Args(sft_model_path=base, reward_model_path=[], reward_fn=RULE), tokenizer)
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
        "def length_and_reference(queries, responses, reference_response, **columns):\n"
        "    return [len(r) + 0.5 * bool(ref) for r, ref in zip(responses, reference_response)]\n")
    fn = load_reward_fn(f"{tmp_path}/fn.py:length_and_reference")
    base = synthetic_task["base_model"]
    args = online.Args(sft_model_path=base, judge="reward_fn", reward_fn=f"{tmp_path}/fn.py:length_and_reference",
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
