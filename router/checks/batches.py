"""Batches in a request body: a batch is at most MAX_BATCH items, each a request of its own on both workers, so each
item is decided (a non-empty list of token ids, a non-empty text), and a list given per item (sampling_params, rid)
has one for each. router/checks/validation.py uses these for every route; each is a 400 naming the item."""

from __future__ import annotations

from pdcluster.common.http import ApiError
from router.checks.inventory.rules import MAX_BATCH


def one_per_item(values: list, field: str, batch_size: int | None) -> None:
    """A list given per item (sampling_params, rid): one for each input (one, for a single prompt)."""
    if len(values) != (batch_size or 1):
        raise ApiError(400, f"{field} has {len(values)} items for {batch_size or 1} inputs", field)


def id_prompts(value: list, field: str) -> tuple[int | None, tuple[list, ...]]:
    """(batch size, prompts) of a list of ids or a list of lists of ids; shape errors are 400s naming the item.

    Each item of a batch is a request of its own on both workers, and an empty one is a 0-token prefill that crashes
    SGLang 0.5.23's scheduler (and then the decode waiting for its KV): every item is decided, not only the list."""
    if isinstance(value[0], list):
        within_batch_limit(value, field)
        for i, ids in enumerate(value):
            if not isinstance(ids, list) or not ids:
                raise ApiError(400, f"{field}[{i}] must be a non-empty list of token ids (a batch is all lists)",
                               f"{field}[{i}]")
        return len(value), tuple(value)
    return None, (value,)


def within_batch_limit(value: list, field: str) -> None:
    if len(value) > MAX_BATCH:
        raise ApiError(400, f"{field} has {len(value)} items; a batch is at most {MAX_BATCH}", field)


def text_batch(value: list, field: str) -> None:
    """A batch of texts (completions' `prompt` as a list with a string in it): every item a non-empty string."""
    within_batch_limit(value, field)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise ApiError(400, f"{field}[{i}] is not a string: a batch of prompts is all texts or all token-id "
                                f"lists", f"{field}[{i}]")
        if not item:
            raise ApiError(400, f"{field}[{i}] is empty: every prompt must have at least one token", f"{field}[{i}]")
