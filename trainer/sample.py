"""Text from a trained model: the trainer's GPT continues a prompt, a token at a time.

    model = load_exported(Path("my-model"))
    print(generate(model, "def main(", new_tokens=200, temperature=0.8, top_k=40, seed=0))

Byte tokens (trainer/tokenizer.py), as the model was trained on. The context is the last
`seq_len` tokens (the position embedding has no rows past it); sampling draws from the softmax
of the logits over `temperature`, restricted to the `top_k` likeliest tokens (temperature 0:
the likeliest, always). It stops at the end-of-document token or after `new_tokens`.
"""

from __future__ import annotations

import torch

from trainer.tokenizer import ByteTokenizer
from trainer.model import GPT

__all__ = ["generate"]


@torch.no_grad()
def generate(model: GPT, prompt: str, *, new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40,
             seed: int = 0) -> str:
    """The prompt's continuation (without the prompt)."""
    if not prompt:
        raise ValueError("the prompt is empty: the model continues a text")
    tokenizer = ByteTokenizer()
    device = next(model.parameters()).device
    seq_len = model.pos_emb.num_embeddings
    tokens = torch.tensor([tokenizer.encode(prompt)], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    produced: list[int] = []
    for _ in range(new_tokens):
        logits = model(tokens[:, -seq_len:])[0, -1].float()
        logits[tokenizer.vocab_size:] = -torch.inf  # rows past the tokenizer's (a vocabulary padded for tp)
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            kept = torch.topk(logits, min(top_k, tokenizer.vocab_size))
            probabilities = torch.softmax(kept.values / temperature, dim=-1)
            token = int(kept.indices[torch.multinomial(probabilities, 1, generator=generator)])
        if token == tokenizer.eos_id:
            break
        produced.append(token)
        tokens = torch.cat([tokens, torch.tensor([[token]], device=device)], dim=1)
    return tokenizer.decode(produced)
