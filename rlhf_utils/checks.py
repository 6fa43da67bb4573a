"""Expected errors and input checks: what every script imports to refuse a bad input before it costs any work.

  expected errors   RunError: a bad flag or input, a refused resume, a held lock, a full disk; printed as one
                    paragraph from rank 0 with a failed exit and no traceback (print_expected_error, installed as
                    sys.excepthook on import). NonFiniteError: a NaN or inf that stops the run
  data              load_split: a prepared split, refused when its arrow files are damaged; check_columns,
                    check_query_response: the columns and token layout a script reads; check_data_tokenizer
                    (tokenizer_fingerprint, tokenizer_difference, written_by_prepare): data prepared with another
                    tokenizer; check_response_starts (ilql.py), check_preference_columns (offline_rl.py; the
                    columns it reads: OFFLINE_PREFERENCE_COLUMNS)
  models            check_model_paths (MODEL_FLAGS, check_model_path): a model path that is neither a folder nor
                    a model of the hub, refused in seconds; check_finite: a NaN or inf in loaded weights;
                    check_reward_tokenizer: a reward model whose tokenizer is not the policy's
  flags             check_gradient_accumulation: --gradient_accumulation_steps against the batch sizes;
                    check_qlora_flags: --load_in_4bit's needs

What it never does: change a value. A check reads its input and either returns or raises one RunError that names
the file, flag or row and the fix; the scripts decide every number themselves.
"""

import contextlib
import glob
import hashlib
import json
import os
import sys
from typing import Optional

import numpy as np
import pyarrow.compute
import torch
from datasets import load_dataset, load_from_disk
from transformers import AutoTokenizer


class RunError(ValueError):
    """An expected stop (a bad flag or input, a refused resume, a held lock, a full disk): its message says the fix."""


class NonFiniteError(RunError, RuntimeError):
    """A loss, reward, advantage, gradient norm or loaded weight became NaN or inf (Run.guard, check_finite)."""


def print_expected_error(kind, error, trace) -> None:
    """sys.excepthook: a RunError prints `script.py: error: message` (rank 0 alone); other errors their traceback."""
    if not isinstance(error, RunError):
        return sys.__excepthook__(kind, error, trace)
    if os.environ.get("RANK", "0") == "0":
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)


sys.excepthook = print_expected_error


# ----------------------------------------------------------------------------------------------------------------------
# Data: a prepared split, its columns and token layout, the tokenizer it was made with
# ----------------------------------------------------------------------------------------------------------------------
def load_split(path: str, split: str):
    """A processed split: a local `save_to_disk` folder (the built-in task, tests) or a hub dataset name. A local
    folder whose arrow files are damaged (cut short, overwritten) is one RunError naming the split's folder and the fix,
    raised before anything else reads it: its table is read and checked once here."""
    if not os.path.isdir(path):
        return load_dataset(path, split=split)
    import pyarrow  # (only its error types: what a damaged arrow file raises)

    def damaged(error: Exception, folder: str) -> RunError:
        return RunError(f"the prepared data in {folder} cannot be read: {type(error).__name__}: {error}. Its arrow "
                        "file is damaged (cut short or overwritten, e.g. by a copy that stopped or a full disk); "
                        "prepare it again with data/prepare.py (the task's flags, the same --output_dir) or copy it "
                        "anew")

    try:
        dataset_dict = load_from_disk(path)
    except (OSError, pyarrow.ArrowException) as error:  # which split's folder: the first that does not load alone
        for folder in sorted(os.path.join(path, d) for d in os.listdir(path)):
            try:
                if os.path.exists(os.path.join(folder, "state.json")):
                    load_from_disk(folder)
            except (OSError, pyarrow.ArrowException) as its_error:
                raise damaged(its_error, folder) from its_error
        raise damaged(error, path) from error
    if split not in dataset_dict:
        raise RunError(f"{path} has no split {split!r}; it has {list(dataset_dict.keys())}")
    try:  # the arrow file is memory-mapped: its buffers must lie within it and match the row count
        dataset_dict[split].data.validate()
    except (OSError, pyarrow.ArrowException) as error:
        raise damaged(error, os.path.join(path, split)) from error
    return dataset_dict[split]


