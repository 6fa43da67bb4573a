"""Issue #21: a paper-shaped smoke run. Whatever the real Pythia + TL;DR run would trip on trips here first.

The base model is a randomly initialised GPT-NeoX with Pythia's shape choices: rotary embeddings on 25% of each
head's dimensions, parallel residual, untied embeddings, 2048 positions and an embedding matrix padded beyond the
tokenizer (Pythia: 50304 rows for 50277 tokens), saved in float32 safetensors. Its tokenizer is a byte-level BPE
that, like Pythia's, ships `<|endoftext|>` as bos/eos/unk (and an unused `<|padding|>`) but NO pad token, so
every script must add the same [PAD] itself (Detail 3) and it must fit in the padded rows without a resize.

Raw rows in the hub schemas of `vwxyzjn/summarize_from_feedback_tldr_3_filtered` and
`openai/summarize_from_feedback` (written by the built-in task's generator, then lengthened) go through
`data/prepare.py --task tldr` with the paper's lengths (its defaults: query 512, SFT response 53, preference
response 169, CNN/DM query 1866 + response 155). Half of the posts are long enough to be cut at a paragraph,
some summaries nearly fill their lengths, and the CNN/DM articles are cut at 1866 tokens, so positions reach
512 + 53 (PPO's sampled responses), 512 + 169 (the reward model) and 2021 (of Pythia's 2048).
Then sft.py, reward.py, ppo.py and dpo.py each take a few updates as real subprocesses with the paper's flags
apart from sizes."""

import json
import math
import os
import random
import sys

import pytest

from conftest import ENV, REPO_ROOT, run_ok

QUERY, SFT_RESPONSE, RM_RESPONSE = 512, 53, 169  # Details 4-5, the TL;DR defaults of data/prepare.py
CNNDM_QUERY, CNNDM_RESPONSE = 1866, 155
EOS = "<|endoftext|>"


# ------------------------------------------------------------------------------ raw rows, tokenizer, base model
def lengthen(text: str, rng: random.Random, paragraphs: int) -> str:
    from data import synthetic

    extra = [" ".join(rng.sample(synthetic.FILLER_SENTENCES, 3)) for _ in range(paragraphs)]
    return "\n\n".join([text, *extra])


def write_raw_rows(root: str) -> tuple[str, str]:
    """Hub-schema JSONL folders (sft/, comparisons/) from the built-in generator, with every other post (by id,
    so a post reads the same in both files) lengthened far past the query length, and the CNN/DM articles
    past theirs."""
    from data import synthetic

    raw = os.path.join(root, "raw")
    synthetic.generate_raw(raw, seed=0, num_sft_train=64, num_sft_eval=8, num_pref_train=64, num_pref_valid=16,
                           num_cnndm=2, num_sft_test=8)
    posts = {}

    def long_post(post_id: str, post: str) -> str:
        if post_id not in posts:
            rng = random.Random(post_id)
            if post_id.startswith("cnndm"):
                posts[post_id] = lengthen(post, rng, 75)
            else:
                posts[post_id] = lengthen(post, rng, rng.randint(20, 30)) if rng.random() < 0.5 else post
        return posts[post_id]

    for name in ("sft/train.jsonl", "sft/validation.jsonl", "sft/test.jsonl", "comparisons/train.jsonl",
                 "comparisons/validation.jsonl"):
        path = os.path.join(raw, name)
        rows = [json.loads(line) for line in open(path)]
        for row in rows:
            if "post" in row:
                row["post"] = long_post(row["id"], row["post"])
            elif row["info"]["article"] is not None:
                row["info"]["article"] = long_post(row["info"]["id"], row["info"]["article"])
            else:
                row["info"]["post"] = long_post(row["info"]["id"], row["info"]["post"])
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return os.path.join(raw, "sft"), os.path.join(raw, "comparisons")


def texts_of(sft_dir: str, pref_dir: str) -> list[str]:
    texts = []
    for folder in (sft_dir, pref_dir):
        for name in sorted(os.listdir(folder)):
            for line in open(os.path.join(folder, name)):
                row = json.loads(line)
                if "post" in row:
                    texts.append(f"{row['title']}\n\n{row['post']}\n\nTL;DR: {row['summary']}")
                else:
                    texts.append(row["info"]["post"] or row["info"]["article"])
                    texts.extend(s["text"] for s in row["summaries"])
    return texts


