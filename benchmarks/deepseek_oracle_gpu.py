"""Time the float64 oracle on a DeepSeek-V3-layout checkpoint of full-width layers.

Writes the random checkpoint (benchmarks/deepseek_checkpoint.py) unless --checkpoint
names one, reads it on the device with the oracle's own reader, and times one
verify step's answers: tree_logits, routing and path_latent for a DDTree-shaped
tree of --budget nodes over a --prefix-token prompt, then the bf16 rounded
tree_logits (the noise yardstick). Prints a table; writes
benchmarks/results/deepseek_oracle_gpu-<shape>.json. --oracles dense,streamed times the
layer-streamed oracle too (reference/streamed.py) and records how far its answers are from the
dense one's (logits, routing margins and experts, latents: 1e-12 and equal are the claim).

    python3 benchmarks/deepseek_oracle_gpu.py --shape deepseek-v3-cut --device cuda
    python3 benchmarks/deepseek_oracle_gpu.py --shape deepseek-v3-cut --device cuda --oracles dense,streamed
    python3 benchmarks/deepseek_oracle_gpu.py --shape tiny-deepseek-v3 --device cpu   # checks the script
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.deepseek_checkpoint import SHAPES, write
from reference.oracle import DenseOracle
from reference.streamed import StreamedOracle

ORACLES = {"dense": DenseOracle, "streamed": StreamedOracle}


def chain_tree(budget: int, vocab: int) -> tuple[list[int], list[int]]:
    """A tree of `budget` nodes: a root, then two branches of alternating depth (as a top-2 DDTree grows)."""
    parents = [-1] + [max(0, i - 2) for i in range(1, budget)]
    return [(7 * i + 3) % vocab for i in range(budget)], parents


def timed(device: str, fn):
    """(seconds, result) of fn(), the device synchronized on both sides."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def run(a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="ddcheck-ds-") as tmp:
        directory = a.checkpoint or Path(tmp)
        t_write = 0.0
        if a.checkpoint is None:
            dtype = torch.bfloat16 if SHAPES[a.shape]["hidden_size"] >= 1024 else torch.float32
            t_write, _ = timed(a.device, lambda: write(a.shape, directory, a.device, a.seed, dtype))
        results = {name: run_oracle(a, directory, ORACLES[name]) for name in a.oracles.split(",")}
    out = next(iter(results.values()))
    out["seconds"] = {"write checkpoint": t_write, **out["seconds"]}
    out["oracle"] = next(iter(results))
    if len(results) == 2:
        (_, one), (_, two) = results.items()
        out["streamed"] = {"seconds": results["streamed"]["seconds"],
                           "vs_dense": {k: rel(two["answers"][k], one["answers"][k]) for k in ("logits", "latent",
                                                                                               "rounded", "margin")},
                           "experts_equal": bool(torch.equal(two["answers"]["experts"], one["answers"]["experts"]))}
    for r in results.values():
        r.pop("answers")
    return out


def run_oracle(a: argparse.Namespace, directory: Path, cls) -> dict:
    """One oracle's load and answers, timed; its answers kept under "answers" for the comparison."""
    t_load, oracle = timed(a.device, lambda: cls.from_checkpoint(directory, a.device))
    cfg = oracle.config
    prefix = [(11 * i + 5) % cfg.vocab_size for i in range(a.prefix)]
    tokens, parents = chain_tree(a.budget, cfg.vocab_size)
    t_prefix, _ = timed(a.device, lambda: oracle.prefixes.get(oracle.model, prefix))
    t_tree, logits = timed(a.device, lambda: oracle.tree_logits(prefix, tokens, parents))
    t_route, routing = timed(a.device, lambda: oracle.routing(prefix, tokens, parents))
    t_latent, latent = timed(a.device, lambda: oracle.path_latent(prefix[:64]))
    t_bf16, rounded = timed(a.device, lambda: oracle.rounded_tree_logits(prefix, tokens, parents, "bfloat16"))
    rows = {"read checkpoint (float64)": t_load, f"prefix {a.prefix} tokens": t_prefix,
            f"tree_logits ({a.budget} nodes)": t_tree, "routing": t_route, "path_latent (64 tokens)": t_latent,
            "rounded_tree_logits bf16": t_bf16}
    margins = routing.margin if routing is not None else torch.zeros(0)
    return {"shape": a.shape, "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
            "budget": a.budget, "prefix": a.prefix, "seconds": rows,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if a.device.startswith("cuda") else None,
            "logits_max_abs": float(logits.abs().max()), "latent_shape": list(latent.shape),
            "bf16_vs_float64_max_abs": float((rounded - logits).abs().max()),
            "routing_margin_min": float(margins.min()) if margins.numel() else None,
            "routing_margin_median": float(margins.median()) if margins.numel() else None,
            "answers": {"logits": logits, "latent": latent, "rounded": rounded,
                        "margin": torch.where(margins.isfinite(), margins, 0.0),
                        "experts": routing.experts if routing else torch.zeros(0)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v3-cut")
    ap.add_argument("--checkpoint", type=Path, default=None, help="a DeepSeek-V3-layout checkpoint to read instead")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--oracles", default="dense", choices=("dense", "streamed", "dense,streamed"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = ap.parse_args()
    result = run(a)
    for name, seconds in result["seconds"].items():
        print(f"{name:34s} {seconds:9.3f} s")
    if "streamed" in result:
        print(f"{'streamed vs dense':34s} {result['streamed']['vs_dense']} experts equal "
              f"{result['streamed']['experts_equal']}")
    for key in ("peak_gpu_gib", "logits_max_abs", "latent_shape", "bf16_vs_float64_max_abs", "routing_margin_min",
                "routing_margin_median"):
        print(f"{key:34s} {result[key]}")
    a.out.mkdir(parents=True, exist_ok=True)
    which = "" if a.oracles == "dense" else "-" + a.oracles.replace(",", "-")
    path = a.out / f"deepseek_oracle_gpu-{a.shape}{which}.json"
    path.write_text(json.dumps(result, indent=1))
    print(path)


if __name__ == "__main__":
    main()
