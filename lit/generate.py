"""Generate bytes from a LitLM checkpoint, prompted from the command line.

    python -m lit.generate --ckpt runs/moba/checkpoints/last.ckpt --prompt "def " --max-new-bytes 200
    python -m lit.generate --ckpt ... --prompt "import " --temperature 0.8 --top-k 40 --seed 0

Greedy when ``--temperature 0`` (the default). The whole prefix is re-run per byte (no KV
cache), so this is for inspecting a model, not for speed.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from flexmoba.model import GPT
from lit.module import LitLM


def load_model(ckpt: str, device: str = "cpu") -> GPT:
    """The GPT of a LitLM checkpoint, in eval mode, with the checkpoint's attention override."""
    # Our own checkpoints: their hparams pickle a ModelConfig, which weights-only loading refuses.
    module = LitLM.load_from_checkpoint(ckpt, map_location=device, weights_only=False)
    module.eval()
    return module.model


def next_byte_distribution(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """``logits: [B, V]`` -> sampling probabilities ``[B, V]`` (temperature > 0), top-k truncated."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        threshold = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return F.softmax(logits, dim=-1)


@torch.no_grad()
def generate(model: GPT, prompt: bytes, max_new_bytes: int, temperature: float = 0.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> bytes:
    """``max_new_bytes`` bytes continuing ``prompt`` (greedy when ``temperature == 0``)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one byte")
    device = next(model.parameters()).device
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # [1, S]
    if temperature == 0 and top_k is None:
        return bytes(model.generate(tokens, max_new_bytes)[0, len(prompt):].tolist())
    for _ in range(max_new_bytes):
        logits = model(tokens)[:, -1]
        if temperature == 0:
            next_token = logits.argmax(-1, keepdim=True)
        else:
            probs = next_byte_distribution(logits, temperature, top_k)
            next_token = torch.multinomial(probs, 1, generator=generator)
        tokens = torch.cat([tokens, next_token], dim=1)
    return bytes(tokens[0, len(prompt):].tolist())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a LitLM checkpoint (e.g. runs/moba/checkpoints/last.ckpt)")
    parser.add_argument("--prompt", default="def ", help="text prompt (UTF-8)")
    parser.add_argument("--max-new-bytes", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample only among the k likeliest bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention", choices=["moba", "full"], default=None, help="override every layer")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.max_new_bytes < 0 or args.temperature < 0:
        parser.error("--max-new-bytes and --temperature must be >= 0")
    model = load_model(args.ckpt, args.device)
    if args.attention:
        model.set_attention_override(args.attention)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    prompt = args.prompt.encode()
    out = generate(model, prompt, args.max_new_bytes, args.temperature, args.top_k, generator)
    sys.stdout.buffer.write(prompt + out)
    sys.stdout.buffer.write(b"\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
