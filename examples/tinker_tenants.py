"""Two tenants train their own LoRA adapters at once on one `posttrain serve`, with the unmodified tinker SDK.

Start the service first (after `make demo`, which publishes the SFT model `latest:sft` serves):

    printf 'tml-alice-secret alice\\ntml-bob-secret bob\\n' > keys.txt
    .venv/bin/posttrain serve --base-model posttrain/sft=latest:sft --port 8000 --keys keys.txt

then, in another shell:

    .venv/bin/python examples/tinker_tenants.py [--url http://127.0.0.1:8000] [--steps 20]

Each tenant runs the plainest supervised loop on its own arithmetic facts (forward_backward + optim_step), samples
from its adapter, and saves its state. The script prints each tenant's loss curve, a sample and the `tinker://`
path of its checkpoint, which `posttrain artifacts ls --stage serve` lists and the eval flow accepts as a model.
"""

from __future__ import annotations

import argparse
import threading

import tinker
from tinker import types

FACTS = {
    "tml-alice-secret": ["What is 12 + 7? 19", "What is 30 + 5? 35", "What is 8 + 8? 16", "What is 21 + 2? 23"],
    "tml-bob-secret": ["What is 12 - 7? 5", "What is 30 - 5? 25", "What is 8 - 8? 0", "What is 21 - 2? 19"],
}


def datum(tokenizer, text: str) -> types.Datum:
    """Next-token prediction on the answer and the end-of-sequence token after it; the question gets weight 0."""
    question, answer = text.rsplit("? ", 1)
    prompt, full = tokenizer.encode(question + "? "), tokenizer.encode(text) + [tokenizer.eos_token_id]
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def tenant(url: str, key: str, base: str, steps: int, out: dict) -> None:
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=base, rank=8).result()
    tokenizer = training.get_tokenizer()
    batch = [datum(tokenizer, t) for t in FACTS[key]]
    losses = []
    for _ in range(steps):
        fwd = training.forward_backward(batch, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=2e-3))
        result = fwd.result()
        opt.result()
        weight = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
        losses.append(result.metrics["loss:sum"] / weight)  # mean NLL per answer token
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode(FACTS[key][0].rsplit("? ", 1)[0] + "? "))
    sample = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0)).result()
    out[key] = {
        "losses": losses,
        "sample": tokenizer.decode(sample.sequences[0].tokens, skip_special_tokens=True),
        "path": training.save_state(f"step-{steps}").result().path,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--base-model", default="posttrain/sft")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    out: dict = {}
    threads = [threading.Thread(target=tenant, args=(args.url, k, args.base_model, args.steps, out)) for k in FACTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key, r in out.items():
        curve = " ".join(f"{x:.2f}" for x in r["losses"][:: max(1, len(r["losses"]) // 5)])
        print(f"{key.split('-')[1]}: loss per answer token {curve} -> {r['losses'][-1]:.2f}")
        print(f"  greedy sample: {FACTS[key][0].rsplit('? ', 1)[0]}? {r['sample']!r}")
        print(f"  checkpoint: {r['path']}")


if __name__ == "__main__":
    main()
