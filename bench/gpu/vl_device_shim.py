"""`python -m bench.gpu.vl_device_shim <train overrides>`: `qwen35rl.cli.train` with one stop-gap for the Megatron
engine on image data on a GPU, so that the rest of the path can be measured until the engine has the fix.

Found on an H200 on 2026-12-01 (bench/results/megatron_h200.md, "Megatron VL"): the worker builds each batch with
its token tensors on the GPU (`runtime.batching.build_batch`) and `Batch.multimodal` (pixel_values, image_grid_thw)
on the host; `MegatronTrainEngine._add_images` passes both to `RowImages.of` (qwen35rl/engines/megatron/vision.py),
whose `torch.searchsorted` then fails with "Expected all tensors to be on the same device". The stop-gap moves the
vision inputs onto the image mask's device first (what the FSDP engine does with them in `_forward`); once the engine
does it itself this is a no-op. It changes nothing else: the CLI, the worker (`trainer.launcher=local`: in this
process) and the engine run as they are."""
import runpy

import torch

from qwen35rl.engines.megatron import vision

_of = vision.RowImages.of.__func__


def _of_on_mask_device(cls, multimodal, image_mask, merge):
    if multimodal:
        multimodal = {k: v.to(image_mask.device) if torch.is_tensor(v) else v for k, v in multimodal.items()}
    return _of(cls, multimodal, image_mask, merge)


vision.RowImages.of = classmethod(_of_on_mask_device)

if __name__ == "__main__":
    runpy.run_module("qwen35rl.cli.train", run_name="__main__", alter_sys=True)
