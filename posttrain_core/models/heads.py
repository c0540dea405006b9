"""Log-probs of chosen tokens: the LM head runs on the positions a loss reads, a bounded chunk of them at a time.

SFT trains on the assistant tokens (about half of a chat) and RL reads the response tokens only, yet a causal LM's
forward projects every position onto the vocabulary: a B x L x V logits tensor, its log-softmax and their gradients
are the largest activations of a training step (for a 49k vocabulary, 0.6 MB per token in fp32, each). Here the head
runs on the selected positions only, `LOGIT_CHUNK_BYTES` of logits at a time, and with gradients each chunk's logits
are recomputed in the backward pass instead of kept: the pass holds one chunk's logits, whatever its size. The
trainers (SFT, DPO, RL) and `posttrain serve` compute every log-prob they train on here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from posttrain_core.algorithms.losses import entropy_from_logits, token_logprobs

# Architectures whose logits are exactly lm_head(final hidden state). Others (logit soft-capping, logit scaling, ...)
# keep the model's own forward and select from its logits: the same numbers, without the saving.
PLAIN_HEAD_TYPES = frozenset(
    {"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral", "mixtral", "phi3", "olmo", "olmo2"}
)
# fp32 logits of one head chunk: with a 49k vocabulary, 170 positions (the backward adds their softmax and gradient).
LOGIT_CHUNK_BYTES = 32 * 2**20


def plain_head(lm: torch.nn.Module) -> bool:
    """Whether `lm` (a causal LM, or a LoRA peft model around one) computes its logits as lm_head(hidden)."""
    peft = getattr(lm, "peft_config", None)
    if peft and any(str(getattr(c, "peft_type", "")).split(".")[-1] != "LORA" for c in peft.values()):
        return False  # prompt/prefix tuning changes the inputs inside the peft model's own forward
    config = getattr(lm, "config", None)
    return getattr(config, "model_type", None) in PLAIN_HEAD_TYPES and hasattr(lm, "get_decoder")


def chunk_rows(vocab_size: int) -> int:
    """Positions per head chunk: `LOGIT_CHUNK_BYTES` of fp32 logits."""
    return max(1, LOGIT_CHUNK_BYTES // (4 * vocab_size))


class Scores(NamedTuple):
    """What the head gives at each selected position (fp32): the label's log-prob, and on request the entropy, the
    log-probs of given tokens (`gather`), and the `topk` most likely tokens with their log-probs."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logp: torch.Tensor | None = None


