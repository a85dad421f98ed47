"""GPU tests (NCCL). Skipped without CUDA; the 2-GPU test is skipped with fewer than 2 GPUs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader

import lightning as L
from lightning.pytorch.strategies import SingleDeviceStrategy
from _dist import reference_ddp
from _gpu_sync_check import count_syncs
from lightning_static_dist import StaticDistStrategy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class Adam16(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        # data drawn here, from its own generator: identical whichever process builds the dataloader
        self.data = torch.randn(256, 32, generator=torch.Generator().manual_seed(0))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)


class Adam16PerRank(Adam16):
    """Each rank trains on its own share of the data: a gradient averaged wrongly across ranks shows in the weights."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data[self.global_rank :: self.trainer.world_size], batch_size=8)


def _fit(strategy: Any, devices: int, precision: str, model_cls: type = Adam16, **kwargs: Any) -> dict[str, torch.Tensor]:
    L.seed_everything(3)
    model = model_cls()
    trainer = L.Trainer(
        accelerator="gpu", devices=devices, strategy=strategy, precision=precision, max_steps=12,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,  # Lightning's DistributedSampler reshuffles this loader; keep one order
        **kwargs,
    )
    trainer.fit(model)
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


#: how far the compiled step (on by default with CUDA) may land from eager single-device training after 12 steps:
#: inductor fuses the step's kernels, which rounds bf16 otherwise (measured on an H200: 1.7e-4 at most, 2 % of one
#: element); fp32 and fp16 with the AMP scaler agree to 1e-5
COMPILED_TOLERANCE = {"32-true": 1e-5, "16-mixed": 1e-5, "bf16-mixed": 2e-3}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_one_gpu_matches_single_device_training(precision: str, compiled: bool) -> None:
    # world size 1 over NCCL: the strategy's lifecycle (placement, precision plugins, clipping, the AMP scaler)
    # without the synchroniser, which has nothing to average on one rank; eager exactly, compiled (the default) within
    # the rounding its fused kernels change
    strategy = StaticDistStrategy(start_method="spawn", compile={"enabled": compiled})
    ours = _fit(strategy, 1, precision, gradient_clip_val=0.5)
    theirs = _fit(SingleDeviceStrategy(device=torch.device("cuda", 0)), 1, precision, gradient_clip_val=0.5)
    tolerance = COMPILED_TOLERANCE[precision] if compiled else 1e-5
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=tolerance, rtol=tolerance)


class SGDPerRank(Adam16PerRank):
    """Each rank on its own share of the data, plain SGD: the step is the averaged gradient itself, so a gradient
    summed instead of averaged (twice the step), or not all-reduced at all (rank 0's own), changes the weights. With
    one dataset for both ranks and Adam neither would: the ranks' gradients are equal, and Adam's step does not
    depend on the gradient's scale."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_two_gpus_match_ddp_over_nccl(precision: str) -> None:
    # 16-mixed: the AMP scaler's unscale and inf check on the averaged gradients, as under DDP
    ours = _fit(StaticDistStrategy(start_method="spawn"), 2, precision, SGDPerRank)
    theirs = _fit(reference_ddp(), 2, precision, SGDPerRank)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_reduce_scatter_matches_ddp_over_nccl() -> None:
    # a 1 x 2 mesh: gradients reduce-scattered over NCCL, each rank steps its half of Adam's state, the halves
    # all-gathered back; clipping at 0.05 clips every step, so the norm must be summed over the shard group
    sharded = StaticDistStrategy(start_method="spawn", mesh={"dp_shard": 2}, sync={"reduce": "reduce_scatter"})
    ours = _fit(sharded, 2, "bf16-mixed", Adam16PerRank, gradient_clip_val=0.05)
    theirs = _fit(reference_ddp(), 2, "bf16-mixed", Adam16PerRank, gradient_clip_val=0.05)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5)


class WideSGD(Adam16PerRank):
    """Two layers (32 -> 64 -> 2), batches of 4 and plain SGD: PowerSGD's error shows in the weights as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data[self.global_rank :: self.trainer.world_size], batch_size=4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_powersgd_phases_over_nccl_reach_ddp_at_full_rank() -> None:
    # PowerSGD's two phases (P, then Q) each on their own NCCL communicator; at rank 16, twice the averaged 64 x 32
    # gradient's rank (<= two ranks x batch 4), the approximation is exact up to round-off: the weights must be DDP's
    compression = {"name": "powersgd", "rank": 16, "min_numel": 1, "min_compression_rate": 1.0}
    ours = _fit(StaticDistStrategy(start_method="spawn", compression=compression, timeout_s=120), 2, "32-true", WideSGD)
    theirs = _fit(reference_ddp(), 2, "32-true", WideSGD)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5)


def test_synchronizer_buckets_cuda_gradients_in_place() -> None:
    # one rank: the average is the gradient itself, so pack -> flat buffer -> unpack must return it bit for bit,
    # through bf16 and fp32 buckets on the GPU, with hooks firing on autograd's device thread
    import torch.distributed as dist

    from _dist import free_port
    from lightning_static_dist.sync import BucketCapacity, GradientSynchronizer

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64).bfloat16()).cuda()
        sync = GradientSynchronizer(model.named_parameters(), capacity=BucketCapacity.from_mib(0.001, 0.01))
        sync.attach()
        x = torch.randn(16, 64, device="cuda")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model[1](model[0](x).bfloat16()).float().square().mean().backward()
            local = [p.grad.clone() for p in model.parameters()]
            sync.finish_if_pending()
            for before, p in zip(local, model.parameters()):
                assert torch.equal(before, p.grad)
        assert sync.stats.rounds == 2 and len(sync.plan.buckets) >= 2
    finally:
        dist.destroy_process_group()


