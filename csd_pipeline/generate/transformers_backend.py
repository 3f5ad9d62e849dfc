"""The transformers backend: batched `model.generate` on CPU or GPU, one seeded generator per sample.

Prompts are left-padded into one batch. transformers' own sampling draws from one global random
stream, so a sample would depend on its batch; here `generate` runs greedy search over scores that a
logits processor has already sampled from: each row draws its token (temperature, top-p) with its own
`torch.Generator` seeded by `backend.sample_seed`, and every other score becomes -inf.
"""

from __future__ import annotations

from csd_pipeline.generate.backend import Generation, SamplingSettings


class TransformersBackend:
    """A `GenerationBackend` over a loaded HF causal LM (`runtime.model_loading.LoadedModel`)."""

    def __init__(self, loaded, settings: SamplingSettings):
        self.loaded = loaded
        self.settings = settings

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList

        settings, model = self.settings, self.loaded.model
        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), settings.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
            attention[row, width - len(prompt):] = 1
        config = GenerationConfig(do_sample=False, max_new_tokens=settings.max_new_tokens,
                                  eos_token_id=list(settings.stop_ids) or None, pad_token_id=settings.pad_id)
        sampler = _seeded_sampler(seeds, settings, device)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                 generation_config=config, logits_processor=LogitsProcessorList([sampler]))
        return [_generation(row.tolist(), settings) for row in out[:, width:].cpu()]


def _generation(ids: list[int], settings: SamplingSettings) -> Generation:
    for position, token in enumerate(ids):
        if token in settings.stop_ids:
            return Generation(ids[:position], "stop")
    return Generation(ids, "length")


def _seeded_sampler(seeds: list[int], settings: SamplingSettings, device):
    import torch
    from transformers import LogitsProcessor

    class SeededSampler(LogitsProcessor):
        """Draws each row's next token with the row's own generator; returns scores that only it survives."""

        def __init__(self):
            self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

        def __call__(self, input_ids, scores):
            scores = scores.float()
            if settings.temperature == 0:
                chosen = scores.argmax(dim=-1)
            else:
                probs = torch.softmax(scores / settings.temperature, dim=-1)
                if settings.top_p < 1:
                    probs = _top_p(probs, settings.top_p)
                chosen = torch.stack([torch.multinomial(probs[row], 1, generator=generator)[0]
                                      for row, generator in enumerate(self.generators)])
            out = torch.full_like(scores, float("-inf"))
            out.scatter_(1, chosen[:, None], 0.0)
            return out

    return SeededSampler()


def _top_p(probs, top_p: float):
    """`probs` restricted to each row's smallest set of most likely tokens whose mass reaches `top_p`."""
    import torch

    ordered, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(ordered, dim=-1) - ordered  # mass of the more likely tokens
    ordered = torch.where(before < top_p, ordered, torch.zeros_like(ordered))
    kept = torch.zeros_like(probs).scatter_(1, order, ordered)
    return kept / kept.sum(dim=-1, keepdim=True)
