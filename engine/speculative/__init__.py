"""Speculative decoding: draft tokens proposed by prompt lookup or by a smaller draft model,
verified by the target model in one forward, kept only where the target's own distribution
would have produced them.

``config``: what the user asks for (vLLM's ``speculative_config``). ``proposer``: what the
scheduler asks of a proposer; ``ngram``: the prompt-lookup proposer (pure Python);
``draft_model``: the draft model's proposer, which runs that model on its own cache in the
target's blocks after each step. ``rejection``: the model runner's check of a step's drafts
against the target's logits (greedy: equal to the argmax; sampled: the rejection rule, which
keeps the output distribution exactly the target's).
"""
