"""Logits at chosen positions only: the LM head runs on the tokens a loss reads, not on every position.

SFT trains on the assistant tokens (about half of a chat) and RL reads the response tokens only, yet a causal LM's
forward projects every position onto the vocabulary: a B x L x V logits tensor, its log-softmax and their gradients
are the largest activations of a training step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Architectures whose logits are exactly lm_head(final hidden state). Others (logit soft-capping, logit scaling, ...)
# keep the model's own forward and select from its logits: the same numbers, without the saving.
PLAIN_HEAD_TYPES = frozenset(
    {"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral", "mixtral", "phi3", "olmo", "olmo2"}
)


def plain_head(lm: torch.nn.Module) -> bool:
    """Whether `lm` (a causal LM, or a LoRA peft model around one) computes its logits as lm_head(hidden)."""
    peft = getattr(lm, "peft_config", None)
    if peft and any(str(getattr(c, "peft_type", "")).split(".")[-1] != "LORA" for c in peft.values()):
        return False  # prompt/prefix tuning changes the inputs inside the peft model's own forward
    config = getattr(lm, "config", None)
    return getattr(config, "model_type", None) in PLAIN_HEAD_TYPES and hasattr(lm, "get_decoder")


class SelectedLogits(torch.nn.Module):
    """A causal LM whose forward returns the logits at selected positions only.

    It is a module (not a function) so that DistributedDataParallel can wrap it: DDP's forward must run for its
    gradient hooks to fire. The wrapped model is `.lm`; its parameters are this module's.
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        self.plain = plain_head(lm)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        select: torch.Tensor,
        prefix: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """Logits at `select`.

        Args:
            input_ids, attention_mask: B x L.
            select: a bool B x L mask (returns N x V, the selected positions in row-major order), or long B x R
                positions (returns B x R x V, position select[b, r] of row b).
            prefix: the rows' shared prompts (`SharedPrefix`): each runs once, and input_ids / attention_mask /
                select are the rows' tokens after it. Plain-head models only.
        """
        if prefix is not None:
            if not self.plain:
                raise ValueError(f"SelectedLogits: a shared prefix needs a plain-head model, not {type(self.lm)}")
            return self.lm.get_output_embeddings()(_pick(self._after_prefix(input_ids, attention_mask, prefix), select))
        if self.plain:
            hidden = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return self.lm.get_output_embeddings()(_pick(hidden.last_hidden_state, select))
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return _pick(logits, select)

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


@dataclass(frozen=True)
class SharedPrefix:
    """Rows whose sequences start with the same prompts, encoded so that each distinct prompt runs once.

    GRPO-style batches hold n responses to each prompt: the forward (and backward) over a prompt's tokens is the same
    for all n, so it runs once per distinct prompt and the rows attend to its keys and values (a KV cache copied to
    them, which autograd sums back). Same logits as the full rows up to float rounding (~1e-6).

    ids_U_P / mask_U_P: each distinct prompt but its last token, left-padded (P may be 0); rows_B: each row's prompt
    in them; positions_B_T: the sequence positions of the rows' own tokens (the prompt's last token, then the
    response), which are `SelectedLogits.forward`'s input_ids.
    """

    ids_U_P: torch.Tensor
    mask_U_P: torch.Tensor
    rows_B: torch.Tensor
    positions_B_T: torch.Tensor


def distinct(seqs: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """(the distinct sequences in order of first appearance, each sequence's index in them): the n samples of a
    prompt find their one copy, which the hf engine prefills and the trainer runs once."""
    first: dict[tuple[int, ...], int] = {}
    rows = [first.setdefault(tuple(s), len(first)) for s in seqs]
    return list(first), rows


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
