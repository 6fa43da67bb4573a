"""The recipe lines of grpo.py's variants, read as docs/usage.md prints them ("GRPO's variants: Dr. GRPO, DAPO,
GSPO"; grpo.py's docstring prints the same), parsed by tyro as the script parses its flags: each sets what its paper
changes and nothing else, and each of those settings changes the update that grpo_update makes from a fixed rollout
(a bigram policy, in this process), the dynamic sampling that DAPO adds aside. With one optimizer step per rollout
GSPO's sequence ratio and DAPO's upper clip are idle (the update is GRPO's, and a line says so); with the recipes'
minibatches the ratio moves. Last, what DAPO's dynamic sampling compares: the score, or the --reward_fn value."""

import dataclasses
import re
import shlex
import sys
import types

import pytest
import torch
import tyro

from conftest import REPO_ROOT, bigram_policy, load_script
from rlhf_utils.flags import RunFlags, note_idle_ratio

grpo = load_script("grpo")
sys.modules["grpo"] = grpo  # tyro reads the docstrings of nested dataclasses through the module

NAMES = ("Dr. GRPO", "DAPO", "GSPO")


def doc_recipes() -> dict:
    """name -> flags of each recipe line of the docs' bash block (the model paths, "...", left out)."""
    text = open(f"{REPO_ROOT}/docs/usage.md").read()
    section = text[text.index("## GRPO's variants: Dr. GRPO, DAPO, GSPO"):]
    block = section[section.index("```bash") + len("```bash"): section.index("```\n", section.index("```bash") + 7)]
    recipes = {}
    for line in block.replace("\\\n", " ").strip().splitlines():
        command, name = line.split("#")
        words = shlex.split(command)
        assert words[:3] == ["python", "grpo.py", "..."], line
        recipes[name.strip()] = words[3:]
    return recipes


def docstring_recipes() -> dict:
    """name -> flags of each recipe line of grpo.py's module docstring (a name, then flags; more on the next lines)."""
    lines = grpo.__doc__[grpo.__doc__.index("Later work:"): grpo.__doc__.index("After a crash:")].splitlines()[1:]
    recipes, name = {}, None
    for line in lines:
        start = re.match(r"  (\S.*?)\s{2,}(--.*)", line)
        if start:
            name, flags = start.groups()
            recipes[name] = []
        else:
            flags = line.strip()
        recipes[name] += shlex.split(flags)
    return recipes


def parsed(flags: list):
    """Args from flags, as grpo.py's __main__ parses them."""
    return tyro.cli(grpo.Args, args=flags, use_underscores=True)


def test_the_docs_and_grpo_docstring_print_the_same_recipes():
    assert doc_recipes() == docstring_recipes()
    assert tuple(doc_recipes()) == NAMES


def changed(args) -> dict:
    """The flags whose values differ from plain GRPO's (the defaults), by name."""
    plain, out = grpo.Args(), {}
    for group, default in ((args, plain), (args.grpo, plain.grpo)):
        for f in dataclasses.fields(default):
            if f.name != "grpo" and getattr(group, f.name) != getattr(default, f.name):
                out[f.name] = getattr(group, f.name)
    return out


def test_each_recipe_sets_what_its_paper_changes_and_nothing_else():
    """Dr. GRPO: no std, the constant normaliser. DAPO: clip-higher, the token mean, the overlong buffer, dynamic
    sampling, no KL term, minibatches so that the clip acts. GSPO: the sequence ratio, minibatches, no KL term. Each
    runs at the default batch sizes (the batch arithmetic holds) and moves its ratio: no line at start."""
    recipes = {name: parsed(flags) for name, flags in doc_recipes().items()}
    dr, dapo, gspo = (recipes[name].grpo for name in NAMES)
    assert set(changed(recipes["Dr. GRPO"])) == {"advantage_std", "loss_normalizer"}
    assert dr.advantage_std == "none" and dr.loss_normalizer == "constant"
    assert set(changed(recipes["DAPO"])) == {"clip_high", "loss_normalizer", "kl_coef", "max_draws_per_update",
                                             "overlong_buffer", "num_mini_batches"}
    assert dapo.clip_high > dapo.cliprange and dapo.loss_normalizer == "batch_token_mean" and dapo.kl_coef == 0
    assert dapo.overlong_buffer > 0 and dapo.max_draws_per_update > 1 and dapo.num_mini_batches > 1
    assert set(changed(recipes["GSPO"])) == {"ratio_level", "num_mini_batches", "kl_coef"}
    assert gspo.ratio_level == "sequence" and gspo.num_mini_batches * gspo.num_ppo_epochs > 1 and gspo.kl_coef == 0
    said = []
    for args in recipes.values():
        grpo.batch_arithmetic(args, args.grpo, 1)
        note_idle_ratio(args.grpo, said.append)
    assert said == []


