"""How the KV index (router/kv_routing/kv_index.py) and the routed prompts (router/kv_routing/kv_routed.py) key a
prompt's leading tokens, and a prompt's token ids read only as far as a walk over those keys needs them.

A key says a page's position and every token before it. Pages are grouped in chunks of CHUNK tokens (a whole number
of pages): a chunk's key chains the previous chunk's key with its tokens (`key(base, tokens)`), and a page inside a
chunk is keyed the same way by the chunk before it and its tokens since. So a walk makes one hash a chunk, not one
a page (at page size 1, 16x fewer: ~0.25 µs a token in Python when every page was chained), and still finds the
exact page where a worker's part ends, within the first chunk it misses, in at most a chunk's pages more.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

ROOT = 0  # the key a first chunk chains from
CHUNK = 16  # tokens per chunk, at least


def chunk_tokens(page_size: int) -> int:
    """CHUNK rounded up to a whole number of pages."""
    return -(-CHUNK // page_size) * page_size


@dataclass(slots=True)
class Held:
    """A worker's part of a prompt: its leading tokens in memory, then the tokens after them on its store."""

    memory: int = 0
    stored: int = 0

    @property
    def tokens(self) -> int:
        return self.memory + self.stored


Walk = tuple[dict[int, int], dict[int, int], Held]  # a worker's keys in memory, its store's, what it holds so far


def key(base: int, tokens: Sequence[int]) -> int:
    # CPython hashes tuples of ints the same in every process (no PYTHONHASHSEED), and in C: ~0.1 us a small page.
    return hash((base, tuple(tokens)))


class LazyIds:
    """A prompt's token ids: given, or read piece by piece from `rest` (router/kv_routing/token_pieces.py's
    `pieces_ids`: each piece's ids and its characters) only as far as a walk asks, so a prompt no worker holds costs one
    piece's encode. No match covers its last `spare` tokens (SGLang computes at least the last one) nor a cut text's
    last `cut` (a longer text may merge them differently; not its ids either). `chars`: the prompt's, for `tokens`'
    estimate."""

    __slots__ = ("_keys", "chars", "chars_read", "cut", "ids", "reserve", "rest")

    def __init__(self, ids: Sequence[int], rest: Iterator[tuple[list[int], int]] | None = None, spare: int = 0,
                 cut: int = 0, chars: int = 0) -> None:
        self.ids = list(ids)
        self.rest, self.cut, self.reserve, self.chars, self.chars_read = rest, cut, spare + cut, chars, 0
        self._keys: dict[int, list[int]] = {}  # chunk size -> the keys of the chunks made so far

    @property
    def done(self) -> bool:
        return self.rest is None

    def usable(self, n: int) -> bool:
        """Whether the prompt's first `n` tokens may be matched (reading as far as that needs)."""
        need = n + self.reserve
        while len(self.ids) < need and self.rest is not None:
            more = next(self.rest, None)
            if more is None:
                self.rest = None
            else:
                self.ids += more[0]
                self.chars_read += more[1]
        return need <= len(self.ids)

    def chunk_key(self, chunk: int, i: int) -> int | None:
        """The key of chunk `i` (of `chunk` tokens), if all its tokens may be matched."""
        keys = self._keys.setdefault(chunk, [])
        while len(keys) <= i and self._more_keys(chunk, keys):
            pass
        return keys[i] if i < len(keys) else None

    def chunk_keys_on(self, chunk: int) -> Iterator[int]:
        """The chunks' keys in order, made (and the prompt read) as the caller goes on."""
        keys, i = self._keys.setdefault(chunk, []), 0
        while i < len(keys) or self._more_keys(chunk, keys):
            yield keys[i]
            i += 1

    def _more_keys(self, chunk: int, keys: list[int]) -> bool:
        """Adds the keys of the next chunk and of all after it whose ids are read already; False at the end."""
        start = len(keys) * chunk
        if not self.usable(start + chunk):
            return False
        last, end = keys[-1] if keys else ROOT, len(self.ids) - self.reserve
        add = keys.append
        # In one loop, zip making the chunks' tuples in C: ~0.15 us a chunk (a call each would cost more than that).
        for tokens in zip(*[iter(self.ids[start:end - (end - start) % chunk])] * chunk, strict=False):
            add(last := hash((last, tokens)))
        return True

    def page_key(self, chunk: int, i: int, tokens: int) -> int | None:
        """The key of the first `tokens` tokens of chunk `i`, if they may be matched."""
        if tokens == chunk:
            return self.chunk_key(chunk, i)
        start = i * chunk
        if not self.usable(start + tokens) or (i and self.chunk_key(chunk, i - 1) is None):
            return None
        return key(self._keys[chunk][i - 1] if i else ROOT, self.ids[start:start + tokens])

    def chunk_keys(self, chunk: int) -> list[int]:
        """The keys of the chunks made so far (read no further)."""
        return list(self._keys.get(chunk, ()))

    def all_chunk_keys(self, chunk: int) -> list[int]:
        """The keys of every whole chunk that may be matched: reads the prompt to its end."""
        keys = self._keys.setdefault(chunk, [])
        while self._more_keys(chunk, keys):
            pass
        return list(keys)

    def read_all(self) -> list[int]:
        """Every id (less a cut text's last few)."""
        self.usable(1 << 62)
        return self.ids[:len(self.ids) - self.cut]

    def tokens(self) -> int:
        """The prompt's tokens: counted if read to its end, else those read and the rest at their rate a character
        (an estimate; a text cut at MAX_CHARS too)."""
        read = len(self.ids) - (self.cut if self.done else 0)
        if self.done and self.chars_read >= self.chars:
            return read
        return read + round((self.chars - self.chars_read) * len(self.ids) / max(1, self.chars_read))


def walk(ids: LazyIds, size: int, walks: list[Walk]) -> None:
    """What each worker holds of the prompt, by its keys (router/kv_routing/kv_index.py's `held`), with pages of `size`:
    chunk by chunk while one holds the next, page by page in a chunk whose end a worker's memory does not hold."""
    chunk, i = chunk_tokens(size), 0
    keys = ids.chunk_keys_on(chunk)
    for whole in keys:
        if len(walks) == 1 and not walks[0][2].stored and whole in walks[0][0]:
            # One worker left, in its memory (a long held prefix, as a rule): on in a tighter loop, ~15% less time.
            memory = walks[0][0]
            i += 1
            for later in keys:  # the same keys on
                if later not in memory:
                    break
                i += 1
            walks[0][2].memory = i * chunk
            if not _pages(ids, chunk, i, size, walks[0]):
                return
            i += 1
            continue
        going = []
        for one in walks:
            # Memory is a radix tree (SGLang evicts leaves): holding a chunk's end, it holds all of the chunk.
            if not one[2].stored and whole in one[0]:
                one[2].memory = (i + 1) * chunk
                going.append(one)
            elif _pages(ids, chunk, i, size, one):
                going.append(one)
        walks, i = going, i + 1
        if not walks:
            return
    for one in walks:  # the prompt's last pages, short of a chunk
        _pages(ids, chunk, i, size, one)


def _pages(ids: LazyIds, chunk: int, i: int, size: int, walk: Walk) -> bool:
    """Page by page through chunk `i`: whether the worker holds all of it."""
    memory, stored, held = walk
    for tokens in range(size, chunk + 1, size):
        page = ids.page_key(chunk, i, tokens)
        if page is None:
            return False
        if not held.stored and page in memory:  # SGLang matches its memory first, then asks its store
            held.memory = i * chunk + tokens
        elif page in stored:
            held.stored = i * chunk + tokens - held.memory
        else:
            return False
    return True
