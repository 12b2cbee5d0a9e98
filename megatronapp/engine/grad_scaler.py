"""Loss scaling for fp16 training, with Megatron's classes, defaults and update rule.

The loss is multiplied by `scale` before backward; the optimizer divides the main grads by
it again and, when any of them is inf/nan, skips the step and calls `update(True)`.

Dynamic rule (Megatron's DynamicGradScaler): an overflow resets the growth count and uses
up one unit of hysteresis; once hysteresis is used up, the scale is multiplied by
`backoff_factor` (not below `min_scale`). After `growth_interval` clean steps in a row the
scale is multiplied by `growth_factor` and hysteresis is refilled.
"""

from __future__ import annotations

import torch


class ConstantGradScaler:
    """A fixed scale (--loss-scale); overflowing steps are still skipped."""

    dynamic = False

    def __init__(self, scale: float, device):
        self._scale = torch.tensor([float(scale)], dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": float(self._scale)}

    def load_state_dict(self, state: dict) -> None:
        pass  # a static scale comes from the configuration, not the checkpoint


class DynamicGradScaler(ConstantGradScaler):
    dynamic = True

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        device,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ):
        super().__init__(initial_scale, device)
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32, device=device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": float(self._scale),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        self._scale = torch.tensor([float(state["scale"])], dtype=torch.float32, device=self._scale.device)
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


def build_grad_scaler(cfg, device) -> ConstantGradScaler | None:
    """Megatron's choice: --loss-scale gives a static scaler (fp16 or bf16), fp16 alone a
    dynamic one, anything else none."""
    if cfg.loss_scale is not None and (cfg.fp16 or cfg.bf16):
        return ConstantGradScaler(cfg.loss_scale, device)
    if cfg.fp16:
        return DynamicGradScaler(
            cfg.initial_loss_scale,
            cfg.min_loss_scale,
            device,
            growth_interval=cfg.loss_scale_window,
            hysteresis=cfg.hysteresis,
        )
    return None
