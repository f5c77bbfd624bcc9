"""Byte-level tokenizer: every byte is a token, plus one end-of-document token.

Needs no vocabulary file and no download, and round-trips any text exactly.
"""

END_OF_DOCUMENT = 256
VOCAB_SIZE = 257


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