# ------------------------------------------------------------------------------------------------
# The update from a fixed rollout
# ------------------------------------------------------------------------------------------------
VOCAB, PAD, EOS, QUERY = 12, 11, 3, 3
BATCH, MICRO = 32, 2  # 8 groups of 4 (the default group size); batch sizes are no recipe's setting


def fixed_rollout(args):
    """The rollout the update trains on, the same for every recipe: responses of response_length (53) tokens whose
    EOS comes at 5 to 53 tokens, a quarter without one; scores drawn once; the reference a perturbed table, so the KL
    term has a gradient; logprobs the policy's own at temperature 0.7 (the first ratio is exactly 1)."""
    T = args.response_length
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, VOCAB, generator=generator)
    ref_table = table + 0.5 * torch.randn(VOCAB, VOCAB, generator=generator)
    queries = torch.randint(4, PAD, (BATCH // args.group_size, QUERY), generator=generator)
    raw = torch.randint(4, PAD, (BATCH, T), generator=generator)  # neither [PAD] nor EOS
    eos_at = torch.randint(4, T, (BATCH,), generator=generator)
    with_eos = torch.arange(BATCH) % 4 != 3
    raw[with_eos, eos_at[with_eos]] = EOS
    query_responses = torch.cat((queries.repeat_interleave(args.group_size, 0), raw), 1)
    with torch.no_grad():
        logprobs, ref_logprobs = (
            grpo.training_logprobs(bigram_policy(t), query_responses, QUERY, args.temperature, PAD)[0]
            for t in (table, ref_table))
    data = grpo.Rollout(query_responses=query_responses, responses=grpo.truncate_response(EOS, PAD, raw),
                        logprobs=logprobs, ref_logprobs=ref_logprobs,
                        rm_scores=torch.randn(BATCH, 1, generator=generator))
    return table, data


def update(flags: list = (), **grpo_settings):
    """The change grpo_update (after rewards_and_advantages) makes to the policy's table from the fixed rollout, and
    its statistics; the recipe's flags, parsed, then `grpo_settings` replacing some of its --grpo.* values. SGD, so
    that the step is the gradient itself (AdamW's first step would be its sign)."""
    from accelerate import Accelerator

    args = parsed([*flags, "--total_batch_size", str(BATCH), "--local_micro_batch_size", str(MICRO)])
    hp = dataclasses.replace(args.grpo, **grpo_settings)
    _, gradient_accumulation_steps, _ = grpo.batch_arithmetic(args, hp, 1)
    table, data = fixed_rollout(args)
    accelerator = Accelerator(cpu=True)  # its own, so that its count of micro batches starts at 0
    accelerator.gradient_accumulation_steps = gradient_accumulation_steps
    model = bigram_policy(table)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=3.0))
    scored = grpo.rewards_and_advantages(args, hp, data, EOS, PAD, [], lambda x: x)
    ptx = grpo.PtxData(0.0, args, None, 0, 1, 1)
    torch.manual_seed(0)  # the update's permutation, the same for every recipe
    stats = grpo.grpo_update(args, hp, accelerator, model, optimizer, data, scored, 1, lambda *_, **__: None, ptx,
                             hp.kl_coef, PAD)
    return model.table.detach() - table, stats


def differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).norm() > 1e-2 * b.norm())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).norm() <= 1e-5 * b.norm())


@pytest.fixture(scope="module")
def plain():
    return update()[0]


@pytest.mark.parametrize("name", NAMES)
def test_each_recipe_updates_otherwise_than_grpo_and_each_of_its_settings_acts(name, plain):
    """The recipe's update differs from plain GRPO's, and from the recipe's with any one of its settings back at
    GRPO's default (dynamic sampling, which picks the rollout rather than changing the update, aside: the test below
    and tests/test_grpo_dapo_gspo.py). DAPO's upper clip acts only because its minibatches move the ratio."""
    flags = doc_recipes()[name]
    recipe, _ = update(flags)
    assert differ(recipe, plain)
    defaults = grpo.GrpoHParams()
    settings = [flag.removeprefix("--grpo.") for flag in flags[::2] if flag != "--grpo.max_draws_per_update"]
    for setting in settings:
        reset, _ = update(flags, **{setting: getattr(defaults, setting)})
        assert differ(recipe, reset), setting
    if name == "Dr. GRPO":  # not a rescaling of GRPO's step: another direction
        assert torch.nn.functional.cosine_similarity(recipe.flatten(), plain.flatten(), 0) < 0.999