def check_columns(dataset, columns: list, where: str) -> None:
    """Bad input fails here with the row and the fix, not deep inside a library: every needed column is present,
    and every token column has one length in all rows (processed data is padded to fixed lengths)."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise RunError(f"{where} lacks the column(s) {missing} (it has {dataset.column_names}); "
                       "make it with data/prepare.py, whose output has every column the scripts read")
    table = dataset.select_columns(list(columns)).with_format("arrow")[:]
    for column in (c for c in columns if pyarrow.types.is_list(table.schema.field(c).type) and table.num_rows):
        lengths = pyarrow.compute.list_value_length(table.column(column)).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(lengths != lengths[0])
        if bad.size:
            raise RunError(f"{where}: row {int(bad[0])} has {int(lengths[bad[0]])} tokens in {column!r}, row 0 has "
                           f"{int(lengths[0])}; every row must be padded to one length "
                           "(prepare it with data/prepare.py)")


def check_query_response(dataset, pad_token_id: int, where: str) -> None:
    """Bad input: in each query_<X>_token column the response starts where the query (query_token without [PAD])
    ends: its labels (..._response_label) are its tokens with the query masked by [PAD], and in data/prepare.py's
    splits its first tokens are the query. A column shifted by a token would train in silence. After check_columns."""
    names, table = dataset.column_names, dataset.with_format("arrow")[:]

    def matrix(column: str) -> np.ndarray:
        """A token column as one (rows, length) array (check_columns made every row of it one length)."""
        flat = pyarrow.compute.list_flatten(table.column(column)).to_numpy(zero_copy_only=False)
        return flat.reshape(len(dataset), -1)

    query = matrix("query_token") if "query_token" in names and len(dataset) else np.zeros((0, 0))
    length = (query != pad_token_id).sum(1)  # the query's real tokens, wherever its padding is
    for column in (c for c in names if c.startswith("query_") and c.endswith("_token") and c != "query_token"
                   and len(query)):
        tokens, label, found = matrix(column), column + "_response_label", []
        in_query = np.arange(tokens.shape[1]) < length[:, None]  # the positions of the row's query
        if written_by_prepare(dataset) is not None:  # (hub data may have tokenized query + response as one text)
            moved = np.repeat(np.arange(len(query)), length)[tokens[in_query] != query[query != pad_token_id]]
            found += [(int(moved[0]), "its first tokens are not the row's query_token")] if moved.size else []
        if label in names:
            bad = np.flatnonzero((np.where(in_query, pad_token_id, tokens) != matrix(label)).any(1))
            masked = f"{label!r} is not it with the query masked by [PAD] ({pad_token_id})"
            found += [(int(bad[0]), masked)] if bad.size else []
        if found:
            row, what = min(found, key=lambda item: item[0])  # (on one row, the first reason)
            raise RunError(f"{where} row {row}: the response in {column!r} does not start where the query ends: "
                           f"{what}; prepare the data again with data/prepare.py")


# The identity of the tokenizer that writes (or reads) token ids: a digest of its vocabulary (every token and its id,
# added tokens such as [PAD] included), its size, and its [PAD] and EOS ids. data/prepare.py stores it in the
# description of every split it writes; the training scripts compare it with their model's tokenizer. data/prepare.py
# keeps its own copy of this function, letter for letter (tests/test_shared_helpers.py compares the two texts), so
# change both or neither.
def tokenizer_fingerprint(tokenizer) -> dict:
    """The identity of the tokenizer of token ids: a digest of its vocabulary (added tokens such as [PAD] included),
    its size, [PAD] and EOS ids. data/prepare.py stores it with every split; the scripts compare it with theirs."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return {"vocab_sha256": hashlib.sha256(json.dumps(vocab).encode("utf-8")).hexdigest(), "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}


