"""Would an fp32 LM head bring bf16 log-probabilities under speculation within 1e-2 of plain decoding's?

One answer of the bundled verifier in bf16 is scored twice: in one forward over the whole sequence (as a tree verify
scores many tokens at once) and token by token (plain decoding's one-token forwards). For each, the log-probabilities
of the answer's tokens come from the model's own bf16 LM head and from the same final hidden states through the head
in fp32. Printed: the largest and median absolute difference of the chosen tokens' log-probabilities and the largest of
the top-5 values, between the two shapes with each head, and between the heads for each shape.

``--fp32-attention`` runs the model's attention in fp32 (queries, keys and values upcast, the output rounded back to
bf16): whether the shapes' difference comes from bf16 attention. It does not close the gap (BENCHMARKS.md): a
rounding flip anywhere - even the linear layers, whose rows agree in all but ~1e-4 of values between one row and 40
- spreads to most of the next layer's values.

    python benchmarks/logprobs_head_precision.py --threads 2 [--fp32-attention]
"""
from __future__ import annotations

import argparse

PROMPT = "Explain what a KV cache is in two sentences."


def _register_fp32_attention() -> str:
    """Registers with transformers an attention that runs torch's SDPA in fp32 over bf16 inputs; returns its name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa_fp32(module, query, key, value, attention_mask, **kwargs):  # [batch, heads, q, head_dim] each
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
        return out.to(query.dtype), weights

    AttentionInterface.register("sdpa_fp32", sdpa_fp32)
    return "sdpa_fp32"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--fp32-attention", action="store_true", help="attention in fp32 (inputs upcast, output in bf16)")
    args = p.parse_args(argv)
    import torch

    import metasd
    from metasd.config import default_pool_path, read_yaml_mapping
    from metasd.core.engine import Engine

    torch.set_num_threads(args.threads)
    raw = read_yaml_mapping(default_pool_path(), "pool config")
    verifier = metasd.load_pool(None, {"verifier": {**raw["verifier"], "dtype": "bf16"}}).verifier
    model = verifier.model
    if args.fp32_attention:
        model.set_attn_implementation(_register_fp32_attention())
    plain = Engine(verifier, None)
    messages = [{"role": "user", "content": PROMPT}]
    prompt = plain.encode(messages)
    ids = prompt + list(plain.generate(messages, args.max_new_tokens).token_ids)
    P, x = len(prompt), torch.tensor([ids])
    head = model.get_output_embeddings()
    W = head.weight.float()  # [vocab, hidden]
    hidden = {}
    hook = head.register_forward_hook(lambda m, a, o: hidden.__setitem__("h", a[0].detach()))

    def fp32(h):  # the LM head in fp32 over bf16 hidden states: [m, hidden] -> [m, vocab]
        return (h.float() @ W.T).log_softmax(-1)

    with torch.no_grad():
        out = model(x)  # every position in one forward
        whole_bf16 = out.logits[0, P - 1:-1].float().log_softmax(-1)
        whole_fp32 = fp32(hidden["h"][0, P - 1:-1])
        out = model(x[:, :P], use_cache=True)  # the prompt, then one token a forward
        cache = out.past_key_values
        step_bf16, step_fp32 = [out.logits[0, -1].float().log_softmax(-1)], [fp32(hidden["h"][0, -1:])[0]]
        for t in range(P, len(ids) - 1):
            out = model(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            step_bf16.append(out.logits[0, -1].float().log_softmax(-1))
            step_fp32.append(fp32(hidden["h"][0, -1:])[0])
    hook.remove()
    step_bf16, step_fp32 = torch.stack(step_bf16), torch.stack(step_fp32)
    chosen = x[0, P:]

    def compare(a, b, name):
        diff = (a.gather(1, chosen[:, None]) - b.gather(1, chosen[:, None])).abs()
        top = a.topk(5, -1)
        top_diff = (top.values - b.gather(1, top.indices)).abs()
        print(f"{name}: chosen max {diff.max():.4f} median {diff.median():.4f}; top-5 max {top_diff.max():.4f}")

    attention = model.config._attn_implementation
    print(f"{len(chosen)} answer tokens, verifier {verifier.describe()}, attention {attention}")
    compare(whole_bf16, step_bf16, "bf16 head: one forward vs token by token")
    compare(whole_fp32, step_fp32, "fp32 head: one forward vs token by token")
    compare(whole_fp32, whole_bf16, "one forward: fp32 head vs bf16 head")
    compare(step_fp32, step_bf16, "token by token: fp32 head vs bf16 head")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
