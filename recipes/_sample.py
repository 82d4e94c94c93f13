"""A short greedy continuation of a fixed prompt: what fine-tuning did to the model's text."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_sample(model, tokenizer, prompt: str, new_tokens: int) -> str:
    """The continuation of ``prompt`` (collective: every rank of the TSP model's group passes the
    same prompt and gets the same tokens, decoded from a sharded KV cache)."""
    training = model.training
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(model.device)
    out = model.generate(
        ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    model.train(training)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
