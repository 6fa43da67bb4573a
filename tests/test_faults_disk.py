"""Issue 64, items 1 and 2 and 6 (second bullet): a disk that fills, a damaged reply cache, a cut JSON-lines source.

A full disk is simulated, never made: `disk_fills` makes every write to chosen files of a folder write half of what it
is given and then raise ENOSPC (what a real full disk does: the file is created, its first bytes land, the rest does
not), and sqlite's own limit of pages (PRAGMA max_page_count) makes the reply cache raise the very error a full disk
gives it. Expected everywhere: one RunError paragraph naming the full folder, no cut file under a finished name, and
the same call finishing once the space is back.
"""

import builtins
import errno
import glob
import json
import os
import sqlite3
import subprocess
import sys

import pandas as pd
import pytest

from conftest import load_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data import gold_judge_server as gjs  # noqa: E402
from rlhf_utils import judge_client  # noqa: E402
from rlhf_utils.checks import RunError  # noqa: E402

judge = load_script("judge")


def disk_fills(monkeypatch, folder, name_end: str = "") -> None:
    """From now on a file opened for writing in `folder` (whose name ends with `name_end`) is created, takes half of
    its first write, then raises ENOSPC, as on a disk that fills during the write."""
    real_open, folder = builtins.open, os.path.abspath(folder)

    class Filling:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def filling_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        path = os.path.abspath(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else ""
        if any(m in mode for m in "wax") and os.path.dirname(path) == folder and path.endswith(name_end):
            return Filling(f)
        return f

    monkeypatch.setattr(builtins, "open", filling_open)


def cut_files(folder) -> list:
    """What a failed write must not leave: empty files, and temporary files of the atomic writes."""
    return [name for name in os.listdir(folder)
            if name.startswith(".tmp_") or os.path.getsize(os.path.join(folder, name)) == 0]


# ---------------------------------------------------------------------------------------------------------------------
# the pipeline: stage markers and cpu.json
# ---------------------------------------------------------------------------------------------------------------------
def fake_pipeline(tmp_path, monkeypatch, cpu: str = "CPU A"):
    """A one-seed pipeline of prep, sft and rm whose stages are faked: each leaves complete outputs, and `ran` lists
    (stage, the command's last flag)."""
    import pipeline

    monkeypatch.setattr(pipeline, "cpu_type", lambda: cpu)
    p = pipeline.Pipeline(pipeline.Args(out=str(tmp_path)))
    os.makedirs(p.data, exist_ok=True)
    p.stages, ran = ["prep", "sft", "rm"], []

    def run(stage, cmd):
        ran.append((stage, cmd[-1]))
        if stage == "prep":
            return open(os.path.join(p.data, "task.json"), "w").write("{}")
        os.makedirs(os.path.join(p.models, stage), exist_ok=True)
        with open(os.path.join(p.models, stage, "run.json"), "w") as f:
            json.dump({"complete": True}, f)

    p.run = run
    return p, ran


def test_a_marker_cut_by_a_full_disk_is_not_left_and_an_unreadable_one_reruns_its_stage(tmp_path, monkeypatch, capsys):
    p, ran = fake_pipeline(tmp_path, monkeypatch)
    with monkeypatch.context() as full:
        disk_fills(full, p.stage_dir, name_end="rm.json")
        with pytest.raises(RunError) as error:
            p.main()
    assert f"the disk holding {p.stage_dir} is full: the stage marker of [rm] was not saved" in str(error.value)
    assert "run the same command again" in str(error.value)
    assert [s for s, _ in ran] == ["prep", "sft", "rm"] and not os.path.exists(p.marker("rm"))
    assert cut_files(p.stage_dir) == []
    p, ran = fake_pipeline(tmp_path, monkeypatch)  # space freed: rm runs again, prep and sft are done
    p.main()
    assert [s for s, _ in ran] == ["rm"] and json.load(open(p.marker("rm")))["stage"] == "rm"

    # a marker an older version left empty (or cut) as the disk filled: absent, said in one line, the stage reruns
    open(p.marker("sft"), "w").close()
    capsys.readouterr()
    p, ran = fake_pipeline(tmp_path, monkeypatch)
    p.main()
    assert [s for s, _ in ran] == ["sft"] and json.load(open(p.marker("sft")))["stage"] == "sft"
    told = [line for line in capsys.readouterr().out.splitlines() if "cannot be read" in line]
    assert told == [f"=== [sft] its marker {p.marker('sft')} cannot be read (JSONDecodeError: Expecting value: line 1 "
                    "column 1 (char 0); e.g. written as the disk filled): taken as absent, the stage runs again"]


def test_an_unreadable_cpu_json_takes_the_cpu_type_from_the_markers_never_this_one(tmp_path, monkeypatch, capsys):
    """cpu.json cut empty on type A, rm interrupted there after a checkpoint: on type B every stage reruns from the
    start (rm with --restart, not a --resume of type A's checkpoint), as with a readable cpu.json naming A."""
    p, ran = fake_pipeline(tmp_path, monkeypatch, "CPU A")
    p.main()
    os.remove(os.path.join(p.models, "rm", "run.json"))
    os.remove(p.marker("rm"))
    os.makedirs(os.path.join(p.runs, "rm", "checkpoints", "update_000002"))
    open(tmp_path / "cpu.json", "w").close()
    capsys.readouterr()
    p, ran = fake_pipeline(tmp_path, monkeypatch, "CPU B")
    p.main()
    assert ran == [("prep", ran[0][1]), ("sft", ran[1][1]), ("rm", "--restart")]
    out = capsys.readouterr().out
    assert f"=== {tmp_path / 'cpu.json'} cannot be read (JSONDecodeError" in out
    assert "the CPU type its stages ran on is taken from their markers: CPU A" in out
    assert json.load(open(tmp_path / "cpu.json")) == {"cpu": "CPU B"}

    with monkeypatch.context() as full:  # cpu.json on a full disk: one paragraph, no empty cpu.json left
        disk_fills(full, tmp_path, name_end="cpu.json")
        p, ran = fake_pipeline(tmp_path, monkeypatch, "CPU C")
        with pytest.raises(RunError, match=f"the disk holding {tmp_path} is full: the record of the CPU type"):
            p.main()
    assert json.load(open(tmp_path / "cpu.json")) == {"cpu": "CPU B"} and ran == []


# ---------------------------------------------------------------------------------------------------------------------
# report.py: an unreadable marker, a full report folder
# ---------------------------------------------------------------------------------------------------------------------
def test_the_leaderboard_reads_past_an_empty_marker_and_a_full_report_folder_leaves_no_empty_png(tmp_path, monkeypatch):
    import report
    from test_leaderboard_stats import SEEDS, fake_pipelines

    pipelines = fake_pipelines(tmp_path)
    (tmp_path / "cpu.json").write_text(json.dumps({"cpu": "CPU A"}))
    open(pipelines[0].marker("ppo"), "w").close()  # cut empty as the disk filled
    report_dir = tmp_path / "report"
    with monkeypatch.context() as full:
        disk_fills(full, report_dir, name_end=".png")
        with pytest.raises(RunError) as error:
            report.write_leaderboard(str(tmp_path), SEEDS, pipelines)
    assert str(error.value).startswith(f"the disk holding {report_dir} is full: the report's leaderboard.png was not "
                                       "saved. Free space there and run the same pipeline.py command again")
    assert not (report_dir / "leaderboard.png").exists() and cut_files(report_dir) == []
    text = report.write_leaderboard(str(tmp_path), SEEDS, pipelines)  # space freed
    assert (report_dir / "leaderboard.png").stat().st_size > 1000 and "| PPO |" in text
    table = pd.read_csv(report_dir / "leaderboard.csv").set_index("stage")
    assert table.loc["ppo", "wall_time_s"] == 10.0  # the mean of the seeds whose marker reads


# ---------------------------------------------------------------------------------------------------------------------
# judge.py: a full output folder, a full reply cache folder, a damaged reply cache
# ---------------------------------------------------------------------------------------------------------------------
def samples(path, n: int = 40) -> None:
    from test_judge import make_samples

    make_samples(path, n, seed=3, ties=False)


def judge_args(tmp_path, server, **kw):
    base = dict(csv=[str(tmp_path / "a.csv")], output_dir=str(tmp_path / "out"), base_url=server.base_url,
                model=server.model_name, cache_path=str(tmp_path / "cache" / "replies.sqlite"), length_unit="chars",
                backoff_base_s=0.001, backoff_max_s=0.01, timeout_s=20.0)
    return judge.Args(**{**base, **kw})


@pytest.fixture(scope="module")
def gold_server():
    """One gold judge for the module: the endpoint is part of a reply's cache key, so a cache made here is reused."""
    with gjs.serve_in_thread() as server:
        yield server


@pytest.fixture(scope="module")
def undamaged(tmp_path_factory, gold_server):
    """A judge run of 40 rows with a fresh cache: its win rate, its cache file (closed: every reply in the file)."""
    root = tmp_path_factory.mktemp("undamaged")
    samples(root / "a.csv")
    before = gold_server.request_count
    summary = judge.main(judge_args(root, gold_server))
    assert gold_server.request_count - before == 40
    return summary["per_csv"]["a"], str(root / "cache" / "replies.sqlite")


def same_verdicts(summary: dict, undamaged: dict) -> bool:
    keys = ("win_rate", "ci_low", "ci_high", "wins", "losses", "ties", "invalid", "n")
    return [summary[k] for k in keys] == [undamaged[k] for k in keys]


def test_a_full_output_folder_leaves_no_cut_judged_csv_and_the_rerun_asks_nothing_again(tmp_path, monkeypatch,
                                                                                         undamaged):
    samples(tmp_path / "a.csv")
    out = tmp_path / "out"
    with gjs.serve_in_thread() as server:  # (a server of its own: its count of requests is this test's)
        with monkeypatch.context() as full:
            disk_fills(full, out, name_end="a_judged.csv")
            with pytest.raises(RunError) as error:
                judge.main(judge_args(tmp_path, server))
        assert str(error.value).startswith(f"the disk holding {out} is full: a_judged.csv was not saved. Free space "
                                           "there (or pass another --output_dir) and run the same command again")
        assert not (out / "a_judged.csv").exists() and cut_files(out) == []
        asked = server.request_count
        summary = judge.main(judge_args(tmp_path, server))  # space freed: every reply comes from the cache
        assert asked == 40 and server.request_count == 40
    assert same_verdicts(summary["per_csv"]["a"], undamaged[0])
    assert len(pd.read_csv(out / "a_judged.csv")) == 40


def test_a_full_reply_cache_folder_is_one_paragraph_and_the_rerun_reuses_the_cache(tmp_path, monkeypatch,
                                                                                   undamaged):
    samples(tmp_path / "a.csv")
    real_connect = sqlite3.connect

    def small_disk_connect(path, *args, **kwargs):  # the database may not grow past 4 pages: SQLITE_FULL
        db = real_connect(path, *args, **kwargs)
        db.execute("PRAGMA max_page_count = 4")
        return db

    cache = tmp_path / "cache" / "replies.sqlite"
    with gjs.serve_in_thread() as server:
        with monkeypatch.context() as full:
            full.setattr(judge_client.sqlite3, "connect", small_disk_connect)
            with pytest.raises(RunError) as error:
                judge.main(judge_args(tmp_path, server, max_parallel_requests=1))
        assert str(error.value).startswith(
            f"the disk holding {cache.parent} is full: the judge's reply cache {cache} cannot take another reply "
            "(sqlite3: database or disk is full). Every reply it took before is kept in it")
        kept = real_connect(cache).execute("SELECT count(*) FROM replies").fetchone()[0]
        first = server.request_count
        # the reply that did not fit, and at most one more request in flight (--max_parallel_requests 1), asked again
        assert 0 < kept < 40 and kept < first <= kept + 2
        summary = judge.main(judge_args(tmp_path, server))
        assert server.request_count - first == 40 - kept
    assert same_verdicts(summary["per_csv"]["a"], undamaged[0])


def damage(path: str, how: str) -> None:
    size = os.path.getsize(path)
    if how == "cut":
        os.truncate(path, int(0.6 * size))
    elif how == "garbage_page":
        with open(path, "r+b") as f:  # a page of garbage in the middle (sqlite's pages: 4096 bytes)
            f.seek(4096 * (size // 4096 // 2))
            f.write(bytes(range(256)) * 16)
    else:
        with open(path, "w") as f:
            f.write("query,response\nnot,a database\n")


@pytest.mark.parametrize("how", ["cut", "garbage_page", "not_a_database"])
def test_a_damaged_reply_cache_is_moved_aside_its_readable_replies_kept_and_the_win_rates_unchanged(
        tmp_path, undamaged, gold_server, capsys, how):
    import shutil

    samples(tmp_path / "a.csv")
    cache = tmp_path / "cache" / "replies.sqlite"
    os.makedirs(cache.parent)
    shutil.copy(undamaged[1], cache)
    damage(str(cache), how)
    damaged = open(cache, "rb").read()
    before = gold_server.request_count
    summary = judge.main(judge_args(tmp_path, gold_server))
    asked = gold_server.request_count - before
    assert same_verdicts(summary["per_csv"]["a"], undamaged[0])
    aside = glob.glob(f"{cache}.damaged-*")
    assert len(aside) == 1 and open(aside[0], "rb").read() == damaged  # moved aside, not deleted, not changed
    carried = 40 - asked
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: the judge's")]
    assert len(warning) == 1 and f"reply cache {cache} is damaged (" in warning[0]
    assert f"moved aside to {aside[0]}; the {carried} replies of it that still read are carried over" in warning[0]
    if how == "not_a_database":
        assert carried == 0 and "file is not a database" in warning[0]
    elif how == "cut":
        assert 0 < carried < 40  # the rows of the pages that remain
    else:
        assert 0 < carried <= 40
    assert sqlite3.connect(cache).execute("SELECT count(*) FROM replies").fetchone()[0] == 40


def test_a_cut_write_ahead_log_still_recovers_by_itself(tmp_path, capsys):
    """sqlite drops the frames of a write-ahead log cut short: the cache opens as it is, without a repair."""
    import shutil

    live = judge_client.ReplyCache(str(tmp_path / "live.sqlite"))
    live.db.execute("PRAGMA wal_autocheckpoint = 0")  # every reply stays in the log
    keys = [judge_client.ReplyCache.key("m", "u", "s", f"prompt {i}", None, 1, 0) for i in range(30)]
    for key in keys:
        live.put(key, "m", "Comparison: x\nPreferred: A " * 20)
    for suffix in ("", "-wal"):
        shutil.copy(str(tmp_path / "live.sqlite") + suffix, str(tmp_path / "copy.sqlite") + suffix)
    live.close()
    os.truncate(tmp_path / "copy.sqlite-wal", int(0.5 * os.path.getsize(tmp_path / "copy.sqlite-wal")))
    copy = judge_client.ReplyCache(str(tmp_path / "copy.sqlite"))
    kept = [key for key in keys if copy.get(key) is not None]
    copy.close()
    assert 0 < len(kept) < 30 and kept == keys[: len(kept)]
    assert not glob.glob(str(tmp_path / "copy.sqlite.damaged-*")) and "warning" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# data/prepare.py: a cut JSON-lines source is one paragraph
# ---------------------------------------------------------------------------------------------------------------------
FIXTURES = os.path.join(REPO, "data", "fixtures")


def cut_source(tmp_path):
    """A tokenizer, and a TL;DR SFT source folder whose second line is cut in the middle."""
    from data import synthetic

    good = open(os.path.join(FIXTURES, "tldr_sft", "train.jsonl")).read().splitlines()
    synthetic.train_tokenizer(good, vocab_size=300).save_pretrained(tmp_path / "tokenizer")
    source = tmp_path / "source"
    source.mkdir()
    (source / "train.jsonl").write_text("\n".join([good[0], good[1][: len(good[1]) // 2], *good[2:]]) + "\n")
    return source


def test_a_cut_jsonl_line_is_an_input_error_printed_as_one_line(tmp_path, capsys):
    from data import prepare

    source = cut_source(tmp_path)
    args = prepare.Args(task="tldr", output_dir=str(tmp_path / "out"), base_model=str(tmp_path / "tokenizer"),
                        sft_data=str(source), preference_data=os.path.join(FIXTURES, "tldr_comparisons"), plots=False)
    with pytest.raises(prepare.InputError) as error:
        prepare.main(args)
    capsys.readouterr()
    prepare.print_expected_error(type(error.value), error.value, error.value.__traceback__)
    printed = capsys.readouterr().err
    assert printed.count("\n") == 1 and printed.startswith(f"{os.path.basename(sys.argv[0])}: error: {source}/train"
                                                            ".jsonl:2: not valid JSON: ")


@pytest.mark.slow  # a subprocess that loads the tokenizer: 3-8 s on 2 busy cores
def test_a_cut_jsonl_line_is_one_paragraph_from_data_prepare(tmp_path):
    source, fixtures = cut_source(tmp_path), FIXTURES
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "data", "prepare.py"), "--task", "tldr", "--output_dir",
         str(tmp_path / "out"), "--base_model", str(tmp_path / "tokenizer"), "--sft_data", str(source),
         "--preference_data", os.path.join(fixtures, "tldr_comparisons"), "--no-plots"],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0].startswith(f"prepare.py: error: {source / 'train.jsonl'}:2: not valid JSON: ")
    assert "(the line ends early: cut in the middle?)" in lines[0] and "nothing was saved" in lines[0]
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")


def test_damaged_replies_are_read_row_by_row_past_a_damaged_page(tmp_path):
    """readable_rows keeps the rows on either side of a damaged page: after it, the scan picks up again."""
    db = sqlite3.connect(tmp_path / "c.sqlite")
    db.execute("CREATE TABLE replies (key TEXT PRIMARY KEY, model TEXT, reply TEXT, created REAL)")
    db.executemany("INSERT INTO replies VALUES (?, ?, ?, ?)",
                   [(f"{i:064d}", "m", "reply " * 40, float(i)) for i in range(300)])
    db.commit()
    db.close()
    pages = os.path.getsize(tmp_path / "c.sqlite") // 4096
    with open(tmp_path / "c.sqlite", "r+b") as f:
        f.seek(4096 * (pages // 3))
        f.write(b"\xff" * 4096)
    rows = judge_client.readable_rows(str(tmp_path / "c.sqlite"))
    created = [row[3] for row in rows]
    assert created == sorted(created) and 200 < len(rows) < 300
    assert created[0] == 0.0 and created[-1] == 299.0  # rows before and after the damaged page
    assert all(row[2] == "reply " * 40 for row in rows)


@pytest.fixture(autouse=True)
def _no_real_key(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


def test_the_cache_is_checked_once_per_file_and_process(tmp_path, monkeypatch):
    """online_dpo.py reopens its reply cache every round: sqlite's page check (a pass over the whole file) runs at
    the first opening of each file in a process, not at every reopening."""
    checked = []
    real = judge_client.ReplyCache.damage
    monkeypatch.setattr(judge_client.ReplyCache, "damage", staticmethod(lambda db: checked.append(db) or real(db)))
    for path in ("rounds.sqlite", "rounds.sqlite", "rounds.sqlite", "other.sqlite"):
        judge_client.ReplyCache(str(tmp_path / path)).close()
    assert len(checked) == 2
