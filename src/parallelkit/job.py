"""One job around :func:`parallelkit.run.train`: ``mode=predict``, the note a collective timeout gets, and the
teardown a sweep's next job needs (lightning-hydra-template's ``task_wrapper``).

The launcher calls :func:`run` with its hooks (:func:`parallelkit.launch.cli.launch_hooks`); what an error
becomes (one paragraph and an exit code) stays the launcher's (:mod:`parallelkit.launch.cli`).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from parallelkit.run import LaunchHooks, assemble, train


def run(cfg: DictConfig, hooks: LaunchHooks = LaunchHooks()) -> dict[str, Any] | None:
    """Train (or predict) as ``cfg`` says; return the summary on rank 0 (``None`` elsewhere)."""
    finished = False
    try:
        if cfg.get("mode", "train") == "predict":
            result = predict(cfg, hooks)
        else:
            result, _ = train(cfg, hooks)
        finished = True
        return result
    except RuntimeError as err:
        from parallelkit.distributed.stuck_ranks import describe, is_timeout, stuck_ranks

        if is_timeout(err) and (stuck := describe(stuck_ranks())):
            err.add_note(stuck)  # cli's message names them; the store is gone after the teardown below
        raise
    finally:
        hooks.end_startup()  # a run that failed while building (a sweep's next job must not start without it)
        # After a failure the other ranks may never reach a barrier: tear down without one.
        teardown_process_group(barrier=finished)


def predict(cfg: DictConfig, hooks: LaunchHooks = LaunchHooks()) -> dict[str, Any] | None:
    """``mode=predict``: load a checkpoint of any strategy and world size, score and generate (:mod:`parallelkit.tools.predict`)."""
    import lightning.pytorch as pl

    from parallelkit.tools.predict import check_predict_config, load_weights
    from parallelkit.tools.predict import predict as score_and_generate

    built = assemble(cfg, hooks)
    check_predict_config(cfg)
    load_weights(built.module, cfg.ckpt_path)  # full tensors into the single-device model; the strategy splits them
    trainer_cfg = {k: v for k, v in built.trainer_cfg.items() if k in ("limit_val_batches", "precision")}
    trainer = pl.Trainer(
        strategy=built.strategy.lightning_strategy, accelerator=built.accelerator, devices=built.devices, num_nodes=built.num_nodes,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=built.out,
        use_distributed_sampler=False, **trainer_cfg,
    )
    return score_and_generate(cfg, trainer, built.module, built.datamodule, built.out, start_work=hooks.start_work)


def teardown_process_group(barrier: bool) -> None:
    """Leave no process group behind: a sweep runs its next job in this process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            if barrier:
                dist.barrier()
        finally:
            dist.destroy_process_group()
    from parallelkit.distributed.listeners import release_stores

    release_stores()  # the store server this rank hosted for the group (listeners.host_store) stops with it
