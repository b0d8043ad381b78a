"""Speculative decoding: draft tokens proposed without a second model, verified by the target
model in one forward, kept only where the target's own distribution would have produced them.

``config``: what the user asks for (vLLM's ``speculative_config``). ``proposer``: what the
scheduler asks of a proposer; ``ngram``: the prompt-lookup proposer it asks for drafts (pure
Python). ``rejection``: the model runner's check
of a step's drafts against the target's logits (greedy: equal to the argmax; sampled: the
rejection rule, which keeps the output distribution exactly the target's).
"""