def test_regional_inductor_compile_on_gpu_matches_eager() -> None:
    import copy

    from lightning_static_dist.examples.charlm import CharGPT
    from lightning_static_dist.compile import compile_regions
    from lightning_static_dist.compile.config import CompileConfig

    torch.manual_seed(0)
    eager = CharGPT(n_layer=3, n_embd=64, n_head=4, block_size=32, warmup_steps=0).cuda()
    compiled = copy.deepcopy(eager)
    report = compile_regions(compiled, CompileConfig(enabled=True, backend="inductor", regional=True))
    x = torch.randint(0, 256, (8, 33), device="cuda")
    for model in (eager, compiled):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model.loss(model(x[:, :-1]), x[:, 1:]).backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=2e-2, rtol=2e-2, msg=lambda m, name=name: f"{name}: {m}")
    assert len(report.graphs) == 1 and report.recompiles == [] and report.placement == []


# ------------------------------------------------------------------ the default compile, graph mode, bf16, syncs


def _fit_nested_gpu(strategy: Any, precision: str = "32-true", callbacks: Any = ()) -> dict[str, torch.Tensor]:
    from tests.compile.test_compile import nested_gpt

    L.seed_everything(0)
    model = nested_gpt()
    trainer = L.Trainer(
        accelerator="gpu", devices=2, strategy=strategy, precision=precision, max_steps=6, accumulate_grad_batches=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(model)
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode", ["hooks", "graph"])
def test_two_gpus_compiled_step_matches_ddp_over_nccl(mode: str) -> None:
    # inductor on CUDA: the default (the whole step cut at the buckets, AVG all-reduces, gradients as bucket views)
    # and graph mode (the collectives inside the compiled backward, bucketed and reordered by inductor); tied
    # weights, an unused branch, accumulation, blocks looped in a nested forward; SGD, fp32 (no TF32): 1e-4
    from tests.compile.test_compile import SMALL_BUCKETS

    ours = _fit_nested_gpu(StaticDistStrategy(start_method="spawn", compile={"enabled": True},
                                              sync={"mode": mode, **SMALL_BUCKETS}))
    theirs = _fit_nested_gpu(reference_ddp(find_unused_parameters=True))
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-4, rtol=1e-4, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_bf16_reduce_dtype_matches_ddps_bf16_hook_over_nccl() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ours = _fit(StaticDistStrategy(start_method="spawn", sync={"reduce_dtype": "bf16"}), 2, "32-true", Adam16PerRank)
    theirs = _fit(reference_ddp(ddp_comm_hook=default_hooks.bf16_compress_hook), 2, "32-true", Adam16PerRank)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5)


class Synchronising(BoringModel):
    """Three host waits in every step, one of each kind, at three points of the loop: a device synchronisation in
    the batch's transfer (before ``on_train_batch_start``), a value read (a stream synchronisation) in
    ``training_step``, an event's synchronisation in the hook after the optimizer step."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        torch.cuda.synchronize()
        return batch

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        output = super().training_step(batch, batch_idx)
        output["loss"].item()
        return output

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        event = torch.cuda.Event()
        event.record()
        event.synchronize()


def test_the_sync_check_sees_each_kind_of_host_wait_anywhere_in_the_step(tmp_path: Any) -> None:
    # the check below, on one GPU: each of the three waits once in its window, seen by the profiler; the value read
    # also by torch's sync debug mode, named by its caller (the event's wait is invisible to that mode)
    (report,) = count_syncs(str(tmp_path), SingleDeviceStrategy(device=torch.device("cuda", 0)), Synchronising(),
                            devices=1, precision="32-true")
    assert sorted(call.split(" ")[0] for call in report["runtime"]) == [
        "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaStreamSynchronize"], report
    assert any(caller.endswith(" training_step") for caller in report["warned"]), report


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode", ["hooks", "graph"])
def test_two_gpus_a_steady_step_makes_no_cuda_sync_on_any_rank(tmp_path: Any, mode: str) -> None:
    # one whole step (Lightning's loop, the strategy, the compiled step, the optimizer), every rank, every caller:
    # the host never waits for its GPU (tests/_gpu_sync_check.py; the test above shows what it sees)
    from tests.test_host_syncs import EveryParameterUsed

    strategy = StaticDistStrategy(start_method="spawn", compile={"enabled": True}, sync={"mode": mode})
    for rank, report in enumerate(count_syncs(str(tmp_path), strategy, EveryParameterUsed())):
        assert report == {"warned": [], "runtime": []}, (rank, report)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_the_sync_check_sees_lightning_ddps_per_step_sync(tmp_path: Any) -> None:
    # the control: Lightning's training epoch loop broadcasts rank 0's SIGTERM flag through the device before each
    # batch and reads it on the host (the wait the strategy removes): the same check must see it on every rank
    from tests.test_host_syncs import EveryParameterUsed

    for rank, report in enumerate(count_syncs(str(tmp_path), reference_ddp(), EveryParameterUsed())):
        assert any(call.startswith("cudaStreamSynchronize") for call in report["runtime"]), (rank, report)
        assert any(caller.endswith(" _broadcast_sigterm_tensor") for caller in report["warned"]), (rank, report)
