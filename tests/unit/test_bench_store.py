"""bench/store/'s report and load: the added p50 is paired within a round and judged on its median over rounds, the
verdict and table say so, and a chain's turns name the previous turn (store) or carry the whole history (no store)."""

from __future__ import annotations

from bench.store import load, report


def cell(mode: str, round_: int, p50: float, workload: str = "plain", concurrency: int = 1, **extra) -> dict:
    return {"mode": mode, "workload": workload, "concurrency": concurrency, "round": round_, "req_per_s": 100.0,
            "latency_ms": {"p50": p50, "p90": p50 * 1.5, "p99": p50 * 2, "mean": p50}, "errors_total": 0,
            "router_cpu_ms_per_turn": p50 / 2, "postgres_cpu_ms_per_turn": 0.5 if mode == "postgresql" else 0.0,
            "contended": False, **extra}


def three_rounds() -> list[dict]:
    # round 1 is slower for every mode alike: paired within rounds, the added p50 stays 1.0 (SQLite), 2.5 (PostgreSQL)
    cells = []
    for r, slow in enumerate((0.0, 5.0, 0.0)):
        cells += [cell("off", r, 1.0 + slow), cell("sqlite", r, 2.0 + slow), cell("postgresql", r, 3.5 + slow)]
    return cells


def test_the_added_p50_is_paired_within_a_round_and_judged_on_its_median():
    derived = report.derive(three_rounds())
    plain = derived["cells"]["plain, c1"]
    assert plain["sqlite"]["added_p50_ms_per_round"] == [1.0, 1.0, 1.0]
    assert plain["postgresql"]["added_p50_ms"] == {"p10": 2.5, "p50": 2.5, "p90": 2.5}
    assert plain["off"]["p50_ms"]["p50"] == 1.0 and plain["off"]["p99_ms"]["p50"] == 2.0
    verdicts = derived["verdicts"]
    assert verdicts["plain, c1, sqlite: added p50 (median over rounds) <= 2.0 ms"]["pass"] is True
    assert verdicts["plain, c1, postgresql: added p50 (median over rounds) <= 2.0 ms"]["pass"] is False


def test_the_table_shows_each_store_against_the_target():
    cells = [*three_rounds(), cell("off", 0, 1.0, contended=True, workload="chain"),
             cell("sqlite", 0, 1.5, workload="chain"), cell("postgresql", 0, 2.0, workload="chain")]
    result = {"settings": {"rounds": 3, "duration_s": 2.5}, "derived": report.derive(cells)}
    text = report.table(result)
    assert "| plain | 1 | 1.00/2.00 | 2.00/4.00 | +1.00 (+1.00..+1.00) met | 3.50/7.00 | " \
           "+2.50 (+2.50..+2.50) **not met** | 0.50/1.00/1.75+0.50 |" in text
    assert "| chain | 1 |" in text and "1 cells contended" in text
    assert result["derived"]["contended_cells"] == ["off/chain/c1/round 0"]


def test_percentiles_interpolate_and_an_empty_cell_has_none():
    assert report.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert report.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == 4.6
    assert report.latency([]) == dict.fromkeys(("p50", "p90", "p99", "mean"))


def test_a_stored_chain_names_its_previous_turn_and_starts_over_after_chain_turns():
    chain = load.Conversation(store=True)
    first = chain.body("one")
    assert "previous_response_id" not in first and first["store"] is True
    chain.answered(first, {"id": "resp_1", "output": [{"type": "message"}]})
    second = chain.body("two")
    assert second["previous_response_id"] == "resp_1" and second["input"] == [{"role": "user", "content": "two"}]
    for n in range(2, load.CHAIN_TURNS + 1):
        chain.answered(chain.body("more"), {"id": f"resp_{n}", "output": []})
    assert "previous_response_id" not in chain.body("a new chain")


def test_without_the_store_the_client_sends_the_whole_history():
    chain = load.Conversation(store=False)
    first = chain.body("one")
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}]
    chain.answered(first, {"id": "resp_1", "output": output})
    second = chain.body("two")
    assert second["store"] is False and "previous_response_id" not in second
    assert second["input"] == [{"role": "user", "content": "one"}, *output, {"role": "user", "content": "two"}]
