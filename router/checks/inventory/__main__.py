"""`python -m router.checks.inventory > docs/limits.md`: the inventory as the reference a client reads."""

from __future__ import annotations

import json

from router.checks.inventory import TABLES, Decision, rules


def intro(version: str) -> str:
    return f"""# Errors and limits: every request field, decided

Generated from `router/checks/inventory/` by `python -m router.checks.inventory > docs/limits.md`; a unit test checks
that it is current and names every field of SGLang {version}'s request types. Errors: [errors.md](errors.md).

A field in no table, or *refused*, gets a 400 naming it, unless sent as `null` or as SGLang's default where the table
names one (`field (default ...)`): that asks for nothing, and is left out. Every other field is type-checked strictly
(no `"5"` for 5) and bounded, by the chosen pair where the limit is the pair's (vocabulary size, context length, its
workers' options). Static limits: at most {rules.MAX_BATCH} batch items,
{rules.MAX_STOP} stop strings of {rules.MAX_STOP_CHARS} characters, {rules.MAX_IDS_LISTED} ids in `stop_token_ids`,
`token_ids_logprob` and `logit_bias`, {rules.MAX_TOP_LOGPROBS} top logprobs, {rules.MAX_GRAMMAR_BYTES} bytes of
grammar, {rules.MAX_MESSAGES} chat messages; a body over the router's `max_body_bytes` gets a 413.
"""


MARK = {Decision.PASSED: "passed", Decision.BOUNDED: "bounded", Decision.ROUTER: "router's own",
        Decision.IGNORED: "ignored (accepted, not sent)", Decision.MAPPED: "mapped", Decision.REFUSED: "**refused**"}


def render(version: str) -> str:
    """One row per decision and reason: the fields that share both are listed together, and a row already shown in an
    earlier table is named after its table instead of repeated, so each limit is said once."""
    out: list[str] = [intro(version)]
    seen: set[tuple[Decision, str]] = set()
    for title, table in TABLES.items():
        out.append(f"\n## `{title}`\n\n| fields | decision | why, and the limits |\n|---|---|---|")
        rows = _rows(table)
        out += [f"| {', '.join(names)} | {MARK[key[0]]} | {key[1]} |" for key, names in rows if key not in seen]
        again: dict[Decision, list[str]] = {}
        for key, names in rows:
            if key in seen:
                again.setdefault(key[0], []).extend(names)
        if again:
            out.append("\nAs decided above: " + "; ".join(
                f"{MARK[decision]} {', '.join(names)}" for decision, names in again.items()) + ".")
        seen.update(key for key, _ in rows)
    return "\n".join(out) + "\n"


def _rows(table: dict) -> list[tuple[tuple[Decision, str], list[str]]]:
    """(decision, why) -> the fields it decides, passed and bounded ones first."""
    rows: dict[tuple[Decision, str], list[str]] = {}
    for name, rule in sorted(table.items()):
        why = rule.reason or "its type only"
        if rule.pair is not None:
            why += f"; {rule.pair.value}"
        shown = f"`{name}`" if rule.default is None else f"`{name}` (default `{json.dumps(rule.default)}`)"
        rows.setdefault((rule.decision, why), []).append(shown)
    return sorted(rows.items(), key=lambda kv: (kv[0][0] is Decision.REFUSED, kv[1][0]))

if __name__ == "__main__":
    from importlib.metadata import version

    print(render(version("sglang")), end="")
