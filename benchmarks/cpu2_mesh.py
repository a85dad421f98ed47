"""Benchmark ``cpu2-mesh``: all_reduce vs reduce_scatter on 2 CPU ranks, the main job's char-level GPT.

Workload: ``lightning_static_dist.examples.charlm.CharGPT`` as in ``configs/charlm_cpu.yaml`` (4 layers, d=128, block 128, vocab 256,
842K parameters), 16 x 128 tokens per rank, AdamW (two param groups), gradient clipping 1.0, fp32, Gloo. Contenders
alternate (A B A B): ``static_dist`` with ``sync.reduce: all_reduce`` (1-D, 2 x 1 mesh) and with ``reduce_scatter``
on a 1 x 2 mesh (each rank steps half of every bucket; the halves are all-gathered after the step, waited in the
blocks' forward pre-hooks).

Figures per rank, read from the tensors after the last step: bytes of the parameters (for reduce_scatter: the
bucket buffers the parameters are views of, padding included, plus this rank's chunk copies), of the gradients
the optimizer reads (``param.grad`` / the chunk pieces' ``.grad``), of the synchroniser's bucket buffers (the
reduction's input, alive between steps in both modes), and of the optimizer state; and the median step time.

    python benchmarks/cpu2_mesh.py                   # 2 rounds x 40 steps, writes results/
    python benchmarks/cpu2_mesh.py --rounds 1 --steps 10 --no-record
"""

from __future__ import annotations

import argparse
import json
import sys

from _common import ROOT, run_rounds, step_ms, write_record

CONTENDERS = ("all_reduce", "reduce_scatter")


def nbytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[attr-defined]


def worker(contender: str, steps: int, out: str) -> None:
    sys.path.insert(0, ROOT)
    import lightning as L
    import torch

    from lightning_static_dist.examples.charlm import CharDataModule, CharGPT
    from lightning_static_dist import RunSummary, StaticDistStrategy

    L.seed_everything(1234)
    model = CharGPT(block_size=128, n_layer=4, n_head=4, n_embd=128, dropout=0.0, lr=3e-3, weight_decay=0.1,
                    warmup_steps=10)
    data = CharDataModule(block_size=128, batch_size=16, max_bytes=2_000_000)
    mesh = {"dp_replicate": 2, "dp_shard": 1} if contender == "all_reduce" else {"dp_replicate": 1, "dp_shard": 2}
    strategy = StaticDistStrategy(mesh=mesh, sync={"reduce": contender})
    summary = RunSummary(warmup_steps=5)
    held: dict[str, int] = {}

    class Held(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
            if trainer.global_step != steps:
                return
            gradients = trainer.strategy._parts.gradients  # (white-box: the bytes the synchronisers hold)
            sync, sharded = gradients.synchronizer, gradients.sharded_sync
            optimizer = trainer.optimizers[0]
            if sharded is not None:
                held["params"] = nbytes(s.full for s in sharded.shards) + (
                    nbytes(s.chunk for s in sharded.shards) if sharded.shard_size > 1 else 0)
                held["grads"] = nbytes(p.grad for p in (piece.param for piece in sharded.pieces()) if p.grad is not None)
            else:
                held["params"] = nbytes(pl_module.parameters())
                held["grads"] = nbytes(p.grad for p in pl_module.parameters() if p.grad is not None)
            held["bucket_buffers"] = nbytes(b.flat for b in sync.buffers)
            held["optimizer_state"] = nbytes(v for s in optimizer.state.values() for v in s.values()
                                             if torch.is_tensor(v) and v.dim() > 0)

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, gradient_clip_val=1.0, callbacks=[summary, Held()])
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        with open(out, "w") as f:
            json.dump({"step_s": summary.step_seconds[5:], "held_bytes": held,
                       "final_loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    runs = run_rounds(__file__, CONTENDERS, args.rounds, "--steps", str(args.steps))
    rows = []
    for contender in CONTENDERS:
        recs = runs[contender]
        held = recs[-1]["held_bytes"]
        rows.append({
            "contender": contender,
            "bytes_per_rank": held,
            "params_grads_state_bytes": held["params"] + held["grads"] + held["optimizer_state"],
            "total_bytes_per_rank": sum(held.values()),
            **step_ms(recs),
            "final_loss": [round(rec["final_loss"], 4) for rec in recs],
        })
    ar, rs = rows
    summary = {
        "optimizer_state_ratio": round(rs["bytes_per_rank"]["optimizer_state"] / ar["bytes_per_rank"]["optimizer_state"], 4),
        "params_grads_state_ratio": round(rs["params_grads_state_bytes"] / ar["params_grads_state_bytes"], 4),
        "total_ratio": round(rs["total_bytes_per_rank"] / ar["total_bytes_per_rank"], 4),
        "step_time_ratio": round(rs["step_ms_median"] / ar["step_ms_median"], 4),
    }
    for row in rows:
        print(row)
    print(summary)
    if args.no_record:
        return
    write_record("cpu2-mesh", f"python benchmarks/cpu2_mesh.py --rounds {args.rounds} --steps {args.steps}",
                 rows=rows, summary=summary)


if __name__ == "__main__":
    main()
