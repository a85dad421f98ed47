"""What a run is asked to do, and what it was resolved to, below the processes that run it and above every feature
whose section it holds:

    strategy_config   ``StrategyConfig``: the ``strategy`` block, each section defined beside its feature
    step_plan         ``StepPlan``: the block resolved once for the world that started (``resolve_plan``)
    features          each feature's plan in it: ``SyncPlan``, ``CompilePlan``, ``EmbeddingPlan`` ...
    world             ``DataParallelWorld``: the default process group started, and the mesh and the step plan
                      built for it, for both front ends

This ``__init__`` imports nothing, so reaching ``strategy_config`` loads neither the plan nor the world.

Example::

    from lightning_static_dist.plan.strategy_config import StrategyConfig

    config = StrategyConfig.from_dict({"sync": {"bucket_mb": 25}})
"""
