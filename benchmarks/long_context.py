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


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="nine-b-shape")
    p.add_argument("--devices", default="cuda:0")
    p.add_argument("--dtype", default=None)
    p.add_argument("--lengths", default="8192,16384,32768,65536,131072,262144")
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk (0: one forward)")
    p.add_argument("--decode", type=int, default=64, help="greedy tokens after each prefill")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = args.devices.split(",")[0]
    dtype = parse_dtype(args.dtype, args.model, device)
    config = model_config(args.model)
    model = build_model(args.model, seed=0, dtype=dtype, device=device)
    plan = plan_shards(config.num_hidden_layers, args.devices, None)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    chunk = args.chunk or None
    rows = []
    gen = torch.Generator().manual_seed(0)
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
        t1 = time.perf_counter()
        pos = length
        while len(out) < args.decode:
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
            "decode_tokens_per_s": (len(out) - 1) / decode_s if len(out) > 1 else None,
        }
        rows.append(row)
        print(
            f"{length:>8,} tokens: prefill {row['prefill_tokens_per_s']:>9,.0f} tok/s "
            f"({prefill_s:.2f} s), peak "
            f"{'-' if peak is None else size_text(peak)}, KV {size_text(est.kv)}, decode "
            f"{row['decode_tokens_per_s'] or 0:,.1f} tok/s",
            file=sys.stderr,
        )
        del target
    report = {
        "model": args.model, "devices": args.devices, "dtype": str(dtype), "chunk": chunk,
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
