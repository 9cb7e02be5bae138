"""strata.torch.GradScaler: dynamic loss scaling for fp16 training with the
strata.torch optimizers (Micikevicius et al., "Mixed Precision Training", ICLR
2018), with torch.cuda.amp.GradScaler's interface, defaults and growth/backoff
rule. The gradients never exist unscaled in torch: the scale is handed to
Strata's step, which divides by it, checks every gradient for inf/nan and skips
the whole step on an overflow (nothing changes); update() then backs the scale
off, as torch's scaler does when its found_inf is set."""

import math

import torch

from strata._offload import OffloadOptimizer

__all__ = ["GradScaler"]


def _f32(x):
    """x rounded to float32, as torch keeps its scale."""
    return float(torch.tensor(float(x), dtype=torch.float32))


class GradScaler:
    """torch.cuda.amp.GradScaler for strata.torch optimizers.

        scaler = strata.torch.GradScaler()
        scaler.scale(loss).backward()
        scaler.step(opt)      # opt.step(loss_scale=scale); skipped on inf/nan
        scaler.update()

    Arguments and defaults as torch's (init_scale=2**16, growth_factor=2,
    backoff_factor=0.5, growth_interval=2000, enabled=True); the scale halves after
    each skipped step and doubles after growth_interval steps in a row without one.
    Extras (for DeepSpeed's fp16 section): dynamic=False keeps the scale fixed (a
    static loss scale; an overflow still skips the step), min_scale is a floor
    for backoff, and hysteresis=n backs off only at the n-th overflow (each
    overflow before it only skips the step), as DeepSpeed's DynamicLossScaler
    (delayed_shift); the count restarts when the scale grows, or after every
    clean step with consecutive_hysteresis=True.

    unscale_() is not available: the gradients are in Strata, not in torch; clip
    with the optimizer's max_grad_norm (applied by Strata after unscaling, to the
    unscaled gradient, exactly as unscale_ + clip_grad_norm_ would). step() of a
    non-strata optimizer is a TypeError (use torch.cuda.amp.GradScaler for those).
    """

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True, *, dynamic=True, min_scale=None,
                 hysteresis=1, consecutive_hysteresis=False):
        if enabled:
            if not (math.isfinite(init_scale) and init_scale > 0):
                raise ValueError(f"init_scale must be finite and > 0, got {init_scale}")
            if dynamic:
                if not growth_factor > 1.0:
                    raise ValueError("The growth factor must be > 1.0.")
                if not backoff_factor < 1.0:
                    raise ValueError("The backoff factor must be < 1.0.")
                if not (isinstance(hysteresis, int) and hysteresis >= 1):
                    raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
                if not (isinstance(growth_interval, int) and growth_interval > 0):
                    raise ValueError(f"growth_interval must be an int > 0, got "
                                     f"{growth_interval!r}")
        self._enabled = bool(enabled)
        self._scale = _f32(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self._dynamic = bool(dynamic)
        self._min_scale = None if min_scale is None else _f32(min_scale)
        self._hysteresis = int(hysteresis)
        self._hysteresis_left = int(hysteresis)  # overflows until the next backoff
        self._consecutive_hysteresis = bool(consecutive_hysteresis)
        self._found_inf = {}  # id(optimizer) -> skipped, since the last update()

    def scale(self, outputs):
        """outputs (a tensor, or nested lists/tuples of tensors) times the scale.
        As torch: a 0-dim float32 scale, so an fp16 scalar loss becomes float32."""
        if not self._enabled:
            return outputs

        def apply(value):
            if isinstance(value, torch.Tensor):
                return value * torch.tensor(self._scale, dtype=torch.float32,
                                            device=value.device)
            if isinstance(value, (list, tuple)):
                return type(value)(apply(v) for v in value)
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def unscale_(self, optimizer):
        raise RuntimeError(
            "strata.torch.GradScaler.unscale_: the gradients live in Strata, not in torch, so "
            "torch.nn.utils.clip_grad_norm_ cannot see them; set max_grad_norm on the optimizer "
            "instead (Strata clips the unscaled gradient by its global norm)")

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step(*args, loss_scale=scale, **kwargs); returns its result, or
        None when an inf/nan gradient skipped the step."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or args:
            raise RuntimeError("Closure use is not currently supported if GradScaler is "
                               "enabled.")
        if not isinstance(optimizer, OffloadOptimizer):
            raise TypeError(f"strata.torch.GradScaler steps strata.torch optimizers, got "
                            f"{type(optimizer).__name__}; use torch.cuda.amp.GradScaler for "
                            "torch's own")
        if id(optimizer) in self._found_inf:
            raise RuntimeError("step() has already been called since the last update().")
        result = optimizer.step(loss_scale=self._scale, **kwargs)
        self._found_inf[id(optimizer)] = optimizer.skipped
        return None if optimizer.skipped else result

    def update(self, new_scale=None):
        """Adjusts the scale after this iteration's step() calls (torch's rule), or
        sets it to new_scale (a float or a 1-element tensor)."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = _f32(new_scale.item() if torch.is_tensor(new_scale) else new_scale)
        else:
            if not self._found_inf:
                raise RuntimeError("No inf checks were recorded prior to update.")
            if self._dynamic:
                if any(self._found_inf.values()):
                    if self._hysteresis_left <= 1:
                        scale = self._scale * self._backoff_factor
                        if self._min_scale is not None:
                            scale = max(scale, self._min_scale)
                        self._scale = _f32(scale)
                    else:
                        self._hysteresis_left -= 1
                    self._growth_tracker = 0
                else:
                    if self._consecutive_hysteresis:
                        self._hysteresis_left = self._hysteresis
                    successful = self._growth_tracker + 1
                    if successful == self._growth_interval:
                        grown = _f32(self._scale * self._growth_factor)
                        if math.isfinite(grown):
                            self._scale = grown
                        self._growth_tracker = 0
                        self._hysteresis_left = self._hysteresis
                    else:
                        self._growth_tracker = successful
        self._found_inf = {}

    def get_scale(self):
        return self._scale if self._enabled else 1.0

    def is_enabled(self):
        return self._enabled

    def get_growth_factor(self):
        return self._growth_factor

    def set_growth_factor(self, new_factor):
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self):
        return self._backoff_factor

    def set_backoff_factor(self, new_factor):
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self):
        return self._growth_interval

    def set_growth_interval(self, new_interval):
        self._growth_interval = int(new_interval)

    def state_dict(self):
        """torch.cuda.amp.GradScaler's state_dict ({} when disabled)."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict):
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        self._scale = _f32(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
