"""What tests/test_zero3_traps.py runs in each of 2 processes under zero3.yaml (DeepSpeed's CPU accelerator, gloo):

    DS_ACCELERATOR=cpu accelerate launch --config_file zero3.yaml --num_processes 2 --mixed_precision no \
        tests/zero3_traps_probe.py OUT_DIR FINITE_MODEL NAN_MODEL TIMEOUT_MIN

1. rlhf_utils.run.start_processes(TIMEOUT_MIN) joins the process group, as every script does with
   --process_group_timeout_min.
2. check_finite on NAN_MODEL loaded by from_pretrained under ZeRO-3's init (every weight partitioned, empty on each
   process): does it find the NaN?
3. ilql.ilql_generate on the ZeRO-3 engine of FINITE_MODEL + ILQL heads, where rank 0's rows all end at the first token
   (its EOS is the token it samples first, top_k 1) and rank 1's never (its EOS is [PAD], which is never sampled):
   the ranks must run as many forward passes, or their all-gathers stop matching.
4. The timeout: rank 0 waits in a barrier that rank 1 never joins; it must fail after TIMEOUT_MIN, not torch's default.
Each rank writes OUT_DIR/rank{R}.json with what it saw, then both leave without the interpreter's teardown (a broken
collective can leave a process group that hangs in destroy_process_group)."""

import json
import os
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))

from conftest import load_script  # noqa: E402
from rlhf_utils import checks  # noqa: E402
from rlhf_utils import run as run_module  # noqa: E402

out_dir, finite_model, nan_model, timeout_min = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
state = run_module.start_processes(timeout_min)  # 1.
from accelerate import Accelerator  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

accelerator = Accelerator()
accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
rank, record = accelerator.process_index, {}

# 2. check_finite on partitioned weights
nan_lm = AutoModelForCausalLM.from_pretrained(nan_model)
record["partitioned"] = all(hasattr(p, "ds_id") and p.numel() == 0 for p in nan_lm.parameters())
try:
    checks.check_finite(nan_lm, nan_model)
    record["check_finite"] = "passed"
except checks.NonFiniteError as error:
    record["check_finite"] = str(error)

# 3. ilql_generate with rows that end early on rank 0 only
ilql = load_script("ilql")
lm = AutoModelForCausalLM.from_pretrained(finite_model)
model = ilql.ILQLModel(lm, two_qs=True)
engine, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
unwrapped = accelerator.unwrap_model(engine).eval()
PAD, LENGTH = lm.config.pad_token_id, 6
queries = torch.tensor([[PAD, 5, 6, 7], [8, 9, 10, 11]])
first = ilql.ilql_generate(unwrapped, queries, PAD, PAD, 1, 0.0, 1.0, 1)[:, -1]  # the tokens top_k 1 takes first
eos = int(first[0]) if rank == 0 and bool((first == first[0]).all()) else PAD
if rank == 0 and eos == PAD:  # the two rows' first tokens differ: a row of its own ends the batch at once
    queries, eos = queries[:1], int(first[0])
responses = ilql.ilql_generate(unwrapped, queries, PAD, eos, LENGTH, 0.0, 1.0, 1)[:, queries.size(1):]
record.update(eos=eos, responses=responses.tolist())
gathered = accelerator.gather(torch.tensor([float(responses.numel())]))  # after generate, the ranks meet again
record["gathered"] = gathered.tolist()

# 4. the process group's timeout
if rank == 0:
    start = time.time()
    try:
        torch.distributed.barrier()
        record["barrier"] = "joined"
    except RuntimeError as error:  # torch's DistBackendError is one
        record["barrier"] = str(error)
    record["barrier_s"] = time.time() - start
json.dump(record, open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w"))
os.replace(os.path.join(out_dir, f"rank{rank}.json.tmp"), os.path.join(out_dir, f"rank{rank}.json"))
while rank == 1 and not os.path.exists(os.path.join(out_dir, "rank0.json")):  # never joins rank 0's barrier
    time.sleep(0.2)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