def stretch_responses(sft_dir: str, pref_dir: str, tokenizer) -> None:
    """Lengthen a few responses to just within their lengths (with the leading space and EOS), so the
    processed data holds responses of nearly 53 and 169 tokens and none is dropped."""
    from data import synthetic

    def stretched(text: str, limit: int, rng: random.Random) -> str:
        while True:
            longer = f"{text.rstrip('.')} and {rng.choice(synthetic.FILLER_SENTENCES).rstrip('.').lower()}."
            if len(tokenizer.encode(" " + longer.strip())) + 1 > limit:
                return text
            text = longer

    rng = random.Random(1)
    path = os.path.join(sft_dir, "train.jsonl")
    rows = [json.loads(line) for line in open(path)]
    for row in rows[:8]:
        row["summary"] = stretched(row["summary"], SFT_RESPONSE, rng)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    for split in ("train", "validation"):
        path = os.path.join(pref_dir, f"{split}.jsonl")
        rows = [json.loads(line) for line in open(path)]
        for row in rows[:6]:
            summary = row["summaries"][rng.randrange(2)]
            summary["text"] = " " + stretched(summary["text"].strip(), RM_RESPONSE, rng)
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def pythia_like_tokenizer(texts: list[str]):
    """Byte-level BPE with Pythia's special tokens: `<|endoftext|>` (id 0) is bos, eos and unk, `<|padding|>`
    (id 1) exists but is not the pad token, and there is no pad token at all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=[EOS, "<|padding|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                        model_max_length=2048)
    assert tokenizer.pad_token is None and tokenizer.eos_token_id == 0
    return tokenizer


def padded_vocab_size(num_tokens: int) -> int:
    """Pythia pads its embedding rows to a multiple of 128, beyond the tokenizer's size; here with room to spare
    for the [PAD] the scripts add (Pythia: 50304 rows, 50277 tokens)."""
    size = math.ceil(num_tokens / 128) * 128
    return size if size > num_tokens + 1 else size + 128


def save_base_model(path: str, tokenizer) -> int:
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    vocab_size = padded_vocab_size(len(tokenizer))
    config = GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        rotary_pct=0.25, rotary_emb_base=10000, max_position_embeddings=2048, use_parallel_residual=True,
        tie_word_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
    )
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    model = GPTNeoXForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return vocab_size


# ------------------------------------------------------------------------------ the test
@pytest.mark.slow  # five Python processes, each importing torch + transformers: over a minute on 2 cores
def test_paper_shaped_pipeline(tmp_path):
    import numpy as np
    import torch
    from datasets import load_from_disk
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        PreTrainedTokenizerFast,
    )

    sft_raw, pref_raw = write_raw_rows(str(tmp_path))
    tokenizer = pythia_like_tokenizer(texts_of(sft_raw, pref_raw))
    stretch_responses(sft_raw, pref_raw, tokenizer)
    base = str(tmp_path / "base_model")
    vocab_size = save_base_model(base, tokenizer)
    n_tokens = len(tokenizer)
    assert AutoTokenizer.from_pretrained(base).pad_token is None, "the saved base tokenizer must ship no pad token"

    # ---- data/prepare.py --task tldr with its defaults: the paper's lengths ----
    data = str(tmp_path / "data")
    run_ok([sys.executable, os.path.join(REPO_ROOT, "data", "prepare.py"), "--task", "tldr", "--base_model", base,
            "--sft_data", sft_raw, "--preference_data", pref_raw, "--output_dir", data, "--no-plots"],
           cwd=REPO_ROOT, env=ENV, timeout=300)
    summary = json.load(open(os.path.join(data, "prep_summary.json")))
    assert (summary["query_length"], summary["sft_response_length"], summary["rm_response_length"]) == (
        QUERY, SFT_RESPONSE, RM_RESPONSE)
    pad_id, eos_id = summary["pad_token_id"], summary["eos_token_id"]
    assert eos_id == 0 and pad_id == n_tokens, "[PAD] is appended after the tokenizer's own tokens"
    assert pad_id not in (0, 1), "[PAD] must be neither EOS nor Pythia's unused <|padding|>"
    assert pad_id < vocab_size, "[PAD] fits in the padded embedding rows"
    assert all(v == 0 for k, v in summary["report"].items() if "dropped" in k), summary["report"]
    assert summary["rows"]["sft/train"] == 64 and summary["rows"]["preference/train"] == 64
    assert summary["rows"]["preference/validation_cnndm"] == 2
    assert summary["report"]["sft/train_truncated_queries"] > 16, "paragraph truncation should cut many posts"
    assert summary["max_lengths"]["query_token_len"] > QUERY - 40, "some queries should nearly fill 512 tokens"
    assert summary["max_lengths"]["reference_response_token_len"] > SFT_RESPONSE - 10
    assert summary["max_lengths"]["chosen_token_len"] > RM_RESPONSE - 20 or (
        summary["max_lengths"]["rejected_token_len"] > RM_RESPONSE - 20)

    sft_data, pref_data = load_from_disk(os.path.join(data, "sft")), load_from_disk(os.path.join(data, "preference"))
    for split, ds in sft_data.items():  # the real numbers: query 512, query+reference 512 + 53
        for column, width in (("query_token", QUERY), ("reference_response_token", SFT_RESPONSE),
                              ("query_reference_response_token", QUERY + SFT_RESPONSE),
                              ("query_reference_response_token_response_label", QUERY + SFT_RESPONSE)):
            tokens = np.asarray(ds[column])
            assert tokens.shape == (len(ds), width), (split, column, tokens.shape)
            assert tokens.min() >= 0 and tokens.max() < vocab_size, (split, column)
    for split, ds in pref_data.items():  # TL;DR: 512 + 169; CNN/DM: 1866 + 155 (within Pythia's 2048)
        q, r = (CNNDM_QUERY, CNNDM_RESPONSE) if split == "validation_cnndm" else (QUERY, RM_RESPONSE)
        for column, width in (("query_token", q), ("query_chosen_token", q + r), ("query_rejected_token", q + r),
                              ("query_chosen_token_response_label", q + r)):
            tokens = np.asarray(ds[column])
            assert tokens.shape == (len(ds), width), (split, column, tokens.shape)
            assert tokens.min() >= 0 and tokens.max() < vocab_size, (split, column)
    assert max(pref_data["validation_cnndm"]["query_token_len"]) > CNNDM_QUERY - 60
    row = sft_data["train"][0]  # " " + summary + EOS, then [PAD] (Detail 3)
    tokens, n = row["query_reference_response_token"], row["query_reference_response_token_len"]
    assert tokens[n - 1] == eos_id and set(tokens[n:]) <= {pad_id}

    # ---- a few updates of each script, the paper's flags apart from sizes ----
    runs, models = str(tmp_path / "runs"), tmp_path / "models"

    def script(name: str, *flags: str):
        return run_ok([sys.executable, os.path.join(REPO_ROOT, f"{name}.py"), "--run_name", name,
                       "--run_dir_root", runs, "--output_dir", str(models / name), *flags],
                      cwd=REPO_ROOT, env=ENV, timeout=600)

    sft_dir = query_dir = os.path.join(data, "sft")
    pref_dir = os.path.join(data, "preference")
    script("sft", "--base_model", base, "--query_dataset", sft_dir, "--response_length", str(SFT_RESPONSE),
           "--total_episodes", "48", "--total_batch_size", "16", "--local_micro_batch_size", "8",
           "--num_eval_samples", "8", "--local_eval_batch_size", "8")
    sft_model = str(models / "sft")
    script("reward", "--sft_model_path", sft_model, "--preference_dataset", pref_dir, "--query_dataset", query_dir,
           "--total_episodes", "48", "--total_batch_size", "16", "--local_micro_batch_size", "8",
           "--num_eval_samples", "8", "--local_eval_batch_size", "8", "--num_normalization_samples", "16")
    script("ppo", "--sft_model_path", sft_model, "--reward_model_path", str(models / "reward"),
           "--query_dataset", query_dir, "--response_length", str(SFT_RESPONSE), "--total_episodes", "24",
           "--total_batch_size", "8", "--local_micro_batch_size", "4", "--local_rollout_forward_batch_size", "8",
           "--num_eval_samples", "8")
    script("dpo", "--sft_model_path", sft_model, "--preference_dataset", pref_dir, "--query_dataset", query_dir,
           "--response_length", str(SFT_RESPONSE), "--total_episodes", "48", "--total_batch_size", "16",
           "--local_micro_batch_size", "8", "--num_eval_samples", "8", "--local_eval_batch_size", "8")

    # ---- what they saved: the same [PAD], the padded embedding rows, float32 ----
    sft_tokenizer = AutoTokenizer.from_pretrained(sft_model)
    assert isinstance(sft_tokenizer, PreTrainedTokenizerFast)
    assert sft_tokenizer.pad_token == "[PAD]" and sft_tokenizer.pad_token_id == pad_id != sft_tokenizer.eos_token_id
    assert sft_tokenizer.eos_token_id == eos_id and len(sft_tokenizer) == n_tokens + 1
    for name in ("sft", "ppo", "dpo", "reward"):
        path = str(models / name)
        loader = AutoModelForSequenceClassification if name == "reward" else AutoModelForCausalLM
        model = loader.from_pretrained(path)
        assert model.config.vocab_size == vocab_size, f"{name}: embeddings resized to {model.config.vocab_size}"
        assert model.get_input_embeddings().weight.shape[0] == vocab_size, name
        if name != "reward":
            assert model.get_output_embeddings().weight.shape[0] == vocab_size, name
        assert model.config.rope_parameters["partial_rotary_factor"] == 0.25, name
        assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters()), name
        saved = AutoTokenizer.from_pretrained(path)
        assert saved.pad_token_id == pad_id and saved.eos_token_id == eos_id, name

    # ---- PPO logged its updates, with finite numbers ----
    lines = [json.loads(line) for line in open(os.path.join(runs, "ppo", "metrics.jsonl"))]
    assert len(lines) >= 3
    for line in lines:
        for key, value in line.items():
            if isinstance(value, (int, float)):
                assert math.isfinite(value), (key, value)