def tokenizer_difference(theirs: dict, ours: dict) -> list:
    """What differs between two tokenizer fingerprints (theirs vs ours), for an error message; [] = the same."""
    differ = [f"{k} {theirs.get(k)} vs {ours[k]}" for k in ("vocab_size", "pad_token_id", "eos_token_id")
              if theirs.get(k) != ours[k]]
    return differ or (["same size, other tokens"] if theirs.get("vocab_sha256") != ours["vocab_sha256"] else [])


def written_by_prepare(dataset) -> Optional[dict]:
    """The tokenizer fingerprint data/prepare.py stored in a split's description; None for other data (a hub set)."""
    with contextlib.suppress(TypeError, ValueError, KeyError):  # no description, or one not written by data/prepare.py
        return json.loads(dataset.info.description)["tokenizer"]


def check_data_tokenizer(dataset, tokenizer, model_path: str, where: str, rows: int = 64) -> None:
    """Bad input: token ids mean something only to the tokenizer that wrote them, so data of another tokenizer is
    refused before the output folder is claimed. A split written by data/prepare.py carries its tokenizer's
    fingerprint, which must equal the model's; one without (a hub dataset) is checked by its ids: all below the
    vocabulary size and, in the first `rows` rows, padded with this [PAD] and responses ended by this EOS."""
    ours = tokenizer_fingerprint(tokenizer)
    pad, eos, size = ours["pad_token_id"], ours["eos_token_id"], ours["vocab_size"]
    fix = (f"Prepare the data again with this model's tokenizer: python data/prepare.py --base_model {model_path} "
           "(with the task's other flags)")
    if (theirs := written_by_prepare(dataset)) is not None:
        if differ := tokenizer_difference(theirs, ours):
            raise RunError(f"{where} was tokenized by the tokenizer of {theirs.get('name_or_path')}, not by the one "
                           f"of {model_path}: {'; '.join(differ)} (data vs model); its token ids would be read as "
                           f"other tokens. {fix}")
        return
    other = f"so the data was tokenized by another tokenizer. {fix}"
    columns = [c for c in dataset.column_names if c.endswith(("_token", "_token_response_label"))]
    table = dataset.select_columns(columns).with_format("arrow")[:]
    for column in (c for c in columns if table.num_rows and pyarrow.types.is_integer(getattr(
            table.schema.field(c).type, "value_type", pyarrow.string()))):
        highest = pyarrow.compute.max(pyarrow.compute.list_flatten(table.column(column))).as_py()
        if highest is not None and highest >= size:
            raise RunError(f"{where}: {column!r} holds the token id {highest}, but the tokenizer of {model_path} "
                           f"has {size} tokens, {other}")
    head = dataset.select(range(min(rows, len(dataset))))
    for column in (c for c in columns if c + "_len" in dataset.column_names):
        ends = []  # the last token of each response (the query column has none)
        for i, (ids, n) in enumerate(zip(head[column], head[column + "_len"])):
            left = column == "query_token"  # queries are left-padded, responses right-padded (Detail 5)
            wrong = [t for t in (ids[: len(ids) - n] if left else ids[n:]) if t != pad] if n <= len(ids) else []
            if wrong:
                raise RunError(f"{where} row {i}: {column!r} is padded with the id {wrong[0]}, but the tokenizer of "
                               f"{model_path} pads with {pad}, {other}")
            ends += [ids[n - 1]] if not left and 0 < n <= len(ids) else []
        if ends and eos not in ends:  # every response ends with EOS (Detail 3); not one does here
            raise RunError(f"{where}: no response in the first {len(ends)} rows of {column!r} ends with the EOS id "
                           f"{eos} of the tokenizer of {model_path} (they end with {sorted(set(ends))[:5]}), {other}")


