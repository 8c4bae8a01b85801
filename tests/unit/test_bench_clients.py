"""`make bench-clients`' verdict on guidellm's JSON report (bench/openai/clients_report.py), on a report captured from
guidellm 0.8.1 against its own mock server and trimmed (tests/unit/data/guidellm-report.json: chat, 1 and 4 streams,
3 requests each), and a request it filed as errored against a server that answered 500."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest

from bench.openai import clients, clients_report

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def clean() -> dict:
    return json.loads((DATA / "guidellm-report.json").read_text())


def errored_request() -> dict:
    return json.loads((DATA / "guidellm-errored-request.json").read_text())


def test_a_clean_report_passes_and_is_summarized(clean):
    assert clients_report.check(clean) == []
    summary = clients_report.result({"chat.json": clean})
    assert summary["passed"] and summary["errors"] == 0 and summary["requests"] == 6
    assert [c["cell"] for c in summary["cells"]] == ["chat c1", "chat c4"]
    cell = summary["cells"][0]
    assert cell["requests"] == {"successful": 3, "errored": 0, "incomplete": 0}
    assert cell["ttft_ms"]["p50"] > 0 and cell["itl_ms"]["p99"] >= cell["itl_ms"]["p50"] > 0


def test_an_errored_request_fails_the_report(clean):
    """guidellm moves a failed request out of `successful` into `errored` and counts it: as it wrote the 500 run."""
    bench = clean["benchmarks"][1]
    bench["requests"]["successful"].pop()
    bench["requests"]["errored"].append(errored_request())
    bench["metrics"]["request_totals"].update(successful=2, errored=1)
    problems = clients_report.check(clean)
    assert len(problems) == 2, problems
    assert problems[0].startswith("chat c4: 1 request(s) errored: 1 x HTTPStatusError(")
    assert "500 Internal Server Error" in problems[0] and "For more information" not in problems[0]
    assert problems[1] == "chat c4: 2 of 3 requests answered"
    assert not clients_report.result({"chat.json": clean})["passed"]


def test_a_count_of_errors_without_the_requests_still_fails(clean):
    """With guidellm's request sampling on, the lists hold a sample: the counts are what decide."""
    clean["benchmarks"][0]["metrics"]["request_totals"]["incomplete"] = 1
    assert clients_report.check(clean) == ["chat c1: 1 request(s) incomplete"]


def test_a_request_guidellm_filed_nowhere_fails_the_report(clean):
    """As a run under strace left it: 3 created, 2 recorded, one still in flight when the cell ended, no error."""
    bench = clean["benchmarks"][0]
    bench["requests"]["successful"].pop()
    bench["metrics"]["request_totals"].update(successful=2, total=2)
    bench["scheduler_state"].update(processed_requests=2, successful_requests=2, processing_requests=1)
    assert clients_report.check(clean) == [
        "chat c1: 2 of 3 requests answered (1 still in flight when guidellm ended the cell)"]


@pytest.mark.parametrize(("change", "why"), [
    (lambda r: r.update(output=""), "no text in the answer"),  # the text was somewhere guidellm did not read it
    (lambda r: r.update(output_tokens=12), "12 output tokens, asked for 64"),
    (lambda r: r["info"]["timings"].update(token_iterations=1), "not streamed"),
    (lambda r: r.update(time_to_first_token_ms=None), "no first token time"),
])
def test_an_answer_not_parsed_whole_fails_the_report(clean, change, why):
    change(clean["benchmarks"][0]["requests"]["successful"][1])
    problems = clients_report.check(clean)
    assert len(problems) == 1 and problems[0].startswith("chat c1: 1 answer(s) not parsed whole: 1 x "), problems
    assert why in problems[0]


def test_a_report_with_no_benchmark_fails(clean):
    clean["benchmarks"] = []
    assert clients_report.check(clean) == ["the report has no benchmark (guidellm stopped before any cell ran)"]


def test_the_cli_exits_non_zero_on_a_failed_report(clean, tmp_path, capsys):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(clean))
    broken = copy.deepcopy(clean)
    broken["benchmarks"][0]["metrics"]["request_totals"]["errored"] = 2
    bad.write_text(json.dumps(broken))
    assert clients_report.main([str(good)]) == 0
    assert clients_report.main([str(good), str(bad)]) == 1
    assert "problem: bad.json: chat c1: 2 request(s) errored" in capsys.readouterr().out


def test_the_guidellm_command_is_offline_and_streamed(tmp_path):
    args = argparse.Namespace(model="smollm2-135m-instruct", streams=[1, 4], prompt_tokens=256,
                              output_tokens=64, requests=16, timeout=300.0,
                              tokenizer=Path("models/smollm2-135m-instruct"))
    cmd = clients.command(Path(".venv-clients/bin/guidellm"), "http://127.0.0.1:8000", "/v1/completions", args,
                          tmp_path / "r.json")
    backend = cmd[cmd.index("--backend") + 1]
    assert "request_format=/v1/completions" in backend and "stream=true" in backend
    assert cmd[cmd.index("--override") + 1:cmd.index("--override") + 3] == ["profile.streams", "1,4"]
    assert Path(cmd[cmd.index("--tokenizer") + 1].split("model=")[1]).is_absolute()  # a folder, not a hub id
    env = clients.environment()
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_DISABLE_TELEMETRY"] == "1" and "PYTHONPATH" not in env


def test_the_summary_and_its_picture_are_written(clean, tmp_path):
    summary = clients_report.result({"chat.json": clean})
    clients_report.write(summary, tmp_path / "clients")
    assert json.loads((tmp_path / "clients.json").read_text())["cells"][1]["cell"] == "chat c4"
    assert (tmp_path / "clients.png").stat().st_size > 10_000
    nothing = clients_report.result({})  # guidellm wrote no report: a failure, still drawn
    assert nothing["problems"] == ["no guidellm report to check"] and not nothing["passed"]
    clients_report.write(nothing, tmp_path / "empty")
