"""Benchmark ``embed-shard``: a char-level GPT with a large vocabulary on 2 CPU ranks, embedding sharded vs replicated.

Workload: ``lightning_static_dist.examples.charlm.CharGPT`` with ``--vocab`` rows (default 32768; the byte-level data uses the first 256,
the table is what is measured), 4 layers, d=128, tied head, 16 x 128 tokens per rank, AdamW; ``static_dist`` with
``strategy.embedding.shard`` false, true (gather issued at batch start), and true with ``prefetch:
after_optimizer`` (issued right after the previous optimizer step); the OverlapMonitor on every step.
Contenders alternate (A B C A B C).

Figures per rank: bytes of the embedding's weight + gradient + AdamW state held on this rank (read from the tensors
themselves after the last step), median step time, and on the sharded rows the median ``embed_gather_ms`` (gather
duration) and ``embed_gather_exposed_ms`` (time the forward waited). Target (benchmarks/README.md): memory / world size
(+-5 %); exposed gather <= 10 % of the gather time on GPU (this is CPU: reported, not judged).

    python benchmarks/embed_shard.py                 # 2 rounds x 40 steps, writes results/
    python benchmarks/embed_shard.py --rounds 1 --steps 10 --no-record
"""

from __future__ import annotations

import argparse
import json
import sys

from _common import ROOT, run_rounds, step_ms, write_record

CONTENDERS = ("replicated", "sharded", "sharded_after_optimizer")


def worker(contender: str, steps: int, vocab: int, out: str) -> None:
    sys.path.insert(0, ROOT)
    import lightning as L
    import torch

    from lightning_static_dist.examples.charlm import CharDataModule, CharGPT
    from lightning_static_dist import OverlapMonitor, RunSummary, StaticDistStrategy
    from lightning_static_dist.overlap.intervals import median_of

    L.seed_everything(1234)
    model = CharGPT(vocab_size=vocab, block_size=128, n_layer=4, n_head=4, n_embd=128, warmup_steps=10)
    data = CharDataModule(block_size=128, batch_size=16, max_bytes=2_000_000)
    prefetch = "after_optimizer" if contender == "sharded_after_optimizer" else "batch_start"
    strategy = StaticDistStrategy(embedding={"shard": contender != "replicated", "min_rows": 8192, "prefetch": prefetch})
    summary, monitor = RunSummary(warmup_steps=5), OverlapMonitor(every_n_steps=1)
    held: dict[str, int] = {}

    class Held(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
            if trainer.global_step != steps:
                return
            sharder = trainer.strategy._parts.embeddings.sharder  # (white-box: the shard's own bytes)
            weight = sharder.weights[0].shard if sharder is not None else pl_module.wte.weight
            state = trainer.optimizers[0].state[weight]
            held["weight"] = weight.numel() * weight.element_size()
            held["grad"] = weight.grad.numel() * weight.grad.element_size()
            held["optimizer"] = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim())

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[summary, monitor, Held()])
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        rows = monitor.history[2:]
        record = {
            "step_s": summary.step_seconds[5:],
            "held_bytes": held,
            "embed_gather_ms": median_of(r["static_dist/embed_gather_ms"] for r in rows),
            "embed_gather_exposed_ms": median_of(r["static_dist/embed_gather_exposed_ms"] for r in rows),
            "bytes_sent": median_of(r["static_dist/bytes_sent"] for r in rows),
        }
        with open(out, "w") as f:
            json.dump(record, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.vocab, args.out)
        return
    runs = run_rounds(__file__, CONTENDERS, args.rounds, "--steps", str(args.steps), "--vocab", str(args.vocab))
    rows = []
    for contender in CONTENDERS:
        recs = runs[contender]
        held = recs[-1]["held_bytes"]
        rows.append({
            "contender": contender,
            "embedding_bytes_per_rank": held,
            "embedding_total_bytes_per_rank": sum(held.values()),
            **step_ms(recs),
            "embed_gather_ms": [round(rec["embed_gather_ms"], 3) for rec in recs],
            "embed_gather_exposed_ms": [round(rec["embed_gather_exposed_ms"], 3) for rec in recs],
            "bucket_bytes_sent": recs[-1]["bytes_sent"],
        })
    rep, sha, after = rows
    summary = {
        "memory_ratio_sharded_vs_replicated": round(sha["embedding_total_bytes_per_rank"] / rep["embedding_total_bytes_per_rank"], 4),
        "memory_target": "1 / world size = 0.5 (+-5 %)",
        "exposed_vs_gather_batch_start": [round(e / g, 3) if g else None for e, g in zip(sha["embed_gather_exposed_ms"], sha["embed_gather_ms"])],
        "exposed_vs_gather_after_optimizer": [round(e / g, 3) if g else None for e, g in zip(after["embed_gather_exposed_ms"], after["embed_gather_ms"])],
        "step_time_ratio_sharded_vs_replicated": round(sha["step_ms_median"] / rep["step_ms_median"], 4),
        "step_time_ratio_after_optimizer_vs_replicated": round(after["step_ms_median"] / rep["step_ms_median"], 4),
    }
    for row in rows:
        print(row)
    print(summary)
    if args.no_record:
        return
    write_record("embed-shard", f"python benchmarks/embed_shard.py --rounds {args.rounds} --steps {args.steps}"
                 f" --vocab {args.vocab}", rows=rows, summary=summary)


if __name__ == "__main__":
    main()
