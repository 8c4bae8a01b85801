"""Prompts of the sizes the tests need, built from fixed text (the tokenizer decides the exact counts)."""

SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank. "
    "Every morning the baker opens the shop and the smell of fresh bread fills the street. "
    "A function returns a value, and a class describes the objects it creates. "
    "Servers answer requests, and routers decide which server gets each one. "
)


def prompt_of_about(tokenizer, n_tokens: int) -> str:
    text = ""
    while len(tokenizer(text)["input_ids"]) < n_tokens:
        text += SENTENCES
    words = text.split(" ")
    while len(tokenizer(" ".join(words))["input_ids"]) > n_tokens:
        words.pop()
    return " ".join(words)
