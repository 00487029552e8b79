"""Time of the replay check's gradient prints on one device: ``grad_print.Batch`` (the ``lin64`` keyed linear
digest, tensors of one size digested together, every print read back with one host sync) against two peers
measured in the same run, the digests it replaced: ``lin64`` one tensor at a time (read back at once), and per
tensor, two sums of splitmix64 of every element's bits xor a keyed hash of its position, read back tensor by tensor
(three host syncs each).

    python bench/grad_digest.py [--device cuda] [--tensors 1000] [--elements 3145728] [--rounds 2]
    python bench/grad_digest.py --layers 8 [--device cuda]

Defaults: 1,000 bf16 tensors of 2048 x 1536 elements (one Qwen3-30B-A3B expert's fc1 gradient), 3.1 G elements.
``--layers N``: the large gradients of N Qwen3-30B-A3B layers instead (attention, router and 128 experts' fc1 and
fc2 a layer: 260 tensors, 0.62 G elements a layer), as a training pass leaves them. Prints seconds and ns per
element of each and the ratios; writes nothing.
"""

from __future__ import annotations

import argparse
import time

import torch

from moeverify.oracles.bits import bits
from moeverify.oracles.replay import grad_print
from moeverify.runtime import hash64

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


def lin64_per_tensor(grads: dict) -> dict:
    """The nearer peer: ``lin64`` digest, sums and extrema queued one tensor at a time, read back with one copy."""
    queued = [
        (key, grad_print._lin64(bits(g).reshape(1, -1)), grad_print._stats(g.reshape(1, -1)))
        for key, g in grads.items()
    ]
    sums = torch.cat([s.reshape(-1, len(grad_print._LANES)) for _, s, _ in queued]).cpu().numpy()
    stats = torch.cat([st for *_, st in queued]).cpu()
    return {key: (sums, stats) for key, _, _ in queued}


def layer_shapes(layers: int) -> list[tuple[int, int]]:
    """The gradients above ``grad_print.KEEP`` elements of ``layers`` Qwen3-30B-A3B decoder layers."""
    one = [(5120, 2048), (2048, 4096), (128, 2048)] + [(1536, 2048), (2048, 768)] * 128
    return one * layers


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
    p.add_argument("--layers", type=int, default=0, help="a training pass's gradients of this many layers")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    gen = torch.Generator(device=args.device).manual_seed(0)
    shapes = layer_shapes(args.layers) if args.layers else [(args.elements,)] * args.tensors
    grads = {
        i: torch.randn(shape, device=args.device, generator=gen).to(torch.bfloat16) for i, shape in enumerate(shapes)
    }
    n = sum(g.numel() for g in grads.values())

    def timed(fn) -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    print(f"{len(grads)} bf16 tensors, {n / 1e9:.2f} G elements, on {args.device}")
    print(
        f"{'round':>5} | {'splitmix64 per tensor':>24} | {'lin64 per tensor':>24} | {'lin64 grouped':>24} | "
        "vs splitmix | vs lin64 per tensor"
    )
    for rnd in range(args.rounds):
        old = timed(lambda: [splitmix_per_tensor(g) for g in grads.values()])
        near = timed(lambda: lin64_per_tensor(grads))
        new = timed(lambda: lin64_batch(grads))
        print(
            f"{rnd:>5} | {old:7.2f} s ({old / n * 1e9:.3f} ns/el) | {near:7.2f} s ({near / n * 1e9:.3f} ns/el) | "
            f"{new:7.2f} s ({new / n * 1e9:.3f} ns/el) | {old / new:10.1f}x | {near / new:.2f}x"
        )


if __name__ == "__main__":
    main()
