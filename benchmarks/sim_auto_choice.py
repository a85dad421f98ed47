"""What ``sync.schedule: auto`` chooses on GPT-2 small over an emulated link, and what choosing costs.

One Trainer fit, one GPU, a simulated world of ``--world`` over the link ``--link`` (as ``gpuN_gpt2s.py --link``)
from the first step: ``sync.schedule: auto`` with ``reduce_dtype: auto`` times its candidates (overlap x comm_sms
{default, 8, 4, 2} x fp32/bf16, after_backward x fp32/bf16) on the job's first steps and keeps the fastest. Prints
the choice, each candidate's time and the trial's cost, and with ``--record`` adds them to a ``gpuN_gpt2s.py
--simulate`` record (``summary.auto_choice``, ``summary.auto_trial_s``, and an ``auto`` section).

    python benchmarks/sim_auto_choice.py --link nv=70,5,16,308,65 --record benchmarks/results/sim-gpt2s-sm-<date>.json

Simulated on one GPU: not a multi-GPU figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the package, from a checkout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--trial-steps", type=int, default=4, help="sync.schedule_trial_steps (the first untimed)")
    parser.add_argument("--after", type=int, default=5, help="steps after the trial")
    parser.add_argument("--record")
    args = parser.parse_args()

    import lightning as L
    import torch

    from _gpt2s import FULL, loader, new_nanogpt
    from _simulated import parse_link
    from lightning_static_dist import StaticDistStrategy

    link = parse_link(args.link)
    sync = {"schedule": "auto", "reduce_dtype": "auto", "schedule_trial_steps": args.trial_steps}
    strategy = StaticDistStrategy(compile={"enabled": True, "backend": "inductor"}, sync=sync,
                                  simulate={"world_size": args.world, "link": link.spec})
    from lightning_static_dist.participants.gradients import WARM_STEPS

    steps = WARM_STEPS + 10 * args.trial_steps + args.after  # (on a GPU the trial starts after the warm steps)
    torch.set_float32_matmul_precision("high")
    seen: dict[str, object] = {}

    class KeepChoice(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen["choice"] = trainer.strategy.offer.schedule_choice()  # (the trial is dropped at teardown)

    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        use_distributed_sampler=False, callbacks=[KeepChoice()])
    trainer.fit(new_nanogpt(FULL), train_dataloaders=loader(FULL, steps, torch.device("cuda"), seed=1234))
    choice: Any = seen.get("choice")
    assert choice is not None, "sync.schedule auto did not decide"
    result = {"link": link.describe(), "world_size": args.world, "choice": choice.choice,
              "trial_steps": choice.trial_steps, "trial_s": round(choice.trial_s or 0.0, 2),
              "step_ms": {name: round(1e3 * s, 2) for name, s in sorted(choice.step_s.items(), key=lambda kv: kv[1])},
              "command": "python benchmarks/sim_auto_choice.py " + " ".join(sys.argv[1:])}
    print(json.dumps(result, indent=1))
    if args.record:
        path = Path(args.record)
        record = json.loads(path.read_text())
        record["auto"] = result
        record["summary"].update(auto_choice=result["choice"], auto_trial_s=result["trial_s"])
        path.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
