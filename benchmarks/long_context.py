"""Long-context prefill and decode: tokens/s and peak memory against the context length.

For each length ``L``: a target sized for ``L`` prompt tokens and ``--decode`` more, the
prompt (seeded random ids) prefilled in chunks of ``--chunk`` (device-synchronised wall
time, peak allocated memory over the weights), then plain greedy decoding of ``--decode``
tokens at that context (tokens/s). The JSON holds each length's row and the weights'
bytes; the table goes to stderr.

    python benchmarks/long_context.py --model nine-b-shape --devices cuda:0 \\
        --lengths 8192,32768,131072,262144 --chunk 4096 --out results/long_context.json
    python benchmarks/long_context.py --model tiny --devices cpu --lengths 512,2048  # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dflash.execution import plan_shards
from dflash.execution.memory import context_memory, size_text
from dflash.execution.oracle import greedy_target
from dflash.execution.session import build_model, model_config, parse_dtype
from dflash.execution.shards import ShardedTarget
from dflash.model.layers import GdnChunking, default_gdn_chunking

#: decoded tokens left out of the decode timing (the first captures the CUDA graphs)
WARM_DECODE = 4


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _profile(target: ShardedTarget, prompt: list[int], device: str) -> None:
    """A warm prefill of ``prompt`` again under the torch profiler: its top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        target.prefill(prompt)   # at 0: a new sequence
        _sync(device)
    sort = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="nine-b-shape")
    p.add_argument("--devices", default="cuda:0")
    p.add_argument("--dtype", default=None)
    p.add_argument("--lengths", default="8192,16384,32768,65536,131072,262144")
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk (0: one forward)")
    p.add_argument("--decode", type=int, default=64,
                   help=f"greedy tokens after each prefill (the first {WARM_DECODE} untimed)")
    p.add_argument("--gdn", choices=("auto", "chunked", "recurrent"), default="auto",
                   help="the GDN layers' prefill form (auto: the model's default for the device)")
    p.add_argument("--gdn-chunk", type=int, default=None,
                   help="tokens per chunk of the chunk-parallel form (a power of two, 16-128; "
                   "default: the device's, 32 on CUDA, 64 on CPU)")
    p.add_argument("--gdn-precision", choices=("ieee", "tf32"), default=None,
                   help="the chunk-parallel form's products: float32 or tf32 tensor cores "
                   "(default: the device's, tf32 on CUDA, ieee on CPU)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--profile", type=int, default=None, metavar="LENGTH",
                   help="profile this length's prefill again (warm): the top CUDA kernels")
    args = p.parse_args(argv)
    device = args.devices.split(",")[0]
    dtype = parse_dtype(args.dtype, args.model, device)
    config = model_config(args.model)
    model = build_model(args.model, seed=0, dtype=dtype, device=device)
    model.chunked_prefill = args.gdn != "recurrent"   # auto: the default, chunk-parallel
    if args.gdn_chunk is not None or args.gdn_precision is not None:
        default = default_gdn_chunking(torch.device(device))
        try:
            model.gdn_chunk = GdnChunking(args.gdn_chunk or default.chunk,
                                          args.gdn_precision or default.precision)
        except ValueError as exc:
            p.error(str(exc))
    plan = plan_shards(config.num_hidden_layers, args.devices, None)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    chunk = args.chunk or None
    if args.decode <= WARM_DECODE:
        p.error(f"--decode must exceed {WARM_DECODE} (got {args.decode})")
    rows = []
    gen = torch.Generator().manual_seed(0)
    # a warm-up prefill (kernel compilation and autotuning stay out of the first row)
    warm = torch.randint(0, config.vocab_size, (2 * (chunk or 1024),), generator=gen).tolist()
    greedy_target(model, plan, len(warm), 1, prefill_chunk=chunk).prefill(warm)
    for length in (int(x) for x in args.lengths.split(",")):
        prompt = torch.randint(0, config.vocab_size, (length,), generator=gen).tolist()
        est = context_memory(config, range(config.num_hidden_layers),
                             max_len=length + args.decode, max_draft=1, dtype=dtype,
                             capture="states", trees=False, prefill_chunk=chunk)
        target = greedy_target(model, plan, length, args.decode, prefill_chunk=chunk)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        logits, _ = target.prefill(prompt)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None
        out = [int(logits[-1].argmax())]
        pos = length
        while len(out) < args.decode:
            if len(out) == WARM_DECODE:   # the first tokens capture the CUDA graphs
                _sync(device)
                t1 = time.perf_counter()
            logits, _ = target.forward([out[-1]], "decode", pos)
            pos += 1
            out.append(int(logits[-1].argmax()))
        _sync(device)
        decode_s = time.perf_counter() - t1
        row = {
            "length": length,
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": length / prefill_s,
            "peak_bytes": peak,
            "peak_over_weights_bytes": None if peak is None else peak - weights,
            "kv_bytes": est.kv,
            "state_bytes": est.state,
            "workspace_estimate_bytes": est.workspace,
            "decode_tokens_per_s": (len(out) - WARM_DECODE) / decode_s,
        }
        rows.append(row)
        print(
            f"{length:>8,} tokens: prefill {row['prefill_tokens_per_s']:>9,.0f} tok/s "
            f"({prefill_s:.2f} s), peak "
            f"{'-' if peak is None else size_text(peak)}, KV {size_text(est.kv)}, decode "
            f"{row['decode_tokens_per_s']:,.1f} tok/s",
            file=sys.stderr,
        )
        if args.profile == length:
            _profile(target, prompt, device)
        del target
    setting = model.gdn_chunk or default_gdn_chunking(torch.device(device))
    report = {
        "model": args.model, "devices": args.devices, "dtype": str(dtype), "chunk": chunk,
        "gdn": args.gdn, "gdn_chunk": setting.chunk, "gdn_precision": setting.precision,
        "weights_bytes": weights, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
        "rows": rows,
    }
    text = json.dumps(report, indent=2)
    if args.out is None:
        print(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
