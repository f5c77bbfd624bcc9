"""trainer/tokenizer.py: the byte tokenizer, a tokenizer.json read with Hugging Face `tokenizers`, both
behind one interface, and the byte tokenizer's tokenizer.json equal to it in Hugging Face's loaders."""

import json
import random
import subprocess
import sys

import boto3
import pytest
from tokenizers import Tokenizer

from trainer import tokenizer
from trainer.data import corpus_documents
from trainer.tokenizer import ByteTokenizer, FileTokenizer, TokenizerError

TEXTS = ["déjà vu — 日本語\n", "", " a leading space\tand\r\nline ends", "emoji 🙂 and a zero\x00byte",
         "".join(chr(random.Random(0).randrange(1, 0x3000)) for _ in range(3000))]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    path.write_text(tokenizer.train_bpe(corpus_documents(500_000), vocab_size=600))
    return path


def test_bytes_round_trip_any_text_and_end_documents_with_256():
    tok = tokenizer.load("bytes")
    for text in TEXTS:
        assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text) + [256]) == text
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (257, 256, None)
    assert tok.encode_documents(["ab", ""]) == [[97, 98, 256], [256]]


def test_the_byte_tokenizers_json_is_the_same_tokenizer_in_hugging_faces_library():
    tok = ByteTokenizer()
    library = Tokenizer.from_str(tok.tokenizer_json())
    for text in TEXTS:
        assert library.encode(text).ids == tok.encode(text)
        assert library.decode(library.encode(text).ids) == text
    assert library.get_vocab_size() == tok.vocab_size and library.token_to_id("<|endoftext|>") == tok.eos_id
    read_back = FileTokenizer("exported/tokenizer.json", tok.tokenizer_json())
    assert (read_back.vocab_size, read_back.eos_id, read_back.bos_id, read_back.sha256) == (257, 256, None, tok.sha256)
    assert read_back.encode_documents(TEXTS) == tok.encode_documents(TEXTS)


def test_hugging_faces_auto_tokenizer_loads_the_byte_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    (tmp_path / "tokenizer.json").write_text(ByteTokenizer().tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                  "eos_token": "<|endoftext|>"}))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(TEXTS[0])["input_ids"] == list(TEXTS[0].encode()) and loaded.eos_token_id == 256


def test_the_byte_tokenizers_sha256_is_of_its_json_and_stable():
    assert ByteTokenizer().sha256 == tokenizer.load("bytes").sha256
    # Shard indexes name it: it must not change with the process (ordering, formatting) it is computed in.
    again = subprocess.run([sys.executable, "-c", "from trainer import tokenizer; print(tokenizer.load('bytes').sha256)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert again == ByteTokenizer().sha256


def test_a_bpe_tokenizer_file_begins_and_ends_documents_as_it_defines(bpe):
    tok = tokenizer.load(str(bpe))
    assert tok.vocab_size == 600 and tok.bos_id == 0 and tok.eos_id == 1  # <|begin_of_text|>, <|end_of_text|>
    library = Tokenizer.from_file(str(bpe))
    text = "def main():\n    return 42\n"
    assert tok.encode(text) == library.encode(text).ids and tok.encode(text)[0] == 0
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_documents([text, "x"]) == [library.encode(text).ids + [1], library.encode("x").ids + [1]]
    assert len(tok.encode(text)) < len(text) * 0.6  # merges learnt from the corpus
    assert tok.sha256 == __import__("hashlib").sha256(bpe.read_bytes()).hexdigest()
    assert tok.tokenizer_json() == bpe.read_text()


def test_a_template_that_appends_the_end_is_not_ended_twice(tmp_path):
    from tokenizers import processors

    library = Tokenizer.from_str(tokenizer.train_bpe(corpus_documents(100_000), vocab_size=400))
    library.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok = FileTokenizer("t.json", library.to_str())
    assert (tok.bos_id, tok.eos_id) == (None, 1)
    assert tok.encode_documents(["ab"]) == [library.encode("ab").ids]


def test_training_a_tokenizer_here_is_deterministic():
    documents = corpus_documents(100_000)
    assert tokenizer.train_bpe(documents, 400) == tokenizer.train_bpe(documents, 400)


def test_a_tokenizer_from_s3(moto_endpoint, bpe):
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket="tok-bucket")
    s3.put_object(Bucket="tok-bucket", Key="data/tok/tokenizer.json", Body=bpe.read_bytes())
    assert tokenizer.load("s3://tok-bucket/data/tok/tokenizer.json").sha256 == tokenizer.load(str(bpe)).sha256
    with pytest.raises(TokenizerError, match=r"^tokenizer s3://tok-bucket/data/tok/missing.json does not exist$"):
        tokenizer.load("s3://tok-bucket/data/tok/missing.json")


@pytest.mark.parametrize("content, problem", [
    (None, "does not exist"),
    (b"\xff\xfe", "is not UTF-8 text"),
    (b'{"model": 3}', "is not a tokenizer.json Hugging Face's tokenizers can read"),
])
def test_a_bad_tokenizer_file_is_named(tmp_path, content, problem):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TokenizerError, match=f"^tokenizer {path} {problem}" if content is None or b"\xff" in content
                       else f"^{path} {problem}"):
        tokenizer.load(str(path))
