"""Keeps the run's configuration inside every checkpoint, so export and sampling can rebuild the model
from a checkpoint file alone."""

from __future__ import annotations

import dataclasses
from typing import Any

from composer.core import Callback


class RunConfig(Callback):
    def __init__(self, cfg):
        self.config = dataclasses.asdict(cfg)

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # the current run's configuration stays authoritative (a resumed run may override keys)
