"""``python -m parallelkit.export CKPT OUT_DIR``: a checkpoint of any strategy and world size → a ``save_pretrained``
directory that ``transformers`` loads without parallelkit.

Every checkpoint of a model that can be exported (``model=hf``) carries its ``transformers`` config and the
tokenizer the data module used (``parallelkit.models.module.EXPORT_KEY``). The weights are read whole in this one
process, whatever wrote them: a single file (single, ddp, ...), a sharded ``torch.distributed.checkpoint``
directory (zero, tp, pp, hybrid4d: written by N ranks, read here by one), or a DeepSpeed checkpoint directory
(ZeRO partitions merged by DeepSpeed's own ``zero_to_fp32``). They are loaded into the model built from the
recorded config (every parameter must match: strict) and saved with ``save_pretrained`` (safetensors), with the
tokenizer beside them when one was used. ``OUT_DIR`` must be new or empty: nothing is overwritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from parallelkit.errors import ConfigError

EXIT_CONFIG_ERROR = 2


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(full state_dict, the checkpoint's other entries)`` of any parallelkit checkpoint."""
    from parallelkit.distributed.checkpoint_io import is_sharded_checkpoint, load_unsharded

    if not path.exists():
        raise ConfigError(f"{path} does not exist. Give a checkpoint: a file or a directory under outputs/RUN/checkpoints/.")
    deepspeed_tag = path / "checkpoint"
    if path.is_dir() and not is_sharded_checkpoint(path) and deepspeed_tag.is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        states = sorted(deepspeed_tag.glob("*model_states.pt"))
        if not states:
            raise ConfigError(f"{path} is an incomplete DeepSpeed checkpoint (no model states): its writer died. Use an earlier one.")
        client = torch.load(states[0], map_location="cpu", weights_only=False)
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag="checkpoint")), client
    try:
        checkpoint = load_unsharded(path)
    except Exception as err:  # noqa: BLE001 - any unreadable checkpoint is the same user problem
        raise ConfigError(f"{path} is not a readable parallelkit checkpoint ({type(err).__name__}: {err}).") from None
    state = checkpoint.pop("state_dict", None)
    if state is None:
        raise ConfigError(f"{path} holds no model weights (no state_dict): is it a parallelkit checkpoint?")
    return state, checkpoint


def export(checkpoint_path: str | Path, out_dir: str | Path) -> Path:
    """Write ``out_dir`` (config, safetensors weights, tokenizer if any) from ``checkpoint_path``; returns it."""
    from parallelkit.models.module import EXPORT_KEY

    path, out = Path(checkpoint_path), Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} already holds files; export writes into a new or empty directory (nothing is overwritten).")
    state, other = read_checkpoint(path)
    meta = other.get(EXPORT_KEY) or (other.get("client_state") or {}).get(EXPORT_KEY)
    if not meta or meta.get("format") != "transformers":
        raise ConfigError(f"{path} was not written by a model parallelkit can export: only model=hf checkpoints carry a transformers config.")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # its "Writing model shards" bar on stderr
    prefix = meta["state_dict_prefix"]
    weights = {k[len(prefix):]: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items() if k.startswith(prefix)}
    if meta.get("grouped_experts"):  # parallelkit's per-expert layout → transformers' fused experts
        from parallelkit.models.hf.moe import fuse_experts

        weights = fuse_experts(weights, meta["grouped_experts"], meta["num_experts"])
    config_dict = dict(meta["config"])
    config = transformers.AutoConfig.for_model(**config_dict)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    expected = set(model.state_dict())
    if _tied(model):  # the output layer is the embedding: one tensor, saved once
        _one_tied_weight(weights, model, path)
    missing, unexpected = sorted(expected - set(weights) - _tied_keys(model)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ConfigError(f"{path}: its weights do not match the recorded {config.model_type} config (missing {missing[:4]}, unexpected {unexpected[:4]}).")
    model.load_state_dict(weights, strict=False)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if meta.get("tokenizer"):
        transformers.AutoTokenizer.from_pretrained(meta["tokenizer"], local_files_only=True).save_pretrained(out)
    return out


def _tied(model: Any) -> bool:
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


def _one_tied_weight(weights: dict[str, torch.Tensor], model: Any, path: Path) -> None:
    """Keep the tied weight once, under the input embedding's name.

    A tied model's checkpoint holds it under both names: the embedding's (written by the first pipeline stage's
    ranks) and ``lm_head.weight`` (the last stage's); equal values when the stages' gradients were summed after
    every step. Copies that differ are an error rather than a silent choice of one.
    """
    embed = next(name for name, module in model.named_modules() if module is model.get_input_embeddings()) + ".weight"
    head = weights.pop("lm_head.weight", None)
    if head is None:
        return
    if embed not in weights:
        weights[embed] = head
    elif weights[embed].shape != head.shape or not torch.allclose(weights[embed], head, rtol=1e-5, atol=1e-6):
        diff = (weights[embed] - head).abs().max().item() if weights[embed].shape == head.shape else "shapes differ"
        raise ConfigError(
            f"{path}: the model ties its input and output embeddings, but the checkpoint's two copies of that weight "
            f"({embed} and lm_head.weight) differ (largest difference {diff}): the first and last pipeline stages' "
            "gradients were not summed (parallelkit.distributed.tied_weights). Export a checkpoint of a run that kept them equal."
        )


def _tied_keys(model: Any) -> set[str]:
    return {"lm_head.weight"} if _tied(model) else set()


def main(argv: list[str] | None = None) -> int:
    import os

    if not torch.cuda.is_available():  # DeepSpeed (imported by transformers, or for its checkpoints) would warn
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    parser = argparse.ArgumentParser(prog="python -m parallelkit.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint file or directory (e.g. outputs/RUN/checkpoints/last.ckpt)")
    parser.add_argument("out_dir", help="a new or empty directory for the save_pretrained files")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out_dir)
    except ConfigError as err:
        print(f"parallelkit: error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(f"parallelkit: exported {args.checkpoint} to {out} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
