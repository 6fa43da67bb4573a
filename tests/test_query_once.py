"""--query_once in the DPO family (issue 65): chosen and rejected share their query, so dpo.py, kto.py and
online_dpo.py run it once and both responses after its keys and values (forward_query_once). The sequence
log-probs must equal the whole rows' within 1e-5 and every parameter's gradient within 1e-4 relative, on pairs whose
queries differ in length; KTO's examples made of pairs (pair_halves: the two halves of a pair a micro batch apart)
and its mismatched KL pairs likewise. The 2-process runs of every script (tests/test_multiprocess.py) run with the
flag on, its default. Where the equality stops: dropout (train mode with dropout on) draws one mask for a query
shared by its rows instead of one per row, so the two paths differ by the draw, not in expectation; a LoRA adapter
changes nothing (it runs in both passes), tested below."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import load_script, tiny_causal_lm

PAD, EOS, VOCAB = 1, 2, 16
SCRIPTS = {name: load_script(name) for name in ("dpo", "kto", "online_dpo")}


def pair_batch(generator: torch.Generator, pairs: int = 5, query_width: int = 7, response_width: int = 6) -> dict:
    """Preference pairs in the processed schema (PAIR_COLUMNS): LEFT-padded queries of lengths 2 .. query_width,
    RIGHT-padded chosen and rejected responses of lengths 1 .. response_width, ending in EOS."""
    rows = {name: [] for name in ("query_chosen_token", "query_rejected_token", "query_chosen_token_response_label",
                                  "query_rejected_token_response_label")}
    for i in range(pairs):
        n = 2 + i % (query_width - 1)
        query = [PAD] * (query_width - n) + torch.randint(3, VOCAB, (n,), generator=generator).tolist()
        for side in ("chosen", "rejected"):
            m = int(torch.randint(1, response_width + 1, (1,), generator=generator))
            response = torch.randint(3, VOCAB, (m - 1,), generator=generator).tolist() + [EOS]
            response += [PAD] * (response_width - m)
            rows[f"query_{side}_token"].append(query + response)
            rows[f"query_{side}_token_response_label"].append([PAD] * query_width + response)
    return {name: torch.tensor(value) for name, value in rows.items()}


def gradients(model) -> list:
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def assert_close_gradients(whole: list, once: list) -> None:
    for a, b in zip(whole, once):
        assert (a - b).norm() <= 1e-4 * a.norm() + 1e-12, float((a - b).norm() / a.norm())


def both_paths(model, logps_of) -> tuple:
    """logps_of(query_once) for both paths in train mode, each with its gradient of a loss that weighs every
    sequence differently (so that a gradient summed the wrong way shows)."""
    model.train()
    out = []
    for query_once in (False, True):
        model.zero_grad()
        logps = logps_of(query_once)
        (logps * torch.linspace(0.5, 1.5, logps.numel())).sum().backward()
        out.append((logps.detach(), gradients(model)))
    return out


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_pair_logprobs_and_gradients_equal_whole_rows(name):
    script, model = SCRIPTS[name], tiny_causal_lm(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS)
    batch = pair_batch(torch.Generator().manual_seed(0))
    (whole, whole_grads), (once, once_grads) = both_paths(
        model, lambda q: torch.cat(script.concatenated_logprobs(model, batch, PAD, q)))
    assert torch.allclose(whole, once, atol=1e-5, rtol=0), (whole - once).abs().max()
    assert_close_gradients(whole_grads, once_grads)
    # the copies are one function, so the reference's path (no gradient) reads the same numbers
    with torch.no_grad():
        chosen, rejected = script.reference_logprobs(model, None, batch, PAD, True)
    assert torch.allclose(torch.cat((chosen, rejected)), whole, atol=1e-5, rtol=0)


def test_kto_examples_from_pairs_and_mismatched_pairs_equal_whole_rows():
    kto, model = SCRIPTS["kto"], tiny_causal_lm(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS)
    g = torch.Generator().manual_seed(1)
    width = 7
    pairs = []
    for i in range(4):
        n = 2 + i
        row = {"query_token": torch.tensor([PAD] * (width - n) + torch.randint(3, VOCAB, (n,), generator=g).tolist()),
               "row_index": torch.tensor(i)}
        for side in ("chosen", "rejected"):
            m = 1 + i % 4
            row[f"{side}_token"] = torch.tensor(torch.randint(3, VOCAB, (m,), generator=g).tolist() + [EOS]
                                                + [PAD] * (4 - m))
        pairs.append(row)
    batch = kto.pair_halves(pairs)  # 8 examples: rows i and i + 4 share query i
    assert torch.equal(batch["query_token"][:4], batch["query_token"][4:])
    for completions in (batch["completion_token"], batch["completion_token"].roll(1, dims=0)):
        (whole, whole_grads), (once, once_grads) = both_paths(
            model, lambda q: kto.example_logprobs(model, batch["query_token"], completions, PAD, q))
        assert torch.allclose(whole, once, atol=1e-5, rtol=0), (whole - once).abs().max()
        assert_close_gradients(whole_grads, once_grads)


def test_lora_policy_and_its_adapters_off_reference_equal_whole_rows():
    dpo = SCRIPTS["dpo"]
    model = get_peft_model(tiny_causal_lm(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value", "embed_out"],
                                      init_lora_weights=False))
    batch = pair_batch(torch.Generator().manual_seed(2))
    (whole, whole_grads), (once, once_grads) = both_paths(
        model, lambda q: torch.cat(dpo.concatenated_logprobs(model, batch, PAD, q)))
    assert torch.allclose(whole, once, atol=1e-5, rtol=0)
    assert len(whole_grads) > 0
    assert_close_gradients(whole_grads, once_grads)
    reference = dpo.AdaptersOff(model)
    with torch.no_grad():
        ref_whole = torch.cat(dpo.concatenated_logprobs(reference, batch, PAD, False))
        ref_once = torch.cat(dpo.concatenated_logprobs(reference, batch, PAD, True))
    assert torch.allclose(ref_whole, ref_once, atol=1e-5, rtol=0)
    assert not torch.allclose(ref_whole, whole, atol=1e-3)  # the adapters do change the policy


def test_each_distinct_query_runs_once():
    """The queries' pass holds each distinct query once: 5 pairs (10 rows) make 5 cache rows, and a row whose
    query differs only in its last token still shares the cache (the pass stops before that token)."""
    dpo = SCRIPTS["dpo"]
    batch = pair_batch(torch.Generator().manual_seed(3))
    rows = torch.cat((batch["query_chosen_token"], batch["query_rejected_token"]))
    first, second, index = dpo.query_once_inputs(rows, PAD, 7)
    assert first["input_ids"].shape == (5, 6) and second["input_ids"].shape == (10, rows.size(1) - 6)
    assert torch.equal(index[:5], index[5:])
    changed = rows.clone()
    changed[0, 6] = (changed[0, 6] + 1 - 3) % (VOCAB - 3) + 3  # the last query token of row 0 only
    assert dpo.query_once_inputs(changed, PAD, 7)[0]["input_ids"].shape == (5, 6)


def test_gradient_checkpointing_without_a_cache_is_refused_not_miscomputed():
    """Under gradient checkpointing in train mode transformers keeps no key/value cache: the helper says so instead
    of running the responses without their queries (the scripts take whole rows there)."""
    dpo, model = SCRIPTS["dpo"], tiny_causal_lm(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS)
    model.gradient_checkpointing_enable()
    model.train()
    batch = pair_batch(torch.Generator().manual_seed(4))
    with pytest.raises(RuntimeError, match="no_query_once"):
        dpo.concatenated_logprobs(model, batch, PAD, True)
