"""Where each sequence's output stands in its grammar, and the tokens it may sample next.

The model runner asks, per sampling row, for the mask of allowed tokens. A sequence's output
tokens are the truth: a cursor remembers the grammar state after the first ``num_consumed`` of
them and catches up with any it has not seen. So a sequence whose first token was sampled on a
prefill worker, one resumed on another worker after a failure, one preempted and recomputed,
and a fork of an n > 1 request all find their state by replaying their own output, with no
hook where tokens are appended. Cursors are dropped with the sequence (``forget``).

EOS (and the request's ``stop_token_ids``) may be sampled only where the output so far is a
whole match. ``min_tokens`` bans them until enough tokens exist; where the grammar allows
nothing else (the output is complete), the grammar wins and the ban is lifted, so a row never
has every token masked. A spec with ``after_token_ids`` (a reasoning model's ``</think>``) leaves
the output free until those tokens appear in a row, and constrains what follows them. The
runner masks the logits of constrained rows before its sampler
(``mask_logits``), as vLLM does, so logprobs are those of the masked distribution. On a GPU a
state's mask is copied there once and kept (the most recently used 256), not every step.

Speculative decoding: the scheduler keeps only the leading drafts the grammar allows
(``valid_drafts``), up to one that would end the output; the row of the token after
``drafts[:j]`` is masked by the state those drafts lead to (``mask_logits``'s
``drafts_before``), so a draft stands only where the grammar allows it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace

import torch

from engine.host_to_device import to_device
from engine.sampling.messages import SamplingRow
from engine.sequence import Sequence
from engine.structured.grammar import CompiledGrammar
from engine.structured.spec import StructuredOutputSpec


@dataclass(slots=True)
class _Cursor:
    grammar: CompiledGrammar
    state: int  # the grammar's state after the first num_consumed output tokens
    num_consumed: int
    # the spec's after_token_ids (a reasoning model's end of thought): how many of them end
    # the output so far; the grammar reads the tokens after all of them, none before
    after_token_ids: tuple[int, ...] = ()
    num_after_matched: int = 0
    # the request's stop ids other than eos, on the device: allowed where eos is; None: none
    stop_token_ids: torch.Tensor | None = None

    @property
    def started(self) -> bool:
        return self.num_after_matched == len(self.after_token_ids)

    def consume(self, token_id: int) -> None:
        if self.started:
            self.state = self.grammar.advance(self.state, token_id)
            return
        after, matched = self.after_token_ids, self.num_after_matched
        # the longest start of ``after`` that the output now ends with (it may overlap itself)
        candidate = (*after[:matched], token_id)
        self.num_after_matched = next(
            k for k in range(len(candidate), -1, -1) if candidate[len(candidate) - k :] == after[:k]
        )


@dataclass(frozen=True, slots=True)
class RowConstraint:
    """What one sampling row of a constrained sequence may sample."""

    allowed: torch.Tensor  # bool [vocab_size] on the device: True where it may be sampled
    banned_token_ids: tuple[int, ...]  # the min_tokens ban that still applies


class GrammarCursors:
    def __init__(
        self,
        grammar_for: Callable[[StructuredOutputSpec], CompiledGrammar],
        eos_token_ids: Collection[int],
        device: torch.device,
        max_device_masks: int = 256,
    ) -> None:
        self._grammar_for = grammar_for  # the engine's cache: compiled once per spec
        self._eos_token_ids = frozenset(eos_token_ids)
        self._cursors: dict[int, _Cursor] = {}  # by seq_id
        self.device = device
        # on a GPU, masks already copied there, by (grammar, state): a mask is copied once,
        # not every step its state is sampled from (each is vocab_size bytes)
        # (keyed by the grammar itself, which a key keeps alive: an id could be reused)
        self._device_masks: OrderedDict[tuple[CompiledGrammar, int], torch.Tensor] = OrderedDict()
        self._max_device_masks = max_device_masks

    def mask_logits(
        self,
        logits: torch.Tensor,  # [rows, vocab] on the device; masked in place
        rows: SequenceOf[SamplingRow],
        seqs: SequenceOf[Sequence],
        drafts_before: SequenceOf[tuple[int, ...]] | None = None,
    ) -> None:
        """Set -inf, in place, wherever a row's grammar forbids a token, and set each
        constrained row's min_tokens ban to what the grammar leaves of it. ``drafts_before``:
        per row, the drafts its sequence's output is taken to end with (speculative decoding;
        as ``valid_drafts`` kept them)."""
        positions = [i for i, seq in enumerate(seqs) if seq.params.structured_outputs is not None]
        if not positions:  # (the common batch: one cheap pass)
            return
        constrained: list[int] = []
        masks: list[torch.Tensor] = []
        for position in positions:
            row = rows[position]
            drafts = () if drafts_before is None else drafts_before[position]
            constraint = self.constraint(seqs[position], tuple(row.banned_token_ids), drafts)
            if constraint is None:  # reasoning: not constrained yet
                continue
            constrained.append(position)
            masks.append(constraint.allowed)
            row.banned_token_ids = constraint.banned_token_ids
        if not constrained:
            return
        forbidden = ~torch.stack(masks)  # [constrained rows, vocab]
        if len(constrained) == logits.shape[0]:
            logits.masked_fill_(forbidden, float("-inf"))
            return
        index = to_device(constrained, torch.long, logits.device)
        logits[index] = logits.index_select(0, index).masked_fill_(forbidden, float("-inf"))

    def constraint(
        self, seq: Sequence, banned_token_ids: tuple[int, ...], drafts: tuple[int, ...] = ()
    ) -> RowConstraint | None:
        """The row's mask for ``seq`` (None: unconstrained), its output replayed first, then
        ``drafts`` (allowed ones: see ``valid_drafts``)."""
        spec = seq.params.structured_outputs
        if spec is None:
            return None
        cursor = self._cursor(seq, spec)
        if drafts:
            cursor = replace(cursor)  # the sequence's own stays where its output is
            for token_id in drafts:
                cursor.consume(token_id)
        if not cursor.started:
            return None  # still reasoning: free until its end
        grammar, state = cursor.grammar, cursor.state
        allowed = self._on_device(grammar, state)
        if cursor.stop_token_ids is not None and grammar.is_accepting(state):
            allowed = allowed.clone()
            allowed[cursor.stop_token_ids] = True
        if banned_token_ids and grammar.is_finished(state):
            banned_token_ids = ()  # nothing but the end may follow: the grammar wins
        return RowConstraint(allowed, banned_token_ids)

    def valid_drafts(self, seq: Sequence, drafts: tuple[int, ...]) -> tuple[int, ...]:
        """The leading ``drafts`` that ``seq``'s grammar allows, each after those before it,
        through the first that would end the output (eos, or a stop id where the output is
        complete): a draft the grammar forbids could not stand, and the rows after it would
        have no state. All of them for a sequence without structured outputs."""
        spec = seq.params.structured_outputs
        if spec is None or not drafts:
            return drafts
        cursor = replace(self._cursor(seq, spec))
        stop_ids = self._eos_token_ids | set(seq.params.stop_token_ids)
        for index, token_id in enumerate(drafts):
            if cursor.started:
                grammar, state = cursor.grammar, cursor.state
                allowed = bool(grammar.allowed_tokens(state)[token_id]) or (
                    token_id in stop_ids and grammar.is_accepting(state)
                )
                if not allowed:
                    return drafts[:index]
            if token_id in stop_ids:  # the output would end there (still reasoning or not)
                return drafts[: index + 1]
            cursor.consume(token_id)
        return drafts

    def forget(self, seq_id: int) -> None:
        self._cursors.pop(seq_id, None)

    def _on_device(self, grammar: CompiledGrammar, state: int) -> torch.Tensor:
        mask = grammar.allowed_tokens(state)  # [vocab] bool on CPU, cached by the grammar
        if self.device.type == "cpu":
            return mask
        key = (grammar, state)
        on_device = self._device_masks.get(key)
        if on_device is None:
            on_device = self._device_masks[key] = mask.to(self.device, non_blocking=True)
            if len(self._device_masks) > self._max_device_masks:
                self._device_masks.popitem(last=False)
        else:
            self._device_masks.move_to_end(key)
        return on_device

    def _cursor(self, seq: Sequence, spec: StructuredOutputSpec) -> _Cursor:
        cursor = self._cursors.get(seq.seq_id)
        if cursor is None:
            grammar = self._grammar_for(spec)
            cursor = _Cursor(grammar, grammar.initial_state(), 0, spec.after_token_ids)
            stop_ids = [t for t in seq.params.stop_token_ids if t not in self._eos_token_ids]
            if stop_ids:
                cursor.stop_token_ids = torch.tensor(stop_ids, dtype=torch.long, device=self.device)
            self._cursors[seq.seq_id] = cursor
        first_new = seq.num_prompt_tokens + cursor.num_consumed
        for token_id in seq.token_ids[first_new:]:  # (not output_token_ids: a copy of all)
            cursor.consume(token_id)
        cursor.num_consumed = seq.num_output_tokens
        return cursor
