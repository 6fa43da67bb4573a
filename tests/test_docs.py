"""The docs a reader follows: every link between them lands on a file and a heading that exist, and the README's
leaderboard and frontier tables are, cell by cell, the same rows of docs/results.md's tables, which are the runs' own
report files (docs/leaderboard/leaderboard.md and docs/frontier/frontier.md, committed from the runs)."""

import os
import re

import pytest

from tests.conftest import REPO_ROOT

DOCS = ["README.md", "docs/results.md", "docs/usage.md", "docs/history.md"]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, each space a '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of a Markdown file's headings (outside code blocks), a repeated one numbered as GitHub does."""
    seen, found, in_code = {}, set(), False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def links(path: str) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and image in a file that is not a web address."""
    found, in_code = [], False
    for number, line in enumerate(open(path, encoding="utf-8"), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            found += [(number, target) for target in re.findall(r"\]\(([^)\s]+)\)", line)
                      if not re.match(r"[a-z]+://|mailto:", target)]
    return found


@pytest.mark.parametrize("doc", [d for d in DOCS if os.path.exists(os.path.join(REPO_ROOT, d))])
def test_every_link_lands_on_a_file_and_a_heading(doc):
    path = os.path.join(REPO_ROOT, doc)
    broken = []
    for number, target in links(path):
        file, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(where):
            broken.append(f"{doc}:{number}: {target}: no file {os.path.relpath(where, REPO_ROOT)}")
        elif anchor and where.endswith(".md") and anchor not in anchors(where):
            broken.append(f"{doc}:{number}: {target}: no heading with anchor #{anchor} in "
                          f"{os.path.relpath(where, REPO_ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_anchor_rule_is_githubs():
    assert slug("Every algorithm: `--mode full`") == "every-algorithm---mode-full"
    assert slug("How the pipeline's settings were chosen") == "how-the-pipelines-settings-were-chosen"
    assert slug("Speed round 4: each query once (issue 65)") == "speed-round-4-each-query-once-issue-65"


def table(path: str, first_header: str) -> tuple[list[str], dict[str, list[str]]]:
    """The Markdown table of a file whose header row begins with `first_header`: its header cells and its rows by
    their first cell."""
    lines = open(path, encoding="utf-8").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_header))
    cells = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells.append([c.strip() for c in line.strip().strip("|").split("|")])
    header, rows = cells[0], cells[2:]
    return header, {row[0]: row for row in rows}


def test_the_readme_leaderboard_is_the_results_table_which_is_the_runs_report():
    run_header, run_rows = table(os.path.join(REPO_ROOT, "docs", "leaderboard", "leaderboard.md"), "| method | budget")
    header, rows = table(os.path.join(REPO_ROOT, "docs", "results.md"), "| method | budget")
    assert header == run_header and rows == run_rows  # results.md holds the run's table as the run wrote it
    readme_header, readme_rows = table(os.path.join(REPO_ROOT, "README.md"), "| method | gold win rate")
    assert set(readme_rows) == set(rows) and len(readme_rows) == len(rows) >= 17
    columns = {"gold win rate, mean over seeds [95% t-interval]": "mean [95% t-interval]",
               "beats (paired, Holm)": "beats (paired, Holm)", "KL from SFT (SE)": "KL from SFT (SE)"}
    assert readme_header == ["method", *columns]
    for method, cells in readme_rows.items():
        for readme_column, column in columns.items():
            assert cells[readme_header.index(readme_column)] == rows[method][header.index(column)], (method, column)


def test_the_readme_frontier_is_the_results_table_which_is_the_runs_report():
    run_header, run_rows = table(os.path.join(REPO_ROOT, "docs", "frontier", "frontier.md"), "| method | KL ")
    header, rows = table(os.path.join(REPO_ROOT, "docs", "results.md"), "| method | KL ")
    assert header == run_header and rows == run_rows  # results.md holds the run's matched-KL table as it was written
    readme_header, readme_rows = table(os.path.join(REPO_ROOT, "README.md"), "| method | gold win rate at KL")
    assert set(readme_rows) == set(rows) and len(readme_rows) == len(rows) >= 5
    columns = {f"gold win rate at KL {level}": f"KL {level}" for level in ("0.25", "0.5", "1")}
    columns["- PPO at KL 0.5 (Holm)"] = "- PPO at KL 0.5 (Holm)"
    assert readme_header == ["method", *columns]
    for method, cells in readme_rows.items():
        for readme_column, column in columns.items():
            assert cells[readme_header.index(readme_column)] == rows[method][header.index(column)], (method, column)
