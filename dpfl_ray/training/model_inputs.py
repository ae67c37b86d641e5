"""What a model asks of the data's inputs, checked without torch.

`dpfl run` checks it before Ray starts and builds the model itself (which needs torch, about a
second to import) while Ray starts (cli/run.py); :func:`dpfl_ray.training.models.build_model` makes the
same check.
"""
from __future__ import annotations

from ..errors import DPFLError


def check_model_input(model_cfg, input_shape: tuple[int, ...]) -> None:
    """Raise a DPFLError naming ``model.name`` if the model cannot take inputs of this shape."""
    if model_cfg.name == "cnn" and (len(input_shape) != 3 or min(input_shape[1:]) < 16):
        raise DPFLError(f"the cnn needs images of at least 16x16, this data has shape {tuple(input_shape)}; "
                        "use model.name: mlp or logistic", field="model.name")
