"""report.py's "KL from SFT" column (README's headline table): the mean over a policy's evaluation samples of
log pi(y|x) - log pi_sft(y|x), each a sum of the response's token log-probs (its EOS included when the sample
ended). Checked on a tiny GPT-NeoX against a hand sum, one token at a time on the unpadded prefix, and through the
real path (kl_from_sft reading saved models): 0 for a policy identical to SFT, the hand value for another."""

import shutil
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import tiny_causal_lm
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import report

WORDS = ["[PAD]", "<|endoftext|>", "[UNK]", "sister", "lost", "tickets", "boss", "sold", "cash", "so", "yesterday",
         "tl;dr:", "post:", "and", "the", "."]
PAD, EOS, UNK = 0, 1, 2


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A 16-word tokenizer (one id per whitespace-separated word) with a [PAD] and an EOS of its own."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="<|endoftext|>",
                                   unk_token="[UNK]")


# queries and responses of several lengths (so the batches are padded), ended (EOS) or cut at the length limit
SAMPLES = pd.DataFrame({
    "query": ["post: sister lost tickets tl;dr:", "post: so yesterday boss sold cash and the tickets tl;dr:",
              "post: cash tl;dr:", "post: boss lost the cash . tl;dr:", "post: sister sold tickets tl;dr:"],
    "response": [" sister lost tickets .", " boss sold cash", "cash .", " boss lost cash and sister lost tickets .",
                 " so ."],
    "has_eos": [True, False, True, True, False],
})


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """models/sft, models/ppo (other weights) and models/dpo (a copy of sft's files), as pipeline.py lays them out."""
    root = tmp_path_factory.mktemp("models")
    for name, seed in (("sft", 0), ("ppo", 1)):
        tiny_causal_lm(seed=seed, vocab_size=len(WORDS), pad_token_id=PAD, eos_token_id=EOS).save_pretrained(root / name)
    shutil.copytree(root / "sft", root / "dpo")
    return root


def sum_by_hand(model_dir, query: str, response: str, has_eos: bool, tokenizer) -> float:
    """log pi(response [+ EOS] | query): one forward per response token on the prefix before it (no padding, no
    mask, no batch), the log-softmax of the last position at that token, summed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(query)["input_ids"]
    response_ids = tokenizer(" " + response.lstrip(" "))["input_ids"] + ([EOS] if has_eos else [])
    assert len(response_ids) >= 1 and not {PAD, UNK} & set(ids + response_ids)  # every word is in the vocabulary
    total = 0.0
    with torch.no_grad():
        for token in response_ids:
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            total += torch.log_softmax(logits.double(), -1)[token].item()
            ids = ids + [token]
    return total


def test_sequence_logprobs_equal_a_hand_sum(models_dir):
    tokenizer = word_tokenizer()
    by_hand = [sum_by_hand(models_dir / "ppo", q, r, e, tokenizer) for q, r, e in SAMPLES.itertuples(index=False)]
    for batch_size in (2, 32):  # padded batches of 2 (the last one alone) and one batch of all 5
        ours = report.sequence_logprobs(str(models_dir / "ppo"), SAMPLES, tokenizer, batch_size=batch_size)
        np.testing.assert_allclose(ours, by_hand, rtol=0, atol=1e-4)
    assert len(set(np.round(by_hand, 3))) == len(by_hand)  # the samples differ: no position error can hide


def test_kl_from_sft_is_zero_for_a_copy_of_sft_and_the_hand_value_otherwise(models_dir, tmp_path):
    tokenizer = word_tokenizer()
    samples_csv = tmp_path / "samples.csv"
    SAMPLES.to_csv(samples_csv, index=False)
    p = SimpleNamespace(models=str(models_dir))
    assert report.kl_from_sft(p, "dpo", str(samples_csv), tokenizer) == 0.0  # the same weights: exactly 0
    assert report.kl_from_sft(p, "sft", str(samples_csv), tokenizer) == 0.0
    hand = np.mean([sum_by_hand(models_dir / "ppo", q, r, e, tokenizer) - sum_by_hand(models_dir / "sft", q, r, e, tokenizer)
                    for q, r, e in SAMPLES.itertuples(index=False)])
    kl = report.kl_from_sft(p, "ppo", str(samples_csv), tokenizer)
    assert abs(hand) > 0.05 and kl == pytest.approx(hand, abs=1e-4)
