"""Text from a trained model: either family continues a prompt, a token at a time, with a KV cache.

    model = load_exported(Path("my-model"))                         # trainer/export.py
    tok = tokenizer.load("my-model/tokenizer.json")
    print(generate(model, tok, "def main(", new_tokens=200, temperature=0.8, top_k=40, seed=0))
    print(generate(model, tok, "def main(", new_tokens=200, greedy=True))

The prompt is encoded as the tokenizer encodes a text (Llama 3's tokenizer puts its begin token
first). The model sees the prompt once, then each new token alone: every layer keeps the keys and
values of the positions before (trainer/model.py KVCache). The context is at most `seq_len`
positions (gpt's position table and llama's rotary table have no rows past it): when it is full,
the cache is rebuilt from the last half of the tokens. Sampling draws from the softmax of the
logits over `temperature`, restricted to the `top_k` likeliest tokens; greedy (or temperature 0)
takes the likeliest, always, as transformers' greedy search does. It stops at the tokenizer's end
of text or after `new_tokens`.
"""

from __future__ import annotations

import torch

from trainer.model import Decoder, KVCache
from trainer.tokenizer import Tokenizer

__all__ = ["generate", "generate_ids"]


@torch.no_grad()
def generate(model: Decoder, tokenizer: Tokenizer, prompt: str, *, new_tokens: int = 200, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0, greedy: bool = False) -> str:
    """The prompt's continuation (without the prompt)."""
    if not prompt:
        raise ValueError("the prompt is empty: the model continues a text")
    produced = generate_ids(model, tokenizer.encode(prompt), new_tokens=new_tokens, vocab_size=tokenizer.vocab_size,
                            eos_id=tokenizer.eos_id, temperature=0.0 if greedy else temperature, top_k=top_k, seed=seed)
    return tokenizer.decode(produced)


@torch.no_grad()
def generate_ids(model: Decoder, prompt: list[int], *, new_tokens: int, vocab_size: int, eos_id: int | None,
                 temperature: float = 0.0, top_k: int = 40, seed: int = 0) -> list[int]:
    """The ids that follow `prompt`'s, up to `new_tokens` of them, the end of text excluded."""
    device = next(model.parameters()).device
    context = model.cfg.seq_len
    tokens = list(prompt[-(context - 1):])
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache()  # holds tokens[:cache.length]
    produced: list[int] = []
    for _ in range(new_tokens):
        if cache.length == context:  # full: begin again from the last half
            cache, tokens = KVCache(), tokens[-(context // 2):]
        logits = model(torch.tensor([tokens[cache.length:]], device=device), cache=cache)[0, -1].float()
        logits[vocab_size:] = -torch.inf  # rows past the tokenizer's (a vocabulary padded for tp)
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            kept = torch.topk(logits, min(top_k, vocab_size))
            probabilities = torch.softmax(kept.values / temperature, dim=-1)
            token = int(kept.indices[torch.multinomial(probabilities, 1, generator=generator)])
        if token == eos_id:
            break
        produced.append(token)
        tokens.append(token)
    return produced