def test_alone_the_sequence_ratio_and_the_upper_clip_train_as_grpo(plain):
    """One optimizer step per rollout (the defaults): every ratio is 1, so --grpo.ratio_level sequence alone and
    --grpo.clip_high alone make GRPO's update (to float rounding), and note_idle_ratio says so in one line."""
    for flags in (["--grpo.ratio_level", "sequence"], ["--grpo.clip_high", "0.28"]):
        step, stats = update(flags)
        assert same(step, plain) and torch.allclose(stats["ratio"], torch.ones(()))
        said = []
        note_idle_ratio(parsed(flags).grpo, said.append)
        assert len(said) == 1 and flags[0] in said[0] and "--grpo.num_mini_batches" in said[0]
    said = []
    note_idle_ratio(grpo.GrpoHParams(), said.append)  # plain GRPO: no clip option set, nothing said
    assert said == []


def test_gspos_ratio_moves_after_the_first_minibatch():
    """GSPO's recipe: 4 minibatches. The first trains on-policy (every response's ratio 1); each later one sees
    responses whose ratio the steps before moved."""
    _, stats = update(doc_recipes()["GSPO"])
    ratio = stats["ratio"]  # (epochs, minibatches, micro batches): each micro batch's mean ratio
    assert ratio.shape == (1, 4, BATCH // 4 // MICRO)
    assert torch.allclose(ratio[0, 0], torch.ones(()), atol=1e-6)
    assert ((ratio[0, 1:] - 1).abs() > 1e-4).all()


# ------------------------------------------------------------------------------------------------
# What dynamic sampling compares: --grpo.dynamic_sampling_on
# ------------------------------------------------------------------------------------------------
def kept_groups(on: str) -> tuple:
    """One prompt batch of 4 groups of 2 responses (response_length 4), scored by a --reward_fn function alone:
    group 0 values (1, 1), both end at an EOS; group 1 (1, 1), the second without an EOS (the EOS trick's -1);
    group 2 (0, 1), neither with an EOS (both -1); group 3 (0, 1), both with an EOS. The groups the batch trains on,
    those of unequal rewards (in the order drawn), and those of equal rewards that fill the slots left."""
    args = grpo.Args(group_size=2, total_batch_size=8, response_length=4, reward_model_path=[], reward_fn="f.py:f",
                     grpo=grpo.GrpoHParams(max_draws_per_update=2, dynamic_sampling_on=on))
    one = types.SimpleNamespace(process_index=0, num_processes=1, gather=lambda x: x, print=print)
    sampler = grpo.DynamicSampling(args, one, torch.tensor([[10], [11], [12], [13]]), PAD)
    rows, queries = next(sampler.prompt_batches(1, {"budget": {"budget/prompts": 0}}, "cpu"))
    group = queries[::2, 0] - 10  # the group each prompt of the drawn batch is
    ends = {0: [True, True], 1: [True, False], 2: [False, False], 3: [True, True]}
    values = {0: [1.0, 1.0], 1: [1.0, 1.0], 2: [0.0, 1.0], 3: [0.0, 1.0]}
    raw = torch.full((8, 4), 5)
    raw[:, 1] = torch.tensor([EOS if ends[int(g)][i] else 5 for g in group for i in range(2)])
    data = grpo.Rollout(query_responses=torch.cat((queries, raw), 1), responses=grpo.truncate_response(EOS, PAD, raw),
                        logprobs=torch.zeros(8, 4), ref_logprobs=torch.zeros(8, 4),
                        rm_scores=torch.tensor([values[int(g)] for g in group]).view(-1, 1))
    scored = grpo.rewards_and_advantages(args, args.grpo, data, EOS, PAD, [], lambda x: x)
    _, data, scored = sampler.keep(rows, data, scored)
    trained = (data.query_responses[::2, 0] - 10).tolist()
    return sorted(trained[: 4 - sampler.empty]), sorted(trained[4 - sampler.empty :])


def test_dynamic_sampling_compares_the_score_or_the_reward_functions_value():
    """On the score (after the EOS trick), groups 1 and 3 differ, 0 and 2 do not; on the function's value, groups
    2 and 3 differ, 0 and 1 do not: the two filters keep different groups."""
    assert kept_groups("score") == ([1, 3], [0, 2])
    assert kept_groups("reward_fn") == ([2, 3], [0, 1])


def test_dynamic_sampling_on_reward_fn_without_a_reward_fn_is_refused(tmp_path):
    """rlhf_utils/flags.py check_groups, before anything loads (the model paths do not exist)."""
    args = grpo.Args(total_batch_size=8, local_micro_batch_size=2, total_episodes=16,
                     run=RunFlags(run_dir_root=str(tmp_path)), sft_model_path=str(tmp_path / "none"),
                     grpo=grpo.GrpoHParams(max_draws_per_update=2, dynamic_sampling_on="reward_fn"))
    with pytest.raises(ValueError, match="--grpo.dynamic_sampling_on reward_fn .* no --reward_fn"):
        grpo.main(args)
