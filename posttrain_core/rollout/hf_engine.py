"""The Hugging Face rollout engine: batched sampling with a KV cache, n samples per prompt, the policy's log-probs.

An explicit decode loop (not `model.generate`) so that every sample has its own seeded random stream and the
returned log-probs are exactly the trainer's (the raw model distribution); see `HFEngine`.
"""

from __future__ import annotations

import functools
import hashlib
import time
import warnings
from dataclasses import dataclass

import pyarrow as pa
import torch

from posttrain_core.rollout.engine import ROLLOUT_COLUMNS, SINGLE_TURN, SamplingSettings
from posttrain_core.vision.inputs import VisionSpec, ban, forward_inputs

# The stable ids of one sample's random stream: (sampling seed, prompt_id, sample_index).
_SEED_MASK = (1 << 63) - 1


def sample_seed(seed: int, prompt_id: str, sample_index: int) -> int:
    """The seed of one sample's own generator: sha256 of (seed, prompt_id, sample_index), 63 bits.

    A hash, not Python's `hash()` (salted per process), so every process and machine draws the same stream.
    """
    digest = hashlib.sha256(f"{seed}\x1f{prompt_id}\x1f{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _SEED_MASK


def process_logits(logits_B_V: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """Sampling probabilities: softmax(logits / temperature) restricted to the top-k tokens (k > 0), then to the
    top-p nucleus, renormalised.

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p (the most likely token is always
    kept), as in HF's `TopPLogitsWarper` and vLLM. Temperature must be > 0 here (0 is greedy: see `sample_tokens`).

    Args:
        logits_B_V: raw next-token logits (float32).

    Returns:
        probs_B_V, each row summing to 1.
    """
    if 0 < top_k < logits_B_V.shape[-1]:
        kth_B_1 = logits_B_V.topk(top_k, dim=-1).values[:, -1:]
        logits_B_V = logits_B_V.masked_fill(logits_B_V < kth_B_1, float("-inf"))
    probs_B_V = torch.softmax(logits_B_V / temperature, dim=-1)
    if top_p < 1.0:
        sorted_B_V, order_B_V = probs_B_V.sort(dim=-1, descending=True)
        mass_before_B_V = sorted_B_V.cumsum(dim=-1) - sorted_B_V
        sorted_B_V = sorted_B_V.masked_fill(mass_before_B_V >= top_p, 0.0)
        probs_B_V = torch.zeros_like(probs_B_V).scatter_(-1, order_B_V, sorted_B_V)
        probs_B_V = probs_B_V / probs_B_V.sum(dim=-1, keepdim=True)
    return probs_B_V


def sample_tokens(
    logits_B_V: torch.Tensor, uniforms_B: torch.Tensor, temperature: float, top_p: float, top_k: int = 0
) -> torch.Tensor:
    """Next tokens by inverse-CDF sampling: token = first index whose cumulative probability exceeds u.

    One uniform per row and step (drawn from that sample's own generator) makes a sample depend only on its own
    stream and its own logits, never on which other rows share the batch. temperature == 0 is greedy (argmax).

    Args:
        logits_B_V: raw next-token logits (float32).
        uniforms_B: one U[0, 1) draw per row.

    Returns:
        tokens_B (int64).
    """
    if temperature == 0:
        return logits_B_V.argmax(dim=-1)
    cdf_B_V = process_logits(logits_B_V, temperature, top_p, top_k).cumsum(dim=-1)
    target_B_1 = (uniforms_B * cdf_B_V[:, -1]).unsqueeze(-1)  # scaled by the total: float rounding of the cumsum
    tokens_B = torch.searchsorted(cdf_B_V, target_B_1, right=True).squeeze(-1)
    return tokens_B.clamp_(max=logits_B_V.shape[-1] - 1)


def eos_and_pad(tokenizer, model: torch.nn.Module) -> tuple[list[int], int]:
    """(the tokens that end a sample: the tokenizer's eos and the generation config's, the padding token: the
    tokenizer's, else the first eos)."""
    eos = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    eos_ids = sorted(i for i in eos if i is not None)
    return eos_ids, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]


@dataclass
class Vision:
    """A decode batch's images: per context, its prompt's pixels and grid (None: no image) and a key that tells
    contexts of one prompt from another prompt with the same tokens."""

    spec: VisionSpec
    pixels: list[torch.Tensor | None]
    grids: list[torch.Tensor | None]
    keys: list[int]

    def part(self, start: int, end: int) -> Vision:
        return Vision(self.spec, self.pixels[start:end], self.grids[start:end], self.keys[start:end])


@dataclass
class _Sample:
    row: int  # index of the prompt row in the input table
    sample_index: int
    prompt_ids: list[int]


class HFEngine:
    """Engine (see `posttrain_core.rollout.engine.Engine`) on a Hugging Face causal LM or LoRA adapter folder.

    Choices, stated once:
    - **Log-probs** are those of the raw model distribution, log_softmax(logits) at temperature 1 without top-p,
      of the sampled tokens: exactly what the trainer recomputes with a forward pass over prompt + response, so
      |logp_rollout - logp_trainer| is ~0 in fp32 (~1e-6 from KV-cache vs full-forward rounding). With temperature
      != 1 or top_p < 1 the sampling distribution differs from this one; correcting for that is the trainer's job.
      vLLM's default (`logprobs_mode="raw_logprobs"`) is the same quantity.
    - **Seeds**: sample (prompt_id, sample_index) draws from its own `torch.Generator` seeded with
      `sample_seed(seed, prompt_id, sample_index)`: its stream is `torch.rand(max_tokens)`, step t uses uniform t,
      and tokens are chosen by inverse-CDF sampling. Same seed -> same samples regardless of batch size, row order or which engine actor got
      the prompt. Only float rounding of the logits can differ with the batch's padding (~1e-7), which flips a token
      only when a uniform falls that close to a CDF boundary.
    - **Stops**: eos (the tokenizer's and the generation config's) ends a sample with finish_reason "stop" and the
      eos token is kept in `response_ids` (its log-prob is what teaches the policy to stop). A stop string ends it
      with "stop" too: `response_text` is cut before the stop string, `response_ids` keep every token generated up
      to the one that completed it (vLLM's behaviour). max_tokens reached without a stop: "length".
    - LoRA adapter folders run unmerged through peft, like the trainer, so the log-probs match it.

    Args:
        model_path: a model or adapter folder (`load_causal_lm`).
        dtype: weights dtype; logits are processed in float32 whatever it is.
        policy_digest: written into every row's `policy_digest` (default: the model path).
        max_batch_size: sequences (prompt x sample) per forward pass.
    """

    def __init__(
        self, model_path: str, dtype: str = "float32", policy_digest: str | None = None, max_batch_size: int = 256
    ):
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.load(model_path, policy_digest)

    def load(self, model_path: str, policy_digest: str | None = None) -> str:
        """Serve the policy at `model_path` (full model or adapter folder) instead of the current one; "reloaded".

        The HF engine simply reloads the folder in this process: on the models it is meant for (CPU tests, small
        GPUs) that takes well under a second, and it is the same path a fresh actor takes after a crash.
        """
        from posttrain_core.models.loading import check_model_path, load_causal_lm, load_tokenizer

        info = check_model_path(model_path)
        self.model = None  # the old weights are freed before the new ones load
        self.model_path = str(model_path)
        self.policy_digest = policy_digest or self.model_path
        self.tokenizer = load_tokenizer(model_path, require_chat_template=True)
        self.model = load_causal_lm(model_path, dtype=self.dtype).eval()
        self.max_context = info.get("max_position_embeddings")
        self.model_type = info.get("model_type")
        self.vision = VisionSpec.of(model_path)
        self.eos_ids, self.pad_id = eos_and_pad(self.tokenizer, self.model)
        return "reloaded"

    def close(self) -> None:
        self.model = None

    def load_weights(self, weights: dict, policy_digest: str) -> None:
        """Copy a full model's weights (name -> array, the keys of this model's state dict) into the loaded model, in
        place: the same architecture and tokenizer, new values (an RL update's policy, taken in memory).

        Raises:
            ValueError: an adapter is loaded, or the names or shapes differ from this model's (nothing is changed).
        """
        if hasattr(self.model, "peft_config"):
            raise ValueError("load_weights: the engine serves a LoRA adapter; load the adapter folder instead")
        own = self.model.state_dict()
        if set(weights) != set(own) or any(tuple(own[k].shape) != tuple(v.shape) for k, v in weights.items()):
            raise ValueError(f"load_weights: the weights do not fit the model loaded from {self.model_path}")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # Ray's: read-only
            for name, value in weights.items():
                own[name].copy_(torch.as_tensor(value))
        self.policy_digest = policy_digest

    def generate(self, prompts: pa.Table, params: SamplingSettings) -> pa.Table:
        """n samples of every prompt row -> a `rollouts` table, rows ordered by (prompt row, sample_index).

        Args:
            prompts: rows with `prompt_id`, `messages` and optionally `answer` (a `prompts` table or a batch of one).
            params: sampling settings.

        Raises:
            ValueError: a prompt plus max_tokens does not fit the model's context.
        """
        from posttrain_core.data.chat import tokenize_prompt
        from posttrain_core.data.schemas import validate_table

        self.last_stats = {"tokens": 0, "seconds": 0.0}
        if prompts.num_rows == 0:
            return validate_table(pa.table({name: [] for name in ROLLOUT_COLUMNS}), "rollouts", source="HFEngine")
        prompt_ids = prompts.column("prompt_id").to_pylist()
        answers = prompts.column("answer").to_pylist() if "answer" in prompts.column_names else [None] * len(prompt_ids)
        messages = prompts.column("messages").to_pylist()
        images = prompts.column("images").to_pylist() if "images" in prompts.column_names else [None] * len(messages)
        vision = None
        if self.vision is not None:
            built = [self.vision.prompt(self.tokenizer, m, im, f"prompt {pid!r}")
                     for m, im, pid in zip(messages, images, prompt_ids, strict=True)]  # fmt: skip
            encoded = [b.ids for b in built]
        else:
            with_images = next((pid for pid, im in zip(prompt_ids, images, strict=True) if im), None)
            if with_images is not None:
                raise ValueError(
                    f"HFEngine: prompt {with_images!r} has images, but {self.model_path} is a text-only model "
                    f"({self.model_type}); use a vision-language model (docs/vlm.md)"
                )
            encoded = [tokenize_prompt(self.tokenizer, m) for m in messages]
        longest = max(len(x) for x in encoded)
        budget = params.tools.max_total_tokens if params.tools else params.max_tokens
        if self.max_context and longest + budget > self.max_context:
            raise ValueError(
                f"HFEngine: longest prompt ({longest} tokens) + {'tools.max_total_tokens' if params.tools else 'max_tokens'}"
                f" ({budget}) exceeds the model's context (max_position_embeddings={self.max_context})"
            )
        started = time.perf_counter()
        if params.tools is not None:
            from posttrain_core.rollout.multiturn import generate_rows

            sample = functools.partial(self._sample, params=params)
            rows = generate_rows(sample, self.tokenizer, prompts, params, self.policy_digest, self.vision)
            return self._table(rows, started)
        samples = [_Sample(row, k, encoded[row]) for row in range(len(encoded)) for k in range(params.n)]
        seeds = [sample_seed(params.seed, prompt_ids[s.row], s.sample_index) for s in samples]
        if self.vision is not None:
            vision = Vision(self.vision, [built[s.row].pixel_values for s in samples],
                            [built[s.row].grid_thw for s in samples], [s.row for s in samples])  # fmt: skip
        outs = self._sample([s.prompt_ids for s in samples], seeds, params, vision)
        results = [
            {"prompt_id": prompt_ids[s.row], "sample_index": s.sample_index, "prompt_ids": s.prompt_ids,
             "answer": answers[s.row], "policy_digest": self.policy_digest, "images": images[s.row] or None,
             **SINGLE_TURN, **out}
            for s, out in zip(samples, outs, strict=True)
        ]  # fmt: skip
        return self._table(results, started)

    @torch.no_grad()
    def score(self, rows: pa.Table, topk: int) -> pa.Table:
        """The served model as a teacher (`Engine.score`): the LM head runs on the response positions only, a chunk
        at a time (`TokenLogprobs`, the trainer's own log-prob path), `max_batch_size` rows per forward pass."""
        from types import SimpleNamespace

        from posttrain_core.models.heads import TokenLogprobs
        from posttrain_core.rollout.engine import teacher_columns
        from posttrain_core.train.rl_batch import encode

        prompts, responses = rows.column("prompt_ids").to_pylist(), rows.column("response_ids").to_pylist()
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            if self.max_context and len(p) + len(r) > self.max_context:
                raise ValueError(
                    f"HFEngine.score: row {i} has {len(p) + len(r)} tokens, beyond the context of {self.model_path} "
                    f"(max_position_embeddings={self.max_context})"
                )
        data = SimpleNamespace(
            prompt_ids=prompts, response_ids=responses, response_mask=[[1] * len(r) for r in responses]
        )
        net = TokenLogprobs(self.model)
        logprobs, ids, top = [], [], []
        for start in range(0, len(prompts), self.max_batch_size):
            chunk = list(range(start, min(start + self.max_batch_size, len(prompts))))
            input_ids, attn, pos, labels, _ = encode(data, chunk, self.pad_id)
            scores = net(input_ids, attn, pos, labels, topk=topk)
            for b, i in enumerate(chunk):
                n = len(responses[i])
                logprobs.append(scores.logp[b, :n].tolist())
                if topk:
                    ids.append(scores.topk_ids[b, :n].tolist())
                    top.append(scores.topk_logp[b, :n].tolist())
        return teacher_columns(logprobs, ids if topk else None, top if topk else None)

    def _sample(
        self, contexts: list[list[int]], seeds: list[int], params: SamplingSettings, vision: Vision | None = None
    ) -> list[dict]:
        """One sample per context (token ids) with its own seed, `max_batch_size` contexts per decode batch."""
        out: list[dict] = []
        for start in range(0, len(contexts), self.max_batch_size):
            end = start + self.max_batch_size
            part = vision.part(start, end) if vision is not None else None
            out += decode(self.model, self.tokenizer, self.pad_id, self.eos_ids, contexts[start:end],
                          seeds[start:end], params, part)  # fmt: skip
        return out

    def _table(self, results: list[dict], started: float) -> pa.Table:
        from posttrain_core.data.schemas import validate_table

        self.last_stats = {
            "tokens": sum(len(r["response_ids"]) for r in results),
            "seconds": time.perf_counter() - started,
        }
        table = pa.table({name: [r.get(name) for r in results] for name in ROLLOUT_COLUMNS})
        return validate_table(table, "rollouts", source="HFEngine")


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    tokenizer,
    pad_id: int,
    eos_ids: list[int],
    prompts: list[list[int]],
    seeds: list[int],
    params: SamplingSettings,
    vision: Vision | None = None,
) -> list[dict]:
    """One batch: left-padded prefill, then one token per step for every unfinished row, with a KV cache.

    Each distinct prompt is prefilled once and its cache rows are copied to every sample of it (the n samples of
    a prompt share their prompt): n times less prefill work, the same logits (a row's prefill does not depend on
    which other rows share its batch, beyond float rounding; see `HFEngine`).

    Args:
        model: a causal LM (or a peft model, with the adapter to sample from active).
        eos_ids: the tokens that end a sample ("stop", kept in the response).
        vision: a VLM's prompt pixels (`Vision`); the prefill takes them with its positions, the decode steps are
            text, and the vision tokens are never sampled.
    """
    from posttrain_core.models.heads import distinct, left_padded

    B = len(prompts)
    unique, src = distinct(prompts, vision.keys if vision else None)  # each sample's prefill row
    src_B = torch.tensor(src)
    ids_U_P, mask_U_P = left_padded(unique, pad_id)  # every prompt ends where generation starts
    U, P = ids_U_P.shape
    # Positions count real tokens only, so a padded row sees the positions it would alone (as the trainer does).
    pos_U_P = (mask_U_P.cumsum(-1) - 1).clamp_(min=0)
    extra: dict = {}
    banned_V = None
    if vision is not None:
        first = {u: i for i, u in reversed(list(enumerate(src)))}  # a sample of each prefill row
        extra = forward_inputs(
            model, vision.spec, ids_U_P, mask_U_P, [vision.pixels[first[u]] for u in range(U)],
            [vision.grids[first[u]] for u in range(U)], "HFEngine prefill",
        )  # fmt: skip
        pos_U_P = extra.pop("position_ids")  # M-RoPE: 3 x U x P; the prompt's last token is text: its 3 rows agree
        banned_V = torch.tensor(vision.spec.banned_ids)
    # Each sample's stream: torch.rand(max_tokens) from its own generator; step t uses element t.
    uniforms_B_T = torch.zeros((B, params.max_tokens))
    if params.temperature > 0:
        for i, s in enumerate(seeds):
            uniforms_B_T[i] = torch.rand(params.max_tokens, generator=torch.Generator().manual_seed(s))
    eos_V = torch.tensor(eos_ids, dtype=torch.long)
    stops = tuple(s for s in params.stop if s)

    tokens: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    texts: list[str | None] = [None] * B  # set when a stop string ends the row
    finish: list[str | None] = [None] * B
    out = model(
        input_ids=ids_U_P,
        attention_mask=mask_U_P,
        position_ids=pos_U_P,
        use_cache=True,
        logits_to_keep=1,
        **extra,
    )
    cache = out.cache
    if U < B:
        cache.reorder_cache(src_B)  # prompt rows -> sample rows (an index_select of every layer's keys/values)
    mrope = pos_U_P.dim() == 3
    pos_B = pos_U_P[0, src_B, -1] if mrope else pos_U_P[src_B, -1]
    mask_B_L = torch.cat([mask_U_P[src_B], torch.ones((B, params.max_tokens), dtype=torch.long)], dim=1)
    logits_B_V = out.logits[src_B, -1, :].float()
    for step in range(params.max_tokens):
        logits_B_V = ban(logits_B_V, banned_V)
        next_B = sample_tokens(logits_B_V, uniforms_B_T[:, step], params.temperature, params.top_p, params.top_k)
        logp_B = torch.log_softmax(logits_B_V, dim=-1).gather(-1, next_B[:, None]).squeeze(-1)
        next_list, logp_list = next_B.tolist(), logp_B.tolist()
        eos_list = torch.isin(next_B, eos_V).tolist()
        for i in range(B):
            if finish[i] is not None:
                continue
            tokens[i].append(next_list[i])
            logps[i].append(logp_list[i])
            if eos_list[i]:
                finish[i] = "stop"
            elif stops:
                text = tokenizer.decode(tokens[i], skip_special_tokens=True)
                cut = min((k for k in (text.find(s) for s in stops) if k >= 0), default=-1)
                if cut >= 0:
                    texts[i], finish[i] = text[:cut], "stop"
        if all(f is not None for f in finish) or step == params.max_tokens - 1:
            break
        # Finished rows keep stepping on pad tokens (their outputs are ignored): simpler than shrinking the cache.
        feed_B = torch.where(torch.tensor([f is None for f in finish]), next_B, torch.full_like(next_B, pad_id))
        pos_B = pos_B + 1
        out = model(
            input_ids=feed_B[:, None],
            attention_mask=mask_B_L[:, : P + step + 1],
            position_ids=pos_B[None, :, None].expand(3, B, 1) if mrope else pos_B[:, None],
            cache=cache,
            use_cache=True,
        )
        cache = out.cache
        logits_B_V = out.logits[:, -1, :].float()

    results = []
    for i in range(B):
        text = texts[i]
        if text is None:
            text = tokenizer.decode(tokens[i], skip_special_tokens=True)
        results.append(
            {
                "response_ids": tokens[i],
                "response_text": text,
                "logprobs": logps[i],
                "finish_reason": finish[i] or "length",
            }
        )
    return results
