"""Time of the replay check's gradient prints on one device: ``grad_print.keep_all`` (the ``lin64`` keyed linear
digest, every print read back with one host sync) against its peer measured in the same run, the digest it
replaced: per tensor, two sums of splitmix64 of every element's bits xor a keyed hash of its position, read back
tensor by tensor (three host syncs each).

    python bench/grad_digest.py [--device cuda] [--tensors 1000] [--elements 3145728] [--rounds 2]

Defaults: 1,000 bf16 tensors of 2048 x 1536 elements (one Qwen3-30B-A3B expert's fc1 gradient), 3.1 G elements.
Prints ns per element of each and the ratio; writes nothing.
"""

from __future__ import annotations

import argparse
import time

import torch

from moeverify import hash64
from moeverify.oracles.bits import bits
from moeverify.oracles.replay import grad_print

_LANES = (hash64.signed(0x6A09E667F3BCC908), hash64.signed(0xBB67AE8584CAA73B))


def splitmix_per_tensor(t: torch.Tensor) -> tuple:
    """The peer: the earlier digest, one tensor at a time, its sums and extrema read back at once."""
    flat = bits(t.contiguous()).reshape(-1)
    total, (lo, hi) = float(t.sum(dtype=torch.float64)), (float(v) for v in torch.aminmax(t))
    block, rows = grad_print.BLOCK, -(-flat.shape[0] // grad_print.BLOCK)
    index = torch.arange(1, block + 1, dtype=torch.int64, device=t.device)
    keys = [hash64.mix(index * hash64.GOLDEN + lane) for lane in _LANES]
    part = torch.nn.functional.pad(flat.to(torch.int64), (0, rows * block - flat.shape[0])).view(rows, block)
    sums = torch.stack([hash64.mix(part ^ key).sum(dim=1) for key in keys], dim=1)
    return sums.cpu().numpy().tobytes(), total, max(abs(lo), abs(hi))


def lin64_batch(grads: dict) -> dict:
    """What ``grad_print.keep_all`` does with a pass's large GPU gradients (``lin64`` forced, so a CPU run times the
    same digest)."""
    batch = grad_print.Batch()
    for key, g in grads.items():
        batch.add(key, g, digest="lin64")
    return batch.finish()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--elements", type=int, default=2048 * 1536)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    gen = torch.Generator(device=args.device).manual_seed(0)
    grads = {i: torch.randn(args.elements, device=args.device, generator=gen).to(torch.bfloat16)
             for i in range(args.tensors)}
    n = args.tensors * args.elements

    def timed(fn) -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    print(f"{args.tensors} bf16 tensors of {args.elements} elements ({n / 1e9:.2f} G) on {args.device}")
    print(f"{'round':>5} | {'splitmix64 per tensor':>24} | {'lin64, one read back':>22} | ratio")
    for rnd in range(args.rounds):
        old = timed(lambda: [splitmix_per_tensor(g) for g in grads.values()])
        new = timed(lambda: lin64_batch(grads))
        print(f"{rnd:>5} | {old:7.2f} s ({old / n * 1e9:.3f} ns/el) | {new:6.2f} s ({new / n * 1e9:.3f} ns/el) | "
              f"{old / new:.1f}x")


if __name__ == "__main__":
    main()
