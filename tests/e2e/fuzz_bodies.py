"""Hostile request bodies for the trust-boundary fuzzer (tests/e2e/test_fuzz.py), generated from the inventory.

Every field name comes from router/checks/inventory/ (which names every field of SGLang's own request types) or is one
no table knows. Every value is drawn from one pool of boundary values (integer extremes, tiny and huge floats, empty and
huge containers, unicode, lists where one value is expected and the other way round, nesting), so a field meets values
of every type. For fields the router accepts, the values its type and static limits accept are drawn more often, and
half of the bodies hold only accepted fields with accepted values (nested ones too), so that many reach the workers:
what the router passes is what a worker must survive.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from router.checks.inventory import CHAT, COMPLETION, GENERATE, MESSAGE, SAMPLING, Decision, PairLimit, Rule


def atoms(vocab: int, context: int) -> list[Any]:
    ints = [-2**63, -2**31, -5, -2, -1, 0, 1, 2, 3, 4, 8, 19, 20, 21, 255, 256, 257, vocab - 1, vocab, vocab + 1,
            context - 1, context, context + 1, 2**30, 2**31 - 1, 2**31, 2**63 - 1]
    floats = [-1e308, -100.0, -2.0, -1.0, -0.0, 0.0, 5e-324, 1e-300, 1e-7, 1e-6, 0.1, 0.5, 0.999999, 1.0, 1.0000001,
              2.0, 2.1, 99.0, 100.0, 101.0, 1e308]
    strings = ["", "a", "\u0000", "é\u200b🦀\U0010ffff", "x" * 300, "((((", "a+", "(a+)+$", "[0-9]{2,}", "{",
               '{"type": "object"}', '{"type": "string", "pattern": "^(a|a)*$"}', 'root ::= "a" | "b"', "root ::= root",
               "[^\\s\\S]", "null", "5"]
    return [None, True, False, *ints, *floats, *strings]


def compounds(vocab: int, pool: list[Any]) -> st.SearchStrategy:
    ids = st.sampled_from([0, 1, 2, vocab - 1, vocab, vocab + 1, -1, 2**31, 2**63 - 1])
    return st.one_of(
        st.lists(st.sampled_from(pool), max_size=3),
        st.lists(ids, min_size=1, max_size=4),
        st.lists(st.lists(ids, max_size=3), max_size=3),
        st.dictionaries(st.sampled_from(["0", "5", str(vocab - 1), str(vocab), "-1", "abc", "1e3", ""]),
                        st.sampled_from([-1e308, -100.0, -5, 0, 1.5, 100, 101, 1e308, "x", None]), max_size=3),
        st.just([{}]), st.just({"nested": {"deeper": [[[]]]}}), st.just([None] * 300),
    )


def accepted_values(rule: Rule, candidates: list[Any]) -> list[Any]:
    """The candidates the rule's type and static limits accept."""
    adapter = TypeAdapter(rule.type)
    accepted = []
    for value in candidates:
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError:
            continue
        accepted.append(value)
    return accepted


class BodyMaker:
    """Strategies of whole bodies for one cluster's model (its vocabulary and context length)."""

    def __init__(self, vocab: int, context: int, model: str):
        self.vocab, self.context, self.model = vocab, context, model
        self.pool = atoms(vocab, context)
        self.any_value = st.one_of(st.sampled_from(self.pool), compounds(vocab, self.pool))

    def value(self, table: dict[str, Rule], name: str, valid: bool) -> st.SearchStrategy:
        """Values of one field: with `valid`, only what its type and static limits accept (nested dicts too)."""
        rule = table.get(name)
        hostile = st.nothing() if valid else self.any_value
        if name == "sampling_params" and table is GENERATE:
            few = st.just({"max_new_tokens": 4})
            return st.one_of(self.fields(SAMPLING, valid, few), st.lists(self.fields(SAMPLING, valid, few), max_size=3)
                             if not valid else st.nothing(), hostile)
        if name == "messages":
            return st.one_of(st.lists(self.fields(MESSAGE, valid, base=self.message()), min_size=int(valid),
                                      max_size=3), hostile)
        if name == "response_format":
            return st.one_of(st.sampled_from(self.response_formats()), hostile)
        if rule is None or rule.decision is Decision.REFUSED:
            return self.any_value
        accepted = accepted_values(rule, self.pool)
        if rule.pair is PairLimit.TOKENS:  # the worst accepted count asks for a whole context of tokens (~20 s)
            accepted = [v for v in accepted if v is None or v <= 64]  # test_trust_boundary.py sends that one
        if not accepted:
            return self.any_value
        return st.one_of(st.sampled_from(accepted), hostile)

    def fields(self, table: dict[str, Rule], valid: bool, base: st.SearchStrategy | None = None
               ) -> st.SearchStrategy:
        """A dict: `base` (or nothing) with 0-4 fields set to drawn values: with `valid`, fields the router accepts
        with values it accepts; else any field of `table` or one no table knows, with any value."""
        accepted = [name for name, rule in table.items() if rule.decision is not Decision.REFUSED]
        names = st.sampled_from(accepted) if valid else st.one_of(
            st.sampled_from(accepted), st.sampled_from([*table, "unknown_field", "__proto__", "", "RID"]))
        return st.tuples(base if base is not None else st.just({}),
                         st.lists(names, max_size=4, unique=True).flatmap(
                             lambda chosen: st.tuples(*(self.value(table, n, valid) for n in chosen)).map(
                                 lambda values, chosen=chosen: dict(zip(chosen, values, strict=True))))).map(
            lambda both: {**both[0], **both[1]})

    def message(self) -> st.SearchStrategy:
        return st.sampled_from([{"role": "user", "content": "fuzz"}, {"role": "system", "content": "be brief"},
                                {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}])

    def response_formats(self) -> list[Any]:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        return [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema}}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "nonsense"}}}, {"type": "regex"}]

    def prompt_base(self, route: str) -> st.SearchStrategy:
        """A valid request to start from: most bodies reach the workers, small answers keep the run short."""
        few = {"max_new_tokens": 4}
        if route == "/generate":
            return st.sampled_from([
                {"text": "fuzz", "sampling_params": few}, {"input_ids": [5, 6, 7], "sampling_params": few},
                {"text": ["fuzz a", "fuzz b"], "sampling_params": few},
                {"input_ids": [[5], [6, 7]], "sampling_params": [few, few]},
            ])
        if route == "/v1/completions":
            return st.sampled_from([{"model": self.model, "prompt": p, "max_tokens": 4}
                                    for p in ("fuzz", [5, 6], ["a", "b"], [[5], [6, 7]])])
        return st.just({"model": self.model, "messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 4})

    def body(self, route: str) -> st.SearchStrategy:
        table = {"/generate": GENERATE, "/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}[route]
        made = st.one_of(self.fields(table, True, self.prompt_base(route)),
                         self.fields(table, False, self.prompt_base(route)))
        return st.tuples(made, st.booleans()).map(lambda m: {**m[0], "stream": m[0].get("stream", m[1])})
