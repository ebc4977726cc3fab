"""Picks a request's next token from the model's logits, as ``serving.sampling.Sampling`` asks (torch;
for an engine that samples itself: ``transformers``).

``TokenPicker(sampling, prompt, end_id, bad_ids, device)``; ``pick(logits) -> int`` for each step,
``logits`` the last position's ``[vocab]``; the picker remembers the answer so far. In order:
``min_tokens`` (the end token is masked until the answer has that many), ``bad_ids`` (token
sequences: a one-token word is masked, a longer one's last token where the answer ends with the
rest), ``repetition_penalty`` over the prompt and the answer, ``presence_penalty`` /
``frequency_penalty`` over the answer, then greedy (argmax) or ``temperature``, ``top_k``,
``top_p`` and a draw from a ``torch.Generator`` seeded with ``seed`` (made once per request: a
seeded request draws the same tokens from the same logits, run to run).
"""
from __future__ import annotations

import secrets
from typing import List, Sequence

from ..serving.sampling import Sampling


class TokenPicker:
    def __init__(self, sampling: Sampling, prompt: Sequence[int], end_id: int, bad_ids: Sequence[Sequence[int]],
                 device) -> None:
        import torch

        self._torch = torch
        self.sampling = sampling
        self.end_id = int(end_id)
        self.bad_ids = [list(b) for b in bad_ids if len(b)]
        self.answer: List[int] = []
        self._prompt = prompt if sampling.repetition_penalty != 1.0 else ()  # read only for that penalty
        self._counts = {}
        self._generator = None
        if not sampling.greedy:
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
            self._generator = torch.Generator(device=device).manual_seed(seed % (1 << 64))

    def pick(self, logits) -> int:
        torch, s = self._torch, self.sampling
        logits = logits.float().clone()
        if len(self.answer) < s.min_tokens:
            logits[self.end_id] = float("-inf")
        for bad in self.bad_ids:
            if len(bad) == 1 or self.answer[-(len(bad) - 1):] == bad[:-1]:
                logits[bad[-1]] = float("-inf")
        if s.repetition_penalty != 1.0:
            ids = torch.tensor(sorted({*map(int, self._prompt), *self.answer}), dtype=torch.long, device=logits.device)
            values = logits[ids]
            logits[ids] = torch.where(values > 0, values / s.repetition_penalty, values * s.repetition_penalty)
        if self._counts and (s.presence_penalty or s.frequency_penalty):
            ids = torch.tensor(list(self._counts), dtype=torch.long, device=logits.device)
            counts = torch.tensor(list(self._counts.values()), dtype=logits.dtype, device=logits.device)
            logits[ids] -= s.presence_penalty + s.frequency_penalty * counts
        if self._generator is None:
            token = int(logits.argmax())
        else:
            token = self._draw(logits)
        self.answer.append(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        return token

    def _draw(self, logits) -> int:
        torch, s = self._torch, self.sampling
        logits = logits / s.temperature
        if 0 < s.top_k < logits.numel():
            kth = torch.topk(logits, s.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if s.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ahead of each
            sorted_probs = sorted_probs.masked_fill(before >= s.top_p, 0.0)  # the first token always stays
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator))
