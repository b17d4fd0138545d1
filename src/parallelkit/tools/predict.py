"""Distributed inference: ``python train.py mode=predict ckpt_path=CKPT [strategy=...] trainer.devices=M``.

A checkpoint written by any strategy at N ranks (a single file or a sharded directory, always in the
per-parameter layout) is loaded into the single-device model in every process — full tensors, so the layout
it was trained with does not matter — and the strategy chosen now (any, at any M) then parallelizes it as
for training. The validation set is scored on all M ranks (each its data-parallel shard, the mean reduced
over ranks), and rank 0 generates text from a prompt with the unsharded model (``predict.samples`` greedy or
sampled characters; ``model=gpt``/``moe_gpt`` with ``data=chars``). With ``data=raster`` every rank predicts
its tiles of the image and ``predictions.npy`` is reassembled from them. Results go to ``predict.json``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from parallelkit.distributed.checkpoint_io import check_compatible, load_unsharded
from parallelkit.errors import ConfigError
from parallelkit.models.plans import parallel_model


def load_weights(module: torch.nn.Module, path: str | Path) -> None:
    """Copy the checkpoint's parameters into ``module`` (a TrainModule), whatever strategy wrote them."""
    check_compatible(path, {k: v.shape for k, v in module.state_dict().items()})
    state = load_unsharded(path)["state_dict"]
    module.load_state_dict({k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()})


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: list[int], new_tokens: int, block_size: int, temperature: float, seed: int) -> list[int]:
    """Autoregressive sampling (greedy when ``temperature`` is 0) with the single-device model."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    model.eval()
    for _ in range(new_tokens):
        logits = model(ids[:, -block_size:])[:, -1, :].float()
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0].tolist()


def predict(cfg: DictConfig, trainer: Any, module: Any, datamodule: Any, out: Path,
            start_work: Callable[[], None] = lambda: None) -> dict[str, Any] | None:
    """Score the validation set on every rank, generate on rank 0, write ``predict.json`` (rank 0).
    ``start_work``: the launcher's, once the model is copied (:meth:`parallelkit.run.LaunchHooks.start_work`)."""
    options = cfg.get("predict") or {}
    # Generation runs on rank 0 with an unsharded copy taken now: after validate the strategy may have split
    # the module across ranks (and reading the checkpoint again would be a collective rank 0 runs alone).
    generator_model = copy.deepcopy(parallel_model(module)) if options.get("samples", 0) and hasattr(datamodule, "decode") else None
    # A tiled image (data=raster): every rank predicts its own tiles with an unsharded copy, and the cores are
    # written into one predictions.npy (parallelkit.data.raster) — reassembly without gathering the image.
    tiled = copy.deepcopy(parallel_model(module)) if hasattr(datamodule, "write_predictions") else None
    start_work()
    results = trainer.validate(module, datamodule=datamodule, verbose=False)
    tiles = datamodule.write_predictions(tiled, trainer.strategy, out) if tiled is not None else None
    if not trainer.is_global_zero:
        return None
    summary: dict[str, Any] = {
        "checkpoint": str(cfg.ckpt_path),
        "strategy": getattr(trainer.strategy, "strategy_name", type(trainer.strategy).__name__),
        "world_size": trainer.world_size,
        "val_loss": float(results[0]["val_loss"]) if results and "val_loss" in results[0] else None,
        "samples": [],
    }
    if tiles is not None:
        summary["tiles"] = tiles
    if generator_model is not None:
        model = generator_model
        prompt = encode_prompt(datamodule, options.get("prompt", "\n"))
        for k in range(int(options["samples"])):
            ids = generate(
                model,
                prompt,
                int(options.get("new_tokens", 200)),
                datamodule.model_kwargs()["block_size"],
                float(options.get("temperature", 0.8)),
                cfg.seed + k,
            )
            summary["samples"].append(datamodule.decode(ids))
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "predict.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "predict.json")
    scored = "no validation batch" if summary["val_loss"] is None else f"val_loss {summary['val_loss']:.4f}"
    print(f"parallelkit: {scored} on {summary['world_size']} process(es) with strategy={summary['strategy']}")
    if tiles is not None:
        print(f"parallelkit: {tiles['tiles']} tiles reassembled into {tiles['predictions']}")
    for sample in summary["samples"]:
        print("---\n" + sample)
    return summary


def encode_prompt(datamodule: Any, prompt: str) -> list[int]:
    """The prompt in the data's tokens: its ``encode`` (a tokenizer), else its characters (``data=chars``)."""
    encode = getattr(datamodule, "encode", None)
    if callable(encode):
        return list(encode(prompt))
    stoi = {ch: i for i, ch in enumerate(getattr(datamodule, "chars", []))}
    return [stoi.get(ch, 0) for ch in prompt]


def check_predict_config(cfg: DictConfig) -> None:
    if cfg.get("ckpt_path") in (None, "last"):
        raise ConfigError("mode=predict needs ckpt_path=PATH: the checkpoint (file or directory) to load, e.g. ckpt_path=outputs/RUN/checkpoints/last.ckpt.")
