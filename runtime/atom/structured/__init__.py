"""Structured output: grammar-constrained sampling on xgrammar (issue 45).

One job per module:
- spec: the request's constraint (a msgspec Struct carried in SamplingParams.structured);
- grammar: a spec to an xgrammar Grammar (the backend's reason when it cannot);
- vocab: the served tokenizer's vocabulary as xgrammar's TokenizerInfo;
- compiler: compiled grammars cached by the spec's hash;
- matcher: one request's matcher, kept in step with its tokens (and drafts, rolled back);
- bitmask: a step's token bitmask, filled on the host and applied to the logits;
- host: the engine's side: attach a matcher to a sequence, build a step's or a verify's mask.
"""