def check_response_starts(pairs, pad_token_id: int, where: str, chunk: int = 4096) -> None:
    """Bad input: ilql.py's action_positions takes each response's start from query_token_len, the loss its tokens from
    the label column (the response tokens, [PAD] elsewhere). The two must agree: in every row and for each side of the
    pair, the labelled tokens form one run that starts at index query_token_len. Where they do not (a query_token_len
    from another tokenization, a label column written by other code), every state and action of the row would be
    read at the wrong token without an error; this stops at the first such row, naming it."""
    for side in ("chosen", "rejected"):
        column = f"query_{side}_token_response_label"
        for first_row in range(0, len(pairs), chunk):
            rows = pairs.select_columns([column, "query_token_len"]).with_format("numpy")[first_row : first_row + chunk]
            labelled = np.asarray(rows[column]) != pad_token_id  # (N, T)
            starts = np.where(labelled.any(1), labelled.argmax(1), -1)  # first labelled index; -1 = none
            ends = labelled.shape[1] - labelled[:, ::-1].argmax(1)  # one past the last labelled index
            query_lengths = np.asarray(rows["query_token_len"])
            bad = np.flatnonzero((starts != query_lengths) | (ends - starts != labelled.sum(1)))
            if bad.size:
                i = int(bad[0])
                found = "no response token" if starts[i] < 0 else f"its first response token at index {starts[i]}" + (
                    "" if ends[i] - starts[i] == labelled[i].sum() else " and [PAD] gaps inside the response")
                raise RunError(
                    f"{where} row {first_row + i} ({side}): query_token_len is {int(query_lengths[i])} but {column!r} "
                    f"has {found}; the response must start at query_token_len and run without a gap, or ILQL reads its "
                    "states and actions at the wrong tokens. Prepare the data again with data/prepare.py, which writes "
                    "the labels and query_token_len together"
                )


OFFLINE_PREFERENCE_COLUMNS = ["query", "query_token", "chosen", "rejected", "chosen_token", "rejected_token",
                              "chosen_token_len", "rejected_token_len"]


def check_preference_columns(preference, args) -> None:
    """check_columns for the preference split the mixture reads. query_token may mix query lengths (build_mixture
    leaves rows of another length out), so only its presence is checked; the response columns must have one length."""
    where = f"{args.preference_dataset} split {args.preference_split!r}"
    check_columns(preference, [c for c in OFFLINE_PREFERENCE_COLUMNS if c != "query_token"], where)
    if "query_token" not in preference.column_names:
        check_columns(preference, ["query_token"], where)  # raises the missing-column error


# ----------------------------------------------------------------------------------------------------------------------
# Models and flags
# ----------------------------------------------------------------------------------------------------------------------
# the flags that name a model, a local folder or a model of the hub (Run.inputs checks them by these names)
MODEL_FLAGS = ("base_model", "model_path", "sft_model_path", "reward_model_path")
# this project's own model folders, its scripts' defaults (sft.py writes models/sft, reward.py models/rm): a path under
# it is a folder that is not there yet, never a hub name (models/rm is a valid one)
LOCAL_MODELS = "models/"
HUB_TIMEOUT_S = 10.0  # the one question to the hub: an answer, or the refusal, within seconds


def check_model_paths(paths: dict, reward_fn: bool = False) -> None:
    """check_model_path for each model flag of `paths` (Run.inputs' name=path; a list gives one path each, None
    none). `reward_fn`: the script scores with --reward_fn too, so a list --reward_model_path may be left empty."""
    for flag, given in paths.items():
        if flag in MODEL_FLAGS:
            alone = flag == "reward_model_path" and reward_fn and isinstance(given, (list, tuple))
            for path in [given] if isinstance(given, str) else given or []:
                check_model_path(flag, path, alone)


