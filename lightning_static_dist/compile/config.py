"""``strategy.compile``: the options of static compilation, beside the code they steer.

Example::

    CompileConfig(enabled=True, backend="aot_eager")     # enabled: auto (the default) compiles on CUDA only
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Protocol, Union

from lightning_static_dist.config.check import check_fields, fail

INDUCTOR_BACKENDS = ("inductor", "inductor_distributed")
"""The backends whose graphs inductor compiles (and can replay as CUDA graphs)."""
MODE_CUDAGRAPHS = {"reduce-overhead": True, "max-autotune": True, "max-autotune-no-cudagraphs": False}
"""The inductor modes that decide CUDA graphs themselves (``default`` leaves it to ``cudagraphs``)."""


@dataclass
class CompileConfig:
    """``strategy.compile``: static compilation of the LightningModule inside the strategy.

    A model passed as ``torch.compile(model)`` is compiled this way too, with its backend (docs/how-it-works.md:
    Compilation).

    Example::

        StaticDistStrategy(compile={"enabled": True, "backend": "inductor", "regional": "auto"})
    """

    KEY = "strategy.compile"

    enabled: Union[bool, Literal["auto"]] = "auto"
    """Compile the LightningModule inside the strategy. ``auto``: on with CUDA, off on CPU (where compiling takes
    longer than it saves on a small model); a line at fit start says that the step is compiled and how to turn it
    off, and the compile report how long compiling took."""
    backend: str = "inductor"
    """Any registered dynamo backend: ``inductor``, ``aot_eager`` (debugging), ``inductor_distributed`` ..."""
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """The inductor mode (only with ``backend: inductor``)."""
    fullgraph: bool = False
    """Fail on any graph break, naming its location, instead of splitting the graph."""
    dynamic: Union[bool, Literal["auto"]] = "auto"
    """``auto``: each graph is compiled for the shapes it first sees; a dimension that takes a second size becomes
    dynamic (one recompile: dynamo's automatic dynamic shapes), and a short last batch gets one static graph of
    its own; ``false``: static shapes only, one graph per shape, up to dynamo's recompile limit (then the step runs
    eagerly, with a warning); ``true``: every dimension dynamic from the first graph. No batch is ever dropped."""
    regional: Union[bool, Literal["auto"]] = "auto"
    """``auto``: the LightningModule's whole ``training_step`` — forward and loss — as one graph, cut at the gradient
    buckets at world size > 1 (with ``sync.mode: graph``: uncut, the collectives inside it); ``true``: each block
    of the model's largest ``nn.ModuleList``/``nn.Sequential`` of repeated blocks compiled on its own (an error when
    there is none); ``false``: the whole ``training_step``, never cut (every gradient then becomes ready at the end
    of backward)."""
    around_blocks: bool = False
    """With ``regional: true``: compile ``training_step`` around the blocks too, each block call a boundary of
    that graph, so the blocks keep their own graphs and gradients still become ready block by block. What gets
    compiled is the code of ``training_step`` around the call that runs the blocks — typically the loss (a language
    model's cross-entropy over its vocabulary is a large share of the step); a ``forward`` that runs the blocks in a
    loop stays eager around them. Opt-in: ``training_step`` code then runs under dynamo — a branch on ``batch_idx``
    recompiles, many ``self.log`` calls can reach dynamo's recompile limit (those frames then run eagerly); the
    compile report shows both. Not applied with manual optimization. Never ``fullgraph``."""
    fallback: Literal["eager", "error"] = "eager"
    """A region that fails to compile: run it eagerly (logged once, counted) or raise."""
    optimizer: bool = False
    """Also compile ``optimizer.step()``."""
    cudagraphs: Union[bool, Literal["auto"]] = "auto"
    """Replay the compiled graphs as CUDA graphs (inductor's CUDA graph trees; why: docs/how-it-works.md,
    "Compilation"). ``auto``: on where it is safe to assume, on CUDA with ``backend: inductor`` and
    ``sync.mode: hooks``, without sharded embeddings or ``reduce_scatter`` (whose
    gathers move parameters between steps), unless ``mode`` decides; the compile report says what was chosen and
    why, and names every graph inductor left without CUDA graphs. Tensors a CUDA-graphed step returns live in
    the graphs' memory pool until the next step (Lightning's loop and ``self.log`` copy what they keep); a tensor
    kept across steps must be cloned, or the next step's replay overwrites it and reading it raises."""

    @property
    def torch_dynamic(self) -> Optional[bool]:
        """``dynamic`` as ``torch.compile`` takes it (``None``: automatic dynamic shapes)."""
        return None if self.dynamic == "auto" else bool(self.dynamic)

    def __post_init__(self) -> None:
        check_fields(self)
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if self.backend not in backends:
            fail(f"{self.KEY}.backend", self.backend, f"not a registered dynamo backend; allowed: {', '.join(sorted(backends))}")
        if self.mode != "default" and self.backend != "inductor":
            fail(f"{self.KEY}.mode", self.mode, f"a mode needs backend 'inductor' (backend is {self.backend!r}); allowed with it: 'default'")
        if self.cudagraphs is True and self.backend not in INDUCTOR_BACKENDS:
            fail(f"{self.KEY}.cudagraphs", self.cudagraphs,
                 f"CUDA graphs come from inductor (backend is {self.backend!r}); allowed with it: auto, false")
        decided = MODE_CUDAGRAPHS.get(self.mode)
        if decided is not None and self.cudagraphs not in ("auto", decided):
            fail(f"{self.KEY}.cudagraphs", self.cudagraphs, f"mode {self.mode!r} turns CUDA graphs"
                 f" {'on' if decided else 'off'} itself; allowed with it: auto, {str(decided).lower()}")
        if self.around_blocks and self.regional is not True:
            fail(f"{self.KEY}.around_blocks", self.around_blocks,
                  f"compiles around blocks compiled one by one, which needs {self.KEY}.regional=true"
                  f" (it is {self.regional!r}); allowed otherwise: false")


class CompileOptions(Protocol):
    """What compilation reads of its options: a :class:`CompileConfig` as written, or the step plan's ``CompilePlan``
    (``plan/features.py``: the same options decided for the world that started)."""

    @property
    def backend(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def fullgraph(self) -> bool: ...
    @property
    def dynamic(self) -> Union[bool, Literal["auto"]]: ...
    @property
    def torch_dynamic(self) -> Optional[bool]: ...
    @property
    def regional(self) -> Union[bool, Literal["auto"]]: ...
    @property
    def around_blocks(self) -> bool: ...
    @property
    def fallback(self) -> str: ...
    @property
    def cudagraphs(self) -> Union[bool, Literal["auto"]]: ...
