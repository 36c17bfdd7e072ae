"""The reference of the detectron2 export: facebookresearch/moco's converter, rewritten here step for step."""

from __future__ import annotations


def official_converter(state: dict) -> dict:
    """facebookresearch/moco detection/convert-pretrain-to-detectron2.py's renaming, step by step as it is written
    there (its input has ``module.encoder_q.`` prefixes; here they are stripped already): name -> numpy array."""
    out = {}
    for k, v in state.items():
        if "layer" not in k:
            k = "stem." + k
        for t in [1, 2, 3, 4]:
            k = k.replace("layer{}".format(t), "res{}".format(t + 1))
        for t in [1, 2, 3]:
            k = k.replace("bn{}".format(t), "conv{}.norm".format(t))
        k = k.replace("downsample.0", "shortcut")
        k = k.replace("downsample.1", "shortcut.norm")
        out[k] = v.numpy()
    return out
