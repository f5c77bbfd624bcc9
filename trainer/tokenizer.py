"""Tokenizers: `bytes` (every UTF-8 byte a token, plus an end of document) or a Hugging Face tokenizer.json.

    tok = load("bytes")                              # no file, no download; vocab 257
    tok = load("tokenizers/bpe-32k.json")            # or s3://bucket/data/tok/tokenizer.json
    ids = tok.encode("def main():")                  # begun as the tokenizer defines (Llama 3: its BOS first)
    text = tok.decode(ids)                           # special tokens left out
    docs = tok.encode_documents(["a", "b"])          # each begun and ended as the tokenizer defines

What both kinds give: `vocab_size`, `encode`, `decode`, `encode_documents` (the tokenizer's batch
encoding, on every core), `eos_id` and `bos_id` (None where the tokenizer has none), `sha256` (of
the tokenizer.json text: what shard indexes and runs are matched on), `tokenizer_json()`.

The byte tokenizer's tokenizer.json is an exact byte-level tokenizer in Hugging Face's format (a BPE
with no merges over the 256 byte symbols, the end of document as a special token), so what an export
writes loads with Hugging Face's loaders and encodes as this module does.

No torch here, and `tokenizers` only where a file is loaded: the Lambda functions import this
module (Validate's checks, the data preparation's tokenisation).
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path

BYTES = "bytes"
"""The spec of the byte tokenizer."""
END_OF_TEXT_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>")
"""Names tokenizers give the token that ends a document (Llama 3, GPT-2, Llama 2 and T5, Gemma),
for tokenizer.json files whose post-processor does not append it itself."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be read or used; the message names it."""


class ByteTokenizer:
    """Every UTF-8 byte a token (0-255), then 256 for the end of a document. Round-trips any text."""

    name = label = BYTES
    vocab_size = 257
    eos_id = 256
    bos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        return [[*text.encode("utf-8"), self.eos_id] for text in texts]

    def tokenizer_json(self) -> str:
        symbols = _byte_symbols()
        document = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": self.eos_id, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}],
            "normalizer": None,
            # No regex split and no prefix space: the text's bytes, in order, are the symbols.
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": False},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {symbols[byte]: byte for byte in range(256)}, "merges": []},
        }
        return json.dumps(document, ensure_ascii=False, indent=1) + "\n"

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.tokenizer_json().encode()).hexdigest()


class FileTokenizer:
    """A Hugging Face tokenizer.json, read with the `tokenizers` library."""

    def __init__(self, name: str, text: str):
        from tokenizers import Tokenizer  # here: the byte tokenizer's users need no `tokenizers`

        self.name, self._text = name, text
        self.label = name.rpartition("/")[2]
        """The file's name without its folder: what a shard index names it by, the same wherever it was read from."""
        try:
            self._tokenizer = Tokenizer.from_str(text)
        except Exception as error:  # the library raises a bare Exception for a malformed file
            raise TokenizerError(f"{name} is not a tokenizer.json Hugging Face's tokenizers can read: {error}") from None
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        leading, trailing = self._template_specials()
        self.bos_id = leading[-1] if leading else None
        # The end of a document: the one the post-processor appends, else a special token named as one.
        self._appends_eos = bool(trailing)
        self.eos_id = trailing[-1] if trailing else self._named_end_of_text()

    def _template_specials(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a text's own (Llama 3: its BOS before)."""
        plain = self._tokenizer.encode("a", add_special_tokens=False).ids
        full = self._tokenizer.encode("a", add_special_tokens=True).ids
        at = next(i for i in range(len(full)) if full[i:i + len(plain)] == plain)
        return full[:at], full[at + len(plain):]

    def _named_end_of_text(self) -> int | None:
        specials = {token.content: id_ for id_, token in self._tokenizer.get_added_tokens_decoder().items()
                    if token.special}
        return next((specials[name] for name in END_OF_TEXT_NAMES if name in specials), None)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch_fast(texts)
        if self._appends_eos or self.eos_id is None:
            return [encoding.ids for encoding in encodings]
        return [[*encoding.ids, self.eos_id] for encoding in encodings]

    def tokenizer_json(self) -> str:
        return self._text


Tokenizer = ByteTokenizer | FileTokenizer


def load(spec: str) -> Tokenizer:
    """`bytes`, a tokenizer.json path, or an s3:// URI of one; TokenizerError names what is wrong."""
    if spec == BYTES:
        return ByteTokenizer()
    return FileTokenizer(spec, read_text(spec))


def sha256_of(spec: str) -> str:
    """The tokenizer's sha256 without parsing it: what Validate matches against a shard index."""
    if spec == BYTES:
        return ByteTokenizer().sha256
    return hashlib.sha256(read_text(spec).encode()).hexdigest()


def read_text(spec: str) -> str:
    """The text of a tokenizer.json at a path or s3:// URI."""
    try:
        data = _read_s3(spec) if spec.startswith("s3://") else Path(spec).read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer {spec} does not exist") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenizerError(f"tokenizer {spec} is not UTF-8 text (a tokenizer.json)") from None


def _read_s3(uri: str) -> bytes:
    import boto3  # here: a local tokenizer needs no AWS client
    from botocore.exceptions import ClientError

    bucket, _, key = uri[len("s3://"):].partition("/")
    try:
        return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        if error.response["Error"]["Code"] in ("NoSuchKey", "NoSuchBucket"):
            raise FileNotFoundError(uri) from None
        raise


def _byte_symbols() -> list[str]:
    """The printable character Hugging Face's ByteLevel stands each byte for: printable Latin-1 bytes
    stand for themselves, the others for 256, 257, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, others = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + others))
            others += 1
    return symbols


def train_bpe(documents: list[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json trained on `documents`, laid out as Llama 3's is (a regex split,
    byte-level symbols, <|begin_of_text|> put before every text, <|end_of_text|> ending documents):
    the tests and the demo make their tokenizers with it, nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    begin, end = "<|begin_of_text|>", "<|end_of_text|>"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[begin, end], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(documents, trainer=trainer)
    bpe.post_processor = processors.TemplateProcessing(single=f"{begin} $A", special_tokens=[(begin, bpe.token_to_id(begin))])
    return bpe.to_str()
