"""What decides no number, written once for every script (as CleanRL keeps cleanrl_utils/ beside its scripts).

  checks.py        expected errors (RunError) and input checks: damaged data, missing columns, another tokenizer
  run.py           the run folder, its lock, logs, checkpoints and --resume, the non-finite fallback, processes
  flags.py         the run's flags (RunFlags: --resume, --run_name, --track, ...), online_dpo.py's --endpoint.* flags
                   (EndpointFlags) and the refusals of flag combinations
  models.py        placement (frozen models, ZeRO-3, --offload) and saving (safetensors, a LoRA policy merged)
  records.py       summaries, sample tables and evaluation files
  provenance.py    what produced a run or a report: package versions, Python, CPU, git commit
  rewards.py       a reward from code (--reward_fn): loaded and its answers checked
  judge_client.py  the judge's HTTP client (judge.py, online_dpo.py --judge endpoint)

What it never does: decide a number a script computes. Tokenizer and [PAD], batch arithmetic, data order, sampling,
losses, metrics and how a model is built stay in each script; the helpers the scripts share for them are copied
into each (tests/test_shared_helpers.py keeps the copies identical), and nothing here is imported for them.
"""
