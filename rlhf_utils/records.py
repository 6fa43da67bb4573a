"""Records: what a run writes about itself (summary.json, the trainer state's time totals and budget, sample tables,
evaluation files), for the scripts that share a layout of them.

  the PPO family (ppo.py, rloo.py, grpo.py, reinforce_pp.py)
              fresh_trainer_state, next_state: the time totals, the budget spent and the last metrics, carried by
              checkpoints; run_summary: summary.json; log_evaluation: an evaluation's sample table and its logged means
  the DPO family (dpo.py, kto.py, online_dpo.py)
              sample_table: the samples table of a policy's truncated responses; write_evaluation: an evaluation's
              files (samples, the accuracy table); breakdown_markdown: that table as Markdown

What it never does: compute a number a run trains with. Every metric it writes is a mean or a count of values the
scripts computed (scores, EOS flags, lengths), and the scripts' own evaluations (eval_samples, preference_report)
decide those values.
"""

import os
import time
from typing import Dict, List

import pandas as pd
import torch

from rlhf_utils.run import frame_markdown


# ----------------------------------------------------------------------------------------------------------------------
# The PPO family: the trainer state's records and summary.json
# ----------------------------------------------------------------------------------------------------------------------
def fresh_trainer_state() -> dict:
    """The trainer state of a run that starts at update 0: the time totals, the budget spent (responses sampled and the
    prompts they answer, counted as they are sampled) and the last metrics, for the summary."""
    return {"update": 0, "wall_time_s": 0.0, "metrics": {},
            "totals": {"generation": 0.0, "scoring": 0.0, "training": 0.0, "wall": 0.0},
            "budget": {"budget/responses_sampled": 0, "budget/prompts": 0}}


def next_state(state: dict, start_time: float, timers: dict, metrics: dict, sampled: dict) -> dict:
    """The trainer state after an update: the run's wall time, the time totals and the budget spent (this update's
    `timers` and `sampled` counts added to the state's), and the update's metrics."""
    return {"wall_time_s": time.time() - start_time, "metrics": metrics,
            "totals": {key: state["totals"][key] + timers[key] for key in state["totals"]},
            "budget": {key: state["budget"][key] + sampled[key] for key in state["budget"]}}


def run_summary(args, state: dict, eval_metrics: dict, num_updates: int, start_time: float) -> dict:
    """summary.json: the final evaluation, the last update's objective/ metrics, and the run's speed and time shares
    (the interrupted part of a resumed run included)."""
    totals = state["totals"]
    return {
        **eval_metrics,
        **{k: v for k, v in state["metrics"].items() if k.startswith("objective/")},
        "episodes": num_updates * args.total_batch_size,
        "episodes_per_second": num_updates * args.total_batch_size / totals["wall"],
        "time/generation_share": totals["generation"] / totals["wall"],
        "time/scoring_share": totals["scoring"] / totals["wall"],
        "time/training_share": totals["training"] / totals["wall"],
        **state["budget"], "budget/updates": num_updates,  # the budget as spent (report.py's leaderboard reads it)
        "wall_time_s": time.time() - start_time,
    }


def log_evaluation(run, args, update: int, rows: list):
    """Save the rows of the evaluation after `update` (eval_samples) as samples/step_{update}.csv and log its
    metrics at that update; return the metrics and the table."""
    table = pd.DataFrame(rows)
    run.save_table(table, f"samples/step_{update:06d}.csv")
    metrics = {"eval/score": float(table["score"].mean()), "eval/eos_rate": float(table["has_eos"].mean()),
               "eval/response_token_len_mean": float(table["response_token_len"].mean())}
    run.log(update, {"episode": update * args.total_batch_size, **metrics})
    return metrics, table


# ----------------------------------------------------------------------------------------------------------------------
# The DPO family: the samples table and an evaluation's files
# ----------------------------------------------------------------------------------------------------------------------
def sample_table(tokenizer, raw, rows: torch.Tensor, responses: torch.Tensor):
    """The samples table (the columns every policy script writes) of sample_responses' rows (N,) and truncated
    responses (N, Tr), and its metrics: the EOS rate and the mean response length."""
    has_eos = (responses == tokenizer.eos_token_id).any(1)
    # tokens up to and including the first EOS (all of them when there is none)
    token_len = torch.where(has_eos, (responses == tokenizer.eos_token_id).int().argmax(1) + 1, responses.size(1))
    query_tokens, references = raw["query_token"], raw["reference_response"]
    records = []
    for i, row in enumerate(rows.tolist()):
        query = query_tokens[row]
        records.append({
            "query": tokenizer.decode([t for t in query if t != tokenizer.pad_token_id], skip_special_tokens=True),
            "response": tokenizer.decode(
                [t for t in responses[i].tolist() if t != tokenizer.pad_token_id], skip_special_tokens=True
            ),
            "reference": references[row],
            "score": None,  # no reward model in DPO
            "response_token_len": int(token_len[i]),
            "has_eos": bool(has_eos[i]),
        })
    table = pd.DataFrame(records, columns=["query", "response", "reference", "score", "response_token_len", "has_eos"])
    metrics = {
        "eval/eos_rate": float(has_eos.float().mean()),
        "eval/response_token_len_mean": float(token_len.float().mean()),
    }
    return table, metrics


def write_evaluation(run, args, update: int, final: bool, report: tuple, sampled, sample_raw,
                     tokenizer) -> Dict[str, float]:
    """An evaluation's metrics and outputs: samples/step_N.csv and the TensorBoard text tabs; after training also
    samples.csv, the accuracy table (eval_table.csv, eval_table.md, printed) and every scored pair (eval_pairs.csv)."""
    metrics, table_rows, frame = report  # the script's preference_report: metrics, accuracy rows, pairs
    samples, sample_metrics = sample_table(tokenizer, sample_raw, *sampled)
    metrics.update(sample_metrics)
    run.save_table(samples, f"samples/step_{update:06d}.csv")
    if not run.main:
        return metrics
    run.writer.add_text("eval/accuracy_table", breakdown_markdown(table_rows), update)  # TensorBoard's text tab
    run.writer.add_text("eval/samples", frame_markdown(samples.head(8)), update)
    if final:
        run.save_table(samples, "samples.csv")
        run.save_table(pd.DataFrame(table_rows), "eval_table.csv")
        with open(os.path.join(run.dir, "eval_table.md"), "w") as f:
            f.write(breakdown_markdown(table_rows) + "\n")
        run.save_table(frame, "eval_pairs.csv")
        print(breakdown_markdown(table_rows))
    if args.print_sample_every > 0 and (final or update % args.print_sample_every == 0):
        for row in samples.head(2).itertuples():
            print(f"--- update {update}\nQUERY: {row.query[-200:]}\nRESPONSE: {row.response}\nREFERENCE: {row.reference}")
    return metrics


def breakdown_markdown(rows: List[dict]) -> str:
    """The accuracy table as Markdown, in reward.py's layout so the RM and DPO tables sit side by side."""
    lines = ["| dataset split | metric | key | value | n |", "| --- | --- | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['dataset_split']} | {r['group']} | {r['key']} | {r['value']:.4f} | {r['n']} |")
    return "\n".join(lines)