def chunked_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden_N_H: torch.Tensor,
    labels_N: torch.Tensor,
    rows: int,
    entropy: bool = False,
    gather_N_K: torch.Tensor | None = None,
    topk: int = 0,
) -> Scores:
    """The `Scores` of `labels_N` under logits = head(hidden), `rows` positions at a time, in fp32.

    logp_N[n] = log softmax(head(hidden_N_H[n]))[labels_N[n]], 0 where labels_N < 0; entropy_N[n] is the entropy of
    that distribution; gathered_N_K[n, j] its log-prob of token gather_N_K[n, j]; topk_ids_N_K / topk_logp_N_K its
    `topk` most likely tokens (no gradient). With gradients, each chunk runs under activation checkpointing: its
    logits are freed after the forward and recomputed in the backward, so neither pass holds more than one chunk's
    [rows x V] logits.
    """
    K = gather_N_K.shape[-1] if gather_N_K is not None else 0

    def piece(h: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()
        columns = [token_logprobs(logits[None], y[None])[0][:, None]]
        if entropy:
            columns.append(entropy_from_logits(logits)[:, None])
        if K or topk:
            logp_V = logits.log_softmax(-1)
            if K:
                columns.append(logp_V.gather(-1, ids))
            if topk:
                best = logp_V.detach().topk(topk, dim=-1)
                columns += [best.values, best.indices.float()]  # ids below 2^24: exact in fp32
        return torch.cat(columns, dim=-1)

    grad = torch.is_grad_enabled() and hidden_N_H.requires_grad
    ids_N_K = gather_N_K if gather_N_K is not None else labels_N.new_zeros(labels_N.shape[0], 0)
    outs = []
    for start in range(0, hidden_N_H.shape[0], rows):
        part = slice(start, start + rows)
        h, y, ids = hidden_N_H[part], labels_N[part], ids_N_K[part]
        outs.append(checkpoint(piece, h, y, ids, use_reentrant=False) if grad else piece(h, y, ids))
    width = 1 + int(entropy) + K + 2 * topk
    out = torch.cat(outs) if outs else hidden_N_H.new_zeros((0, width), dtype=torch.float32)
    at = iter(torch.split(out, [1, int(entropy), K, topk, topk], dim=-1))
    logp, ent, gathered, top_logp, top_ids = (next(at) for _ in range(5))
    return Scores(
        logp=logp[:, 0],
        entropy=ent[:, 0] if entropy else None,
        gathered=gathered if K else None,
        topk_ids=top_ids.long() if topk else None,
        topk_logp=top_logp if topk else None,
    )


class TokenLogprobs(torch.nn.Module):
    """A causal LM whose forward returns the log-probs (and optionally the entropies) of labels at selected positions.

    It is a module (not a function) so that DistributedDataParallel can wrap it: DDP's forward must run for its
    gradient hooks to fire. The wrapped model is `.lm`; its parameters are this module's.
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        from posttrain_core.vision.inputs import banned_ids

        self.lm = lm
        self.plain = plain_head(lm)
        self.rows = chunk_rows(int(lm.get_output_embeddings().weight.shape[0]))
        banned = banned_ids(lm.config)  # a VLM's vision tokens: out of every log-softmax, as the engine leaves them
        self.banned = torch.tensor(banned) if banned else None

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        select: torch.Tensor,
        labels: torch.Tensor,
        prefix: SharedPrefix | None = None,
        entropy: bool = False,
        gather: torch.Tensor | None = None,
        topk: int = 0,
        vision: dict[str, torch.Tensor] | None = None,
    ) -> Scores:
        """The `Scores` at `select`, shaped as `labels` (with a last axis of K for `gather` and `topk`).

        Args:
            input_ids, attention_mask: B x L.
            select: a bool B x L mask (labels and outputs N: the selected positions in row-major order), or long B x R
                positions (labels and outputs B x R: position select[b, r] of row b).
            labels: the token each selected position predicts (< 0: none, log-prob 0).
            prefix: the rows' shared prompts (`SharedPrefix`): each runs once, and input_ids / attention_mask /
                select are the rows' tokens after it. Plain-head models only.
            entropy: also each selected position's entropy (with its graph).
            gather: token ids, labels' shape x K: also their log-probs at each position (with their graph).
            topk: also the `topk` most likely tokens at each position and their log-probs (no graph).
            vision: a VLM's pixels, grids and 3-D positions (`vision.inputs.forward_inputs`).
        """
        from posttrain_core.vision.inputs import backbone, ban

        if vision is not None:
            if prefix is not None:
                raise ValueError("TokenLogprobs: a shared prefix cannot carry images")
            out = backbone(self.lm)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **vision)
            picked, lm_head, banned = _pick(out.last_hidden_state, select), self.lm.get_output_embeddings(), self.banned
            return self._scores(picked, lambda h: ban(lm_head(h), banned), labels, entropy, gather, topk)
        if prefix is not None and not self.plain:
            raise ValueError(f"TokenLogprobs: a shared prefix needs a plain-head model, not {type(self.lm)}")
        if self.plain:
            if prefix is not None:
                hidden = self._after_prefix(input_ids, attention_mask, prefix)
            else:
                out = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
                hidden = out.last_hidden_state
            picked, lm_head = _pick(hidden, select), self.lm.get_output_embeddings()

            def head(h: torch.Tensor) -> torch.Tensor:
                return lm_head(h)

        else:
            logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            picked = _pick(logits, select)

            def head(h: torch.Tensor) -> torch.Tensor:
                return ban(h, self.banned)  # the model's own logits

        return self._scores(picked, head, labels, entropy, gather, topk)

    def _scores(self, picked, head, labels, entropy, gather, topk) -> Scores:
        flat = picked.reshape(-1, picked.shape[-1])
        ids = gather.reshape(flat.shape[0], -1) if gather is not None else None
        scores = chunked_logprobs(head, flat, labels.reshape(-1), self.rows, entropy, ids, topk)
        shape = labels.shape
        return Scores(*(x.reshape(*shape, *x.shape[1:]) if x is not None else None for x in scores))

    def _after_prefix(self, ids_B_T: torch.Tensor, mask_B_T: torch.Tensor, prefix: SharedPrefix) -> torch.Tensor:
        """Final hidden states of the rows' own tokens, attending to their prompt's cached keys and values."""
        from transformers import DynamicCache

        decoder, cache, mask = self.lm.get_decoder(), DynamicCache(), mask_B_T
        if prefix.ids_U_P.shape[1] > 0:
            positions_U_P = (prefix.mask_U_P.cumsum(-1) - 1).clamp(min=0)
            decoder(
                input_ids=prefix.ids_U_P, attention_mask=prefix.mask_U_P, position_ids=positions_U_P, cache=cache,
                use_cache=True,
            )  # fmt: skip
            cache.reorder_cache(prefix.rows_B)  # prompt -> its rows (an index_select: gradients sum back per prompt)
            mask = torch.cat([prefix.mask_U_P[prefix.rows_B], mask_B_T], dim=1)
        out = decoder(
            input_ids=ids_B_T, attention_mask=mask, position_ids=prefix.positions_B_T, cache=cache, use_cache=True
        )
        return out.last_hidden_state


def sequence_logprobs(net: torch.nn.Module, ids_B_T: torch.Tensor, mask_B_T: torch.Tensor, labels_B_T: torch.Tensor):
    """logp_B = sum over t >= 1 with labels[b, t] != -100 of log p(labels[b, t] | tokens < t), fp32: each row's
    scored tokens (DPO's chosen and rejected responses). `net` is a `TokenLogprobs`, possibly inside DDP."""
    keep_B_T = torch.zeros_like(labels_B_T, dtype=torch.bool)  # position t predicts token t + 1
    keep_B_T[:, :-1] = labels_B_T[:, 1:] >= 0
    logp_N = net(ids_B_T, mask_B_T, keep_B_T, labels_B_T[:, 1:][keep_B_T[:, :-1]]).logp
    return logp_N.new_zeros(ids_B_T.shape[0]).index_add(0, keep_B_T.nonzero()[:, 0], logp_N)


@dataclass(frozen=True)
class SharedPrefix:
    """Rows whose sequences start with the same prompts, encoded so that each distinct prompt runs once.

    GRPO-style batches hold n responses to each prompt: the forward (and backward) over a prompt's tokens is the same
    for all n, so it runs once per distinct prompt and the rows attend to its keys and values (a KV cache copied to
    them, which autograd sums back). Same logits as the full rows up to float rounding (~1e-6).

    ids_U_P / mask_U_P: each distinct prompt but its last token, left-padded (P may be 0); rows_B: each row's prompt
    in them; positions_B_T: the sequence positions of the rows' own tokens (the prompt's last token, then the
    response), which are `TokenLogprobs.forward`'s input_ids.
    """

    ids_U_P: torch.Tensor
    mask_U_P: torch.Tensor
    rows_B: torch.Tensor
    positions_B_T: torch.Tensor


def distinct(seqs: list[list[int]], keys: list | None = None) -> tuple[list[tuple[int, ...]], list[int]]:
    """(the distinct sequences in order of first appearance, each sequence's index in them): the n samples of a
    prompt find their one copy, which the hf engine prefills and the trainer runs once. With `keys`, sequences are
    the same only if their keys are too (the same tokens of a VLM prompt can come with other images)."""
    first: dict[tuple, int] = {}
    keyed = [(tuple(s), None if keys is None else keys[i]) for i, s in enumerate(seqs)]
    rows = [first.setdefault(k, len(first)) for k in keyed]
    return [seq for seq, _ in first], rows


def left_padded(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_B_T, mask_B_T) of token lists padded on the left to the longest: every sequence ends at column T, where
    generation (or the rows' own tokens after a `SharedPrefix`) continues. T may be 0."""
    T = max((len(s) for s in seqs), default=0)
    ids_B_T = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask_B_T = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            ids_B_T[b, T - len(s) :] = torch.tensor(s)
            mask_B_T[b, T - len(s) :] = 1
    return ids_B_T, mask_B_T


def _pick(x_B_L_D: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    if select.dtype == torch.bool:
        return x_B_L_D[select]
    return x_B_L_D.gather(1, select[..., None].expand(-1, -1, x_B_L_D.shape[-1]))
