"""Turns a SchedulerOutput into one model forward and one sampling call.

Per step: the block moves (swap-outs to the host tier, swap-ins from it, then copy-on-write
copies; engine/kv_cache/host_copies.py orders the swaps on the device) -> flatten the scheduled
tokens (prompt chunks first, then single-token decodes) -> attention metadata -> forward under
the forward context -> logits of the last token of every sequence that samples -> sampler ->
logits of the prompt positions of sequences that owe prompt logprobs, only theirs
(engine/prompt_logprobs.py). A decode step (no prompt chunk; drafts allowed) replays a captured
CUDA graph of the forward instead, when the runner has them and it fits
(engine/decode_graphs.py). A sequence with draft tokens (speculative decoding) runs its token
and drafts like a prompt chunk, gives logits at each of them, and has its drafts checked
(engine/speculative/rejection.py) instead of sampling once.

Under tensor parallelism this runner is rank 0's: before each model call it broadcasts the
command its followers need to make the same call (engine/parallel/step_commands.py): the
block swaps and copies, then the forward's inputs, at ``launch``; one logits command per
``logits_at``. Only rank 0 samples. Every step runs eagerly then (no CUDA graphs: a replay
would skip the broadcast).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.decode_graphs import DecodeGraphs
from engine.forward_context import ForwardContext, set_forward_context
from engine.host_to_device import to_device
from engine.kernels.linear import has_packed_linears, padded_rows
from engine.kv_cache.host_copies import HostCopier
from engine.models.expert_tokens import ExpertTokenCounts
from engine.models.registry import CausalLM
from engine.parallel.group import TensorParallelGroup
from engine.parallel.step_commands import (
    CopyBlocksCommand,
    ForwardCommand,
    ForwardInputs,
    LogitsCommand,
    StopCommand,
    SwapBlocksCommand,
    send_command,
)
from engine.prompt_logprobs import compute_prompt_logprobs, prompt_logprobs_spans
from engine.sampling import PromptTokenLogprobs, Sampler, SamplingRow, make_generator
from engine.sampling.rng import advance_generator
from engine.scheduler.outputs import (
    AcceptedDrafts,
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
)
from engine.scheduler.stop import banned_token_ids
from engine.sequence import Sequence
from engine.speculative.proposer import Drafter
from engine.speculative.rejection import NO_DRAFT, check_drafts
from engine.step_inputs import decode_tokens
from engine.structured.cursors import GrammarCursors


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    """A step whose forward is launched."""

    prefills: list[ScheduledSequence]  # entries of more than one token (drafts included)
    ordered: list[ScheduledSequence]  # the prefills, then the decodes: the order of the rows
    hidden: torch.Tensor  # [num_tokens, hidden]; a graph's output lasts until its next replay
    started: float  # perf_counter at the forward's launch


@dataclass(frozen=True, slots=True)
class SampledStep:
    """A step's tokens drawn on the device; ``result`` brings them to the host."""

    logits: torch.Tensor | None  # [rows, vocab] raw logits of the sample rows; None: no rows
    rows: list[SamplingRow]
    targets: list[Sequence]  # the sequence receiving each row's token
    token_ids: torch.Tensor | None  # [rows]
    forward_seconds: float
    prompt_logprobs: dict[int, PromptTokenLogprobs]

    def result(self) -> ModelRunnerOutput:
        """Waits for the tokens."""
        if self.logits is None or self.token_ids is None:
            return ModelRunnerOutput({}, {}, self.forward_seconds, self.prompt_logprobs)
        with torch.inference_mode():
            sampled = Sampler.outputs(self.logits, self.rows, self.token_ids)
        targets = self.targets
        token_ids = {seq.seq_id: tok for seq, tok in zip(targets, sampled.sampled_token_ids)}
        logprobs = {seq.seq_id: lp for seq, lp in zip(targets, sampled.logprobs) if lp is not None}
        return ModelRunnerOutput(token_ids, logprobs, self.forward_seconds, self.prompt_logprobs)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,  # [num_slots, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]
        attn_backend: AttentionBackend,
        eos_token_ids: frozenset[int],
        device: torch.device,
        decode_graphs: DecodeGraphs | None = None,
        max_prompt_logits_rows: int = 256,
        grammar_cursors: GrammarCursors | None = None,
        group: TensorParallelGroup | None = None,
        expert_tokens: ExpertTokenCounts | None = None,
        # [num_host_slots, num_slots, kv_planes, block_size, num_kv_heads, head_dim]: the host
        # tier's blocks (None: no host tier)
        host_kv_cache: torch.Tensor | None = None,
        # speculative decoding's draft model or prediction layer (None: neither)
        drafter: Drafter | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        self.attn_backend = attn_backend
        # copies blocks between the cache and the host tier, and counts their bytes
        self.host_copier = None if host_kv_cache is None else HostCopier(kv_cache, host_kv_cache)
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.decode_graphs = decode_graphs  # None: every step runs eagerly
        # a mixture-of-experts model's tokens per expert, counted by its forwards (None: dense)
        self.expert_tokens = expert_tokens
        # packed (oneDNN) linears build a kernel per row count: a step's rows are padded to a
        # few buckets (``engine.kernels.linear.padded_rows``)
        self.pads_rows = has_packed_linears(model)
        # prompt positions turned into logits at once, for prompt logprobs: bounds their memory
        self.max_prompt_logits_rows = max_prompt_logits_rows
        self.sampler = Sampler()
        self._generators: dict[int, torch.Generator] = {}  # seq_id -> its seeded generator
        # structured outputs: each constrained sequence's grammar state (None: none allowed)
        self.grammar_cursors = grammar_cursors
        self.drafter = drafter
        # the step ``execute`` ran last, for the drafter (which reads its hidden states)
        self._executed: tuple[SchedulerOutput, LaunchedStep] | None = None
        # the tokens the last ``sample`` drew, on the device, and the sequence of each row
        self._drawn: tuple[torch.Tensor, list[Sequence]] | None = None
        # rank 0 of a tensor-parallel worker: the group its followers hear each model call on
        # (None: this runner is the worker's one rank)
        self._followers = group if group is not None and group.size > 1 else None
        if self._followers is not None and decode_graphs is not None:
            raise ValueError("decode graphs cannot run under tensor parallelism: steps are eager")

    def stop_followers(self) -> None:
        """Tell the followers the worker is closing (nothing without followers)."""
        if self._followers is not None:
            send_command(self._followers, StopCommand())

    def generator_state(self, seq_id: int) -> bytes | None:
        """The RNG state of a seeded sequence, to continue its stream on another worker."""
        generator = self._generators.get(seq_id)
        return None if generator is None else bytes(generator.get_state().numpy())

    def restore_generator(self, seq_id: int, seed: int, state: bytes) -> None:
        generator = make_generator(seed, self.device)
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        self._generators[seq_id] = generator

    def replay_generator(self, seq_id: int, seed: int, num_draws: int, vocab_size: int) -> None:
        """Seed a resumed sequence's generator as if it had sampled ``num_draws`` tokens."""
        generator = make_generator(seed, self.device)
        advance_generator(generator, num_draws, vocab_size)
        self._generators[seq_id] = generator

    def forget(self, seq_id: int) -> None:
        """Drop per-sequence state of a finished sequence."""
        self._generators.pop(seq_id, None)
        if self.grammar_cursors is not None:
            self.grammar_cursors.forget(seq_id)
        if self.drafter is not None:
            self.drafter.forget(seq_id)

    def draft_after(self, output: SchedulerOutput) -> None:
        """With a draft model or a prediction layer: its drafts for the next step of the
        sequences that received a token in ``output`` (the step ``execute`` ran last), once the
        scheduler has applied it (engine/speculative/draft_model.py, mtp.py)."""
        executed, self._executed = self._executed, None
        if self.drafter is None:
            return
        if executed is None or executed[0] is not output:
            raise RuntimeError("draft_after follows the execute of the same step")
        with self._on_device():
            self.drafter.draft_after(output, executed[1])

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run a step and wait for its results."""
        launched = self.launch(output)
        if self.drafter is not None:
            self._executed = output, launched
        result = self.sample(launched).result()
        if any(e.draft_token_ids for e in launched.prefills):
            with self._on_device():
                result = self._check_drafts(launched.hidden, launched.prefills, result)
        return result

    def launch(self, output: SchedulerOutput) -> LaunchedStep:
        """Start a step's forward (on a GPU it runs on while the host goes on). An entry that
        awaits its token takes it from the tokens the last ``sample`` drew, on the device."""
        with self._on_device():
            self._move_blocks(output)
            prefills = [e for e in output.scheduled if e.num_query_tokens > 1]
            decodes = [e for e in output.scheduled if e.num_query_tokens == 1]
            ordered = prefills + decodes
            forward = self._prepare_forward(prefills, decodes, ordered)
            started = time.perf_counter()
            hidden = forward()  # [num_tokens, hidden]
            return LaunchedStep(prefills, ordered, hidden, started)

    def move_blocks(self, output: SchedulerOutput) -> None:
        """Make a step's block moves without running it (a step that computes nothing may still
        owe some: ``SchedulerOutput.moves_blocks``)."""
        with self._on_device():
            self._move_blocks(output)

    def _move_blocks(self, output: SchedulerOutput) -> None:
        """Swap-outs, then swap-ins, then copy-on-write copies, queued before anything launched
        after them (the forward reads what they write)."""
        if output.swap_outs or output.swap_ins:
            self._swap(output.swap_outs, output.swap_ins)
        if output.block_copies:
            if self._followers is not None:
                send_command(self._followers, CopyBlocksCommand(tuple(output.block_copies)))
            copy_blocks(self.kv_cache, output.block_copies)

    def swap_blocks(
        self,
        swap_outs: tuple[tuple[int, int], ...],
        swap_ins: tuple[tuple[int, int], ...],
        *,
        wait: bool,
    ) -> None:
        """Make block moves with the host tier outside a step; ``wait``: return once they are
        done (on a GPU, with everything queued before them)."""
        with self._on_device():
            self._swap(swap_outs, swap_ins)
            if wait and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

    def _swap(
        self, swap_outs: tuple[tuple[int, int], ...], swap_ins: tuple[tuple[int, int], ...]
    ) -> None:
        """Swap-outs, then swap-ins, on every rank."""
        if self.host_copier is None:
            raise RuntimeError("the step swaps blocks with a host tier this runner lacks")
        if self._followers is not None:
            send_command(self._followers, SwapBlocksCommand(swap_outs, swap_ins))
        self.host_copier.swap(swap_outs, swap_ins)

    def sample(self, step: LaunchedStep) -> SampledStep:
        """Draw the step's tokens on the device, from the sequences' state now (async
        scheduling calls it once the step before is applied: penalties, min_tokens and
        grammars see that step's tokens). Call before the next ``launch``: a graph's hidden
        states last until the next replay."""
        with self._on_device():
            sample_rows, targets = self._sample_rows(step.ordered)
            spans = prompt_logprobs_spans(step.ordered)  # empty unless a sequence owes them
            prompt_logprobs = {}
            if spans:
                prompt_logprobs = compute_prompt_logprobs(
                    self.logits_at, step.hidden, spans, self.max_prompt_logits_rows
                )
            if not sample_rows:
                self._drawn = None
                seconds = time.perf_counter() - step.started
                return SampledStep(None, [], [], None, seconds, prompt_logprobs)
            logits = self.logits_at(step.hidden, np.asarray(sample_rows, dtype=np.int64))
            forward_seconds = time.perf_counter() - step.started
            rows = [self._sampling_row(seq) for seq in targets]
            if self.grammar_cursors is not None:  # structured outputs: masked before sampling,
                self.grammar_cursors.mask_logits(logits, rows, targets)  # as vLLM does
            token_ids = self.sampler.draw(logits, rows)  # [rows]
            self._drawn = token_ids, targets
            return SampledStep(logits, rows, targets, token_ids, forward_seconds, prompt_logprobs)

    def logits_at(self, hidden: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """[len(rows), vocab] fp32 logits of ``rows`` (int64) of the step's ``hidden`` states;
        every logits computation of a step comes through here (followers make the same call)."""
        if self._followers is not None:
            send_command(self._followers, LogitsCommand(rows))
        return self.model.compute_logits(hidden.index_select(0, self._to_device(rows)))

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        # Triton launches on the thread's current CUDA device, not the tensors': an engine on
        # cuda:1 launched every kernel on cuda:0 ("cannot access pointer")
        with torch.inference_mode():
            if self.device.type != "cuda":
                yield
                return
            with torch.cuda.device(self.device):
                yield

    def _check_drafts(
        self, hidden: torch.Tensor, prefills: list[ScheduledSequence], result: ModelRunnerOutput
    ) -> ModelRunnerOutput:
        """Logits at each position of the entries with drafts (their token, then each draft),
        the drafts checked against them; adds each entry's drafts that stood and the token
        after them to ``result``."""
        hidden_rows: list[int] = []
        rows: list[SamplingRow] = []
        draft_ids: list[int] = []
        speculating: list[ScheduledSequence] = []
        first_row = 0  # prefills lead the step's tokens
        for entry in prefills:
            if entry.draft_token_ids:
                speculating.append(entry)
                drafts = entry.draft_token_ids
                hidden_rows.extend(range(first_row, first_row + entry.num_query_tokens))
                rows.extend(self._draft_rows(entry.seq, drafts))
                draft_ids.extend((*drafts, NO_DRAFT))
            first_row += entry.num_query_tokens
        logits = self.logits_at(hidden, np.asarray(hidden_rows, dtype=np.int64))  # [rows, vocab]
        constrained = any(e.seq.params.structured_outputs is not None for e in speculating)
        if constrained and self.grammar_cursors is not None:  # each row by its own state
            seqs = [e.seq for e in speculating for _ in range(e.num_query_tokens)]
            drafts_before = [
                e.draft_token_ids[:j] for e in speculating for j in range(e.num_query_tokens)
            ]
            self.grammar_cursors.mask_logits(logits, rows, seqs, drafts_before)
        checked = check_drafts(logits, rows, draft_ids)
        tokens, logprobs = dict(result.sampled_token_ids), dict(result.logprobs)
        accepted_drafts: dict[int, AcceptedDrafts] = {}
        row = 0
        for entry in speculating:
            seq_id, num_drafts = entry.seq.seq_id, len(entry.draft_token_ids)
            num_accepted = 0  # the drafts stand up to the first that fell
            while num_accepted < num_drafts and checked.accepted[row + num_accepted]:
                num_accepted += 1
            kept = slice(row, row + num_accepted)
            accepted_drafts[seq_id] = AcceptedDrafts(
                checked.token_ids[kept], checked.logprobs[kept], num_drafts
            )
            last = row + num_accepted  # the row whose token follows the drafts that stood
            tokens[seq_id] = checked.token_ids[last]
            last_logprobs = checked.logprobs[last]
            if last_logprobs is not None:
                logprobs[seq_id] = last_logprobs
            row += num_drafts + 1
        return replace(
            result, sampled_token_ids=tokens, logprobs=logprobs, accepted_drafts=accepted_drafts
        )

    def _prepare_forward(
        self,
        prefills: list[ScheduledSequence],
        decodes: list[ScheduledSequence],
        ordered: list[ScheduledSequence],  # prefills + decodes: the rows' order
    ) -> Callable[[], torch.Tensor]:
        """Put the step's inputs on the device; the call returned runs the forward and gives
        the hidden states of its tokens, [num_tokens, hidden_size]."""
        awaited = self._awaited_tokens(ordered)
        if self.decode_graphs is not None:  # decode steps, drafts included; None if it won't fit
            replay = self.decode_graphs.prepare(ordered, awaited)
            if replay is not None:
                return replay
        host_ids, inputs = self._host_inputs(prefills, decodes)
        padding = padded_rows(len(host_ids)) - len(host_ids) if self.pads_rows else 0
        if padding:
            host_ids.extend([0] * padding)
            inputs = replace(inputs, num_padding_rows=padding)
        input_ids = to_device(host_ids, torch.long, self.device)  # [num_rows]
        positions, metadata = inputs.on_device(self.device)
        if awaited is not None:
            input_ids.index_copy_(0, *awaited)
        if self._followers is not None:  # the ids as the forward reads them, awaited ones in
            send_command(self._followers, ForwardCommand(inputs), input_ids)
        context = ForwardContext.for_groups(
            metadata, self.kv_cache, self.attn_backend, self.expert_tokens
        )

        def forward() -> torch.Tensor:
            with set_forward_context(context):
                return self.model.forward(input_ids, positions)

        return forward

    def _awaited_tokens(
        self, ordered: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows of entries that await their token, and those tokens as the last ``sample``
        drew them, both on the device; None when no entry awaits one."""
        if not any(entry.awaits_sampled_token for entry in ordered):
            return None
        drawn_tokens, drawn_seqs = self._drawn or (None, [])
        drawn_row = {seq.seq_id: row for row, seq in enumerate(drawn_seqs)}
        rows: list[int] = []
        sources: list[int] = []
        row = 0
        for entry in ordered:
            if entry.awaits_sampled_token:
                if entry.seq.seq_id not in drawn_row:
                    raise RuntimeError(
                        f"sequence {entry.seq.seq_id} awaits a token the last step did not draw"
                    )
                rows.append(row)
                sources.append(drawn_row[entry.seq.seq_id])
            row += entry.num_query_tokens
        assert drawn_tokens is not None
        tokens = drawn_tokens.index_select(0, self._to_device(np.asarray(sources)))
        return self._to_device(np.asarray(rows, dtype=np.int64)), tokens

    def _host_inputs(
        self, prefills: list[ScheduledSequence], decodes: list[ScheduledSequence]
    ) -> tuple[list[int], ForwardInputs]:
        """The step's input ids and the rest of its batch, on the host."""
        bs = self.block_size
        num_groups = len((prefills or decodes)[0].seq.block_tables)  # KV cache groups
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_start_loc = [0]
        for entry in prefills:
            start, end = entry.start_position, entry.start_position + entry.num_query_tokens
            input_ids.extend(entry.query_token_ids())
            pos = np.arange(start, end, dtype=np.int64)
            tables = entry.seq.block_tables
            positions.append(pos)
            slots.append(np.stack([t.array[pos // bs] * bs + pos % bs for t in tables]))
            query_start_loc.append(query_start_loc[-1] + entry.num_query_tokens)
        decode = decode_tokens(decodes, bs, num_groups)
        input_ids.extend(decode.input_ids.tolist())
        positions.append(decode.positions)
        slots.append(decode.slot_mapping)
        decode_lens = decode.positions + 1
        inputs = ForwardInputs(
            positions=np.concatenate(positions),
            slot_mapping=np.concatenate(slots, axis=1),
            num_prefill_seqs=len(prefills),
            num_prefill_tokens=query_start_loc[-1],
            num_decode_seqs=len(decodes),
            prefill_query_start_loc=query_start_loc,
            prefill_seq_lens=[e.start_position + e.num_query_tokens for e in prefills],
            prefill_block_tables=_block_tables([e.seq for e in prefills], num_groups),
            decode_seq_lens=decode_lens,
            decode_block_tables=_block_tables([e.seq for e in decodes], num_groups),
            max_decode_seq_len=int(decode_lens.max()) if len(decodes) else 0,
        )
        return input_ids, inputs

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, None, self.device)

    def _sample_rows(self, ordered: list[ScheduledSequence]) -> tuple[list[int], list[Sequence]]:
        """Hidden-state row to take logits from, and the sequence receiving each sample (an
        entry with drafts samples in ``_check_drafts`` instead)."""
        rows: list[int] = []
        targets: list[Sequence] = []
        last_row = -1
        for entry in ordered:
            last_row += entry.num_query_tokens
            if entry.draft_token_ids:
                continue
            for target in entry.sample_seqs:
                if not target.is_finished:  # (async scheduling: ended while the step ran)
                    rows.append(last_row)
                    targets.append(target)
        return rows, targets

    def _draft_rows(self, seq: Sequence, drafts: tuple[int, ...]) -> list[SamplingRow]:
        """The rows of ``seq``'s token and each of its drafts: row j samples the token after
        ``drafts[:j]``, as if they were already its output (its history and min_tokens)."""
        first = self._sampling_row(seq)
        rows = [first]
        for j in range(1, len(drafts) + 1):
            output_token_ids = first.output_token_ids
            if seq.params.uses_token_history:
                output_token_ids = [*output_token_ids, *drafts[:j]]
            banned = banned_token_ids(seq, self.eos_token_ids, num_drafts_before=j)
            rows.append(replace(first, output_token_ids=output_token_ids, banned_token_ids=banned))
        return rows

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        generator = None
        if seq.seed is not None:
            generator = self._generators.get(seq.seq_id)
            if generator is None:
                generator = make_generator(seq.seed, self.device)
                self._generators[seq.seq_id] = generator
        history = seq.params.uses_token_history  # copying the token lists costs O(context)
        return SamplingRow(
            params=seq.params,
            prompt_token_ids=seq.prompt_token_ids if history else (),
            output_token_ids=seq.output_token_ids if history else (),
            generator=generator,
            banned_token_ids=banned_token_ids(seq, self.eos_token_ids),
        )


def copy_blocks(kv_cache: torch.Tensor, copies: SequenceOf[tuple[int, int]]) -> None:
    """Copy-on-write: each (src, dst) block's K/V, every layer, into dst."""
    device = kv_cache.device
    src = to_device(np.asarray([s for s, _ in copies], dtype=np.int64), None, device)
    dst = to_device(np.asarray([d for _, d in copies], dtype=np.int64), None, device)
    kv_cache[:, :, dst] = kv_cache[:, :, src]


def _block_tables(seqs: SequenceOf[Sequence], num_groups: int) -> np.ndarray:
    """[num_groups, len(seqs), max_blocks] int64 block tables, a row per sequence in each KV
    cache group, padded with 0."""
    width = max((len(s.block_tables[0]) for s in seqs), default=0)
    tables = np.zeros((num_groups, len(seqs), width), dtype=np.int64)
    for row, seq in enumerate(seqs):
        for group, table in enumerate(seq.block_tables):
            tables[group, row, : len(table)] = table.array
    return tables