def check_model_path(flag: str, path: str, alone: bool = False) -> None:
    """Bad input: a model path that is neither a local folder nor a model of the hub, refused in seconds with the flag
    and the path, before transformers takes it for a hub name (it retries for about 40 s, then a long traceback). A
    path under models/ (LOCAL_MODELS), or one that cannot be a hub name (./x, /x, a/b/c), that is no folder is refused
    at once, without asking the hub; a hub name is found in the hub's local cache, else asked of the hub once (not
    with HF_HUB_OFFLINE). A folder must hold a config.json (a LoRA adapter's: adapter_config.json). `alone`: the
    --reward_fn function may score alone (the refusal says how)."""
    from huggingface_hub import HfApi, is_offline_mode, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    where = f"--{flag} {path}"
    fix = ("; to score with --reward_fn alone, pass --reward_model_path with nothing after it (no reward model is "
           "loaded)") if alone else ""
    if os.path.isdir(path):
        if not any(os.path.exists(os.path.join(path, name)) for name in ("config.json", "adapter_config.json")):
            raise RunError(f"{where} holds no config.json (nor a LoRA adapter's adapter_config.json), so it is no "
                           f"saved model (a save or a copy that stopped?); pass the folder save_pretrained wrote{fix}")
        return
    if os.path.exists(path):
        raise RunError(f"{where} is a file, not a model folder; pass the folder that holds the model's config.json "
                       f"and weights (as save_pretrained writes it), or a model name of the hub{fix}")
    try:
        validate_repo_id(path)
        hub_name = not path.startswith(LOCAL_MODELS)
    except HFValidationError:
        hub_name = False
    if not hub_name:
        raise RunError(f"{where}: there is no folder {os.path.abspath(path)}. Paths under {LOCAL_MODELS} are this "
                       f"project's own model folders (sft.py saves models/sft, reward.py models/rm, with their default "
                       f"--output_dir), not asked of the hub. Train that model first, or pass the folder (or hub "
                       f"name) of the model to use{fix}" if path.startswith(LOCAL_MODELS) else
                       f"{where}: there is no folder {os.path.abspath(path)}, and it cannot be a hub name either; "
                       f"pass the folder of a saved model, or a hub name such as EleutherAI/pythia-1b-deduped{fix}")
    if any(isinstance(try_to_load_from_cache(path, name), str)
           for name in ("config.json", "adapter_config.json")):
        return  # downloaded before: transformers loads it from the cache
    if is_offline_mode():
        raise RunError(f"{where}: no such folder, and the hub is off (HF_HUB_OFFLINE) with no copy of a model of that "
                       f"name in its local cache; pass the folder of a saved model, or download it first (unset "
                       f"HF_HUB_OFFLINE){fix}")
    try:
        HfApi().model_info(path, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        raise RunError(f"{where}: no such folder, and the hub has no model of that name (or it is private: log in with "
                       f"`hf auth login`); pass the folder of a saved model, or a model name of the hub{fix}") from None
    except Exception as error:  # the network: no route, a timeout, a proxy's refusal
        raise RunError(f"{where}: no such folder, and the hub could not be asked whether it has a model of that name "
                       f"({type(error).__name__}: {error}); pass the folder of a saved model, or try again when the "
                       f"hub can be reached{fix}") from None


def check_finite(model, path: str) -> None:
    """Bad input: a loaded model whose weights hold NaN or inf (a diverged run's save), named with its first such
    tensor. Under ZeRO-3 a loaded weight is partitioned: each process holds a shard of it (ds_tensor) and the weight
    itself is empty, so each one is gathered whole for its check, one at a time, on every process (all of them call
    this, as they all load the model)."""
    files = glob.glob(os.path.join(path, "*.safetensors")) if os.path.isdir(path) else []
    for name, weight in model.named_parameters():
        with (sys.modules["deepspeed"].zero.GatheredParameters([weight]) if hasattr(weight, "ds_id")
              else contextlib.nullcontext()):  # (a weight ZeRO-3 partitioned: deepspeed is loaded)
            if weight.is_floating_point() and not torch.isfinite(weight).all():
                raise NonFiniteError(
                    f"{files[0] if len(files) == 1 else path} holds non-finite weights: {name} has "
                    f"{int((~torch.isfinite(weight)).sum())} NaN or inf values of {weight.numel()}; load a model whose "
                    "weights are finite (e.g. a checkpoint from before its run diverged)")


def check_reward_tokenizer(tokenizer, sft_model_path: str, reward_model_path: str, trust_remote_code: bool) -> None:
    """Bad input: the reward model (and a critic made from it, Detail 22) reads the policy's token ids, so it must have
    been trained with the policy's tokenizer (the same fingerprint). A mismatch raises no error anywhere else, it only
    makes every score meaningless, so it is checked before any weights load."""
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if os.path.isdir(reward_model_path) and not any(os.path.exists(os.path.join(reward_model_path, name))
                                                    for name in tokenizer_files):
        raise RunError(
            f"--reward_model_path {reward_model_path} holds no tokenizer, so this script cannot check that the "
            f"reward model reads the token ids of the policy {sft_model_path}; save the tokenizer the reward model "
            f"was trained with into that folder (tokenizer.save_pretrained), as reward.py does")
    rm_tokenizer = AutoTokenizer.from_pretrained(reward_model_path, trust_remote_code=trust_remote_code)
    if rm_tokenizer.pad_token is None:
        rm_tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # the same fallback the policy's tokenizer gets
    if differ := tokenizer_difference(tokenizer_fingerprint(tokenizer), tokenizer_fingerprint(rm_tokenizer)):
        raise RunError(
            f"the reward model {reward_model_path} was trained with a different tokenizer than the policy "
            f"{sft_model_path}: {'; '.join(differ)} (policy vs reward model). The reward model would read token ids "
            f"it was not trained on and score noise. Train the reward model from this SFT model "
            f"(reward.py --sft_model_path {sft_model_path}), or pass the SFT model the reward model was trained from")


def check_gradient_accumulation(args, derived: int, num_processes: int, num_mini_batches: int = 1) -> None:
    """--gradient_accumulation_steps left out (None) takes `derived`, the micro batches per optimizer step that the
    batch sizes give; a stated value must equal it (it checks the batch arithmetic, it never overrides it)."""
    if args.gradient_accumulation_steps is not None and args.gradient_accumulation_steps != derived:
        raise RunError(
            f"--gradient_accumulation_steps {args.gradient_accumulation_steps} does not match total_batch_size "
            f"{args.total_batch_size} / ({num_processes} processes x {num_mini_batches} minibatches x "
            f"{args.local_micro_batch_size} micro batch) = {derived}; leave it out or change the batch sizes")


def check_qlora_flags(args, accelerator) -> None:
    """--load_in_4bit (QLoRA): what it needs, checked before any model loads and before --output_dir is claimed."""
    if not args.load_in_4bit:
        return
    if args.lora_rank <= 0:
        raise RunError("--load_in_4bit (QLoRA) stores the frozen base of a LoRA policy in 4 bits and trains LoRA "
                       "adapters on top: it needs --lora_rank > 0 (e.g. --lora_rank 8); 4-bit weights cannot be "
                       "trained themselves")
    if getattr(accelerator.state.deepspeed_plugin, "zero_stage", None) == 3:
        raise RunError("--load_in_4bit cannot run under DeepSpeed ZeRO-3, which splits every weight across the "
                       "processes: bitsandbytes' packed 4-bit weights cannot be split. Use zero2.yaml (each process "
                       "keeps the small 4-bit base whole) or plain data parallel (torchrun)")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ImportError("--load_in_4bit needs the bitsandbytes package, which quantizes the base to 4 bits and "
                          "computes with it: pip install bitsandbytes") from error
