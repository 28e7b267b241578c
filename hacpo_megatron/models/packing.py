"""Sequences (prompt ids, response ids) -> the right-padded rows of a pass's micro-batches.

    sequences  ->  packed_micro_batches  ->  groups of sequences: to a token budget (token_budget_groups), the
                                             responses to one prompt together (prompt_grouped), or by length
                                             (micro_batch_indices)
               ->  pack_sequences        ->  PackedBatch: rows of documents (a prompt, its responses), what each
                                             token sees, where each response token's logits are

Rows are right-padded. Under the causal mask a real token attends only to earlier positions,
which are all real, so padding never enters a real token's context. Rows of shared prompts or of several
sequences packed end to end say per token who sees whom (PackedBatch.token_layout); the agent's attention
kernel (models/attention.py, `train.attention`) computes exactly that. models/logprobs.py runs the model over
the rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hacpo_megatron.models.attention import Document, TokenLayout

PromptResponse = Tuple[Sequence[int], Sequence[int]]  # (prompt token ids, response token ids)


@dataclass
class PackedBatch:
    """Sequences laid out in right-padded rows of documents: a document is a prompt followed by one response or,
    with shared prompts, by every response to it (the prompt once); a row holds one document or, packed to a
    token budget, several end to end.

    A document [prompt, response 1, response 2, ...] computes the prompt once for all its responses. Each
    response sees the prompt and its own earlier tokens and nothing else, no token sees another document
    (`token_layout`, which models/attention.py turns into each kernel's mask), and every token keeps the position
    it has in its plain sequence (prompt 0..P-1, every response P..P+L-1: `position_ids`, which RoPE reads through
    `rotary_at_positions`, models/logprobs.py). So every response token gets the log-prob it gets in a row of its
    own, up to the order of floating-point sums.
    """

    tokens: torch.Tensor  # [rows, S] long, padded with `pad_id`
    token_layout: TokenLayout  # per token: document, segment, position (on the CPU; .to(device) for a forward)
    logit_rows: torch.Tensor  # [T] the row and ...
    logit_positions: torch.Tensor  # [T] ... the position whose logits predict each response token
    targets: torch.Tensor  # [T] the response tokens: sequence by sequence, token by token
    response_lengths: torch.Tensor  # [n]
    indices: torch.Tensor  # [n] positions in the caller's list of the sequences, in `targets`' order
    # MoE routing replay (models/moe_replay.py): the routes its tokens are to take, [rows, S, layers, k] (-1: live),
    # and those its pass took (set by the pass, when recording)
    routes: Optional[torch.Tensor] = None
    recorded_routes: Optional[torch.Tensor] = None
    # a micro-batch that only keeps an expert-parallel rank in step with its peers (`filler_micro_batch`)
    filler: bool = False

    @property
    def num_sequences(self) -> int:
        return len(self.indices)

    @property
    def position_ids(self) -> torch.Tensor:
        """[rows, S] each token's position in its plain sequence."""
        return self.token_layout.position

    @property
    def documents(self) -> List[Document]:
        return self.token_layout.documents

    @property
    def layout(self) -> List[Tuple[int, List[int]]]:
        """Per document: (prompt length, response lengths), what its FLOPs depend on."""
        return [(d.prompt_length, list(d.response_lengths)) for d in self.documents]

    def attention_mask(self) -> Optional[torch.Tensor]:
        """[rows, 1, S, S] bool, True: may not attend (None: every row one plain sequence, the causal mask).
        A dense reference for tests; no kernel builds it."""
        return None if self.token_layout.plain else ~self.token_layout.visible()

    def response_logprobs(self, token_logprobs: torch.Tensor, max_response_length: int) -> torch.Tensor:
        """[T] log-probs of the response tokens -> [n, max_response_length] (0 at padding)."""
        n = self.num_sequences
        valid = torch.arange(max_response_length, device=token_logprobs.device).expand(n, -1) \
            < self.response_lengths.to(token_logprobs.device).unsqueeze(1)
        out = token_logprobs.new_zeros(n, max_response_length)
        return out.masked_scatter(valid, token_logprobs)


# A shared-prompt document grows to at most this many tokens (or one sequence's length, if longer) where no token
# budget bounds it; then the prompt starts another document. Keeps a micro-batch's widest row near its others.
MAX_SHARED_ROW_TOKENS = 2048


def pack_sequences(sequences: Sequence[PromptResponse], indices: Sequence[int], pad_id: int = 0, *,
                   share_prompts: bool = False, row_tokens: Optional[int] = None) -> PackedBatch:
    """Right-pad `sequences[i] for i in indices` into rows of documents.

    Documents: one per sequence, or with `share_prompts` one per distinct prompt (in order of first appearance;
    another while one would pass `row_tokens` or MAX_SHARED_ROW_TOKENS) holding every response to it. Rows: one
    per document, or with `row_tokens` (a token budget) documents end to end, a new row when the next one would
    pass the budget (a document longer than the budget has a row of its own): no padding but the last row's.
    """
    limit = row_tokens or MAX_SHARED_ROW_TOKENS
    groups: List[Tuple[List[int], List[int]]] = []  # (prompt, the sequences of its document)
    widths: List[int] = []  # tokens in each document
    open_group: Dict[Tuple[int, ...], int] = {}  # prompt -> its document that takes more responses
    for i in indices:
        prompt, response = sequences[i]
        if not prompt:
            raise ValueError("every sequence needs at least one prompt token (the first response token's context)")
        g = open_group.get(tuple(prompt)) if share_prompts else None
        if g is not None and widths[g] + len(response) <= limit:
            groups[g][1].append(i)
            widths[g] += len(response)
        else:
            open_group[tuple(prompt)] = len(groups)
            groups.append((list(prompt), [i]))
            widths.append(len(prompt) + len(response))

    places: List[Tuple[int, int]] = []  # (row, start) of each document
    fill: List[int] = []  # tokens in each row
    for width in widths:
        if row_tokens is not None and fill and fill[-1] + width <= row_tokens:
            places.append((len(fill) - 1, fill[-1]))
            fill[-1] += width
        else:
            places.append((len(fill), 0))
            fill.append(width)

    tokens = torch.full((len(fill), max(fill)), pad_id, dtype=torch.long)
    logit_rows, logit_positions, targets, order, documents = [], [], [], [], []
    for (prompt, members), (row, start) in zip(groups, places):
        P = len(prompt)
        tokens[row, start:start + P] = torch.tensor(prompt)
        offset = start + P
        for i in members:
            response = list(sequences[i][1])
            L = len(response)
            tokens[row, offset:offset + L] = torch.tensor(response, dtype=torch.long)
            # token 0 is predicted by the prompt's last position, token j > 0 by the response's token j - 1
            logit_positions += [start + P - 1] + list(range(offset, offset + L - 1))
            logit_rows += [row] * L
            targets += response
            order.append(i)
            offset += L
        documents.append(Document(row, start, P, tuple(len(sequences[i][1]) for i in members)))
    return PackedBatch(
        tokens=tokens, token_layout=TokenLayout.of_documents(documents, *tokens.shape),
        logit_rows=torch.tensor(logit_rows, dtype=torch.long),
        logit_positions=torch.tensor(logit_positions, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        response_lengths=torch.tensor([len(sequences[i][1]) for i in order], dtype=torch.long),
        indices=torch.tensor(order, dtype=torch.long),
    )


def filler_micro_batch() -> PackedBatch:
    """A micro-batch whose results nobody reads, run only to keep an expert-parallel rank in step with its peers
    (`in_step_with_expert_peers`, models/logprobs.py): one row of two tokens (prompt [0], response [0]). Its loss is 0
    times its log-prob (its backward runs, adding zeros), its tokens are padding to the routers (no load figure or
    load-balancing loss counts them), and the passes drop its results (`run_schedule`)."""
    batch = pack_sequences([([0], [0])], [0])
    batch.filler = True
    return batch


def token_budget_groups(sequences: Sequence[PromptResponse], budget: int, *, share_prompts: bool) -> List[List[int]]:
    """Micro-batches of sequence indices whose tokens, packed end to end (`pack_sequences(row_tokens=budget)`),
    fill at most `budget` tokens: verl's dynamic batch size (`ppo_max_token_len_per_gpu`). With `share_prompts`
    the sequences of one prompt are next to each other and their prompt counts once per micro-batch. A sequence
    longer than the budget is a micro-batch of its own."""
    if budget < 1:
        raise ValueError(f"the token budget must be >= 1, got {budget}")
    order = prompt_grouped(sequences, None)[0] if share_prompts else list(range(len(sequences)))
    groups: List[List[int]] = []
    used, prompts = 0, set()
    for i in order:
        prompt, response = sequences[i]
        key = tuple(prompt)
        cost = len(response) + (0 if share_prompts and key in prompts else len(prompt))
        if groups and used + cost <= budget:
            groups[-1].append(i)
            used += cost
        else:
            groups.append([i])
            used, prompts = len(prompt) + len(response), set()
        prompts.add(key)
    return groups


def packed_micro_batches(sequences: Sequence[PromptResponse], *, max_sequences: Optional[int],
                         max_tokens: Optional[int], share_prompts: bool, pad_id: int = 0) -> List[PackedBatch]:
    """`sequences` as the micro-batches of one pass: packed to a token budget (`max_tokens`), or
    <= max_sequences sequences each (in prompt order with `share_prompts`, by length without)."""
    if max_tokens is not None:
        groups = token_budget_groups(sequences, max_tokens, share_prompts=share_prompts)
    elif share_prompts:
        groups = prompt_grouped(sequences, max_sequences)
    else:
        groups = micro_batch_indices([len(p) + len(r) for p, r in sequences], max_sequences=max_sequences)
    return [pack_sequences(sequences, group, pad_id, share_prompts=share_prompts, row_tokens=max_tokens)
            for group in groups]


def prompt_grouped(sequences: Sequence[PromptResponse], max_sequences: Optional[int]) -> List[List[int]]:
    """Micro-batches of <= max_sequences indices with the sequences of one prompt next to each other, so that
    shared-prompt rows hold as many responses as a micro-batch allows."""
    first_seen: Dict[Tuple[int, ...], int] = {}
    order = sorted(range(len(sequences)), key=lambda i: first_seen.setdefault(tuple(sequences[i][0]), i))
    size = max_sequences or len(order)
    return [order[k:k + size] for k in range(0, len(order), size)]


def micro_batch_indices(
    lengths: Sequence[int], *, max_sequences: Optional[int] = None, max_tokens: Optional[int] = None
) -> List[List[int]]:
    """Group sequence indices into micro-batches of <= max_sequences rows and <= max_tokens padded tokens.

    Longest first, so sequences of similar length share a micro-batch (less padding). A sequence
    longer than `max_tokens` gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: List[List[int]] = []
    for i in order:
        if groups:
            current = groups[-1]
            rows = len(current) + 1
            padded = rows * lengths[current[0]]  # current[0] is the longest of the group
            if (max_sequences is None or rows <= max_sequences) and (max_tokens is None or padded <= max_tokens):
                current.append(i)
                continue
        groups.append([i])
    return groups
