"""strata.torch: ZeRO-Offload for any PyTorch model, over libstrata's offload
optimizer (the strata_offload C API). The master weights and the optimizer
state live in Strata, in host memory or on NVMe; gradients stream into it from
autograd hooks during backward; the update runs on Strata's threads behind
step() and overlaps the next forward.

    import strata.torch
    opt = strata.torch.OffloadAdamW(model, lr=3e-4, offload="nvme",
                                    nvme_path="/mnt/nvme0/strata")
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

OffloadAdamW, OffloadAdam, OffloadSGD, OffloadAdagrad, OffloadLion (torch.optim
optimizers, state_dict in their torch twin's format), OffloadAdamW8bit and
OffloadAdafactor (8-bit and factored state, state_dict in the format of
strata.optim.AdamW8bit / Adafactor), GradScaler (fp16 loss
scaling, torch.cuda.amp.GradScaler's interface) and from_deepspeed_config (the
DeepSpeed zero_optimization.offload_optimizer keys). The implementation lives in
strata._offload, strata._scaler and strata._deepspeed, which import the real
torch (absolute imports: this module's name does not shadow it).
"""

from strata._deepspeed import from_deepspeed_config
from strata._offload import (
    DEFAULT_BUCKET_SIZE,
    OffloadAdafactor,
    OffloadAdagrad,
    OffloadAdam,
    OffloadAdamW,
    OffloadAdamW8bit,
    OffloadLion,
    OffloadOptimizer,
    OffloadSGD,
)
from strata._scaler import GradScaler

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "GradScaler",
    "OffloadAdafactor",
    "OffloadAdagrad",
    "OffloadAdam",
    "OffloadAdamW",
    "OffloadAdamW8bit",
    "OffloadLion",
    "OffloadOptimizer",
    "OffloadSGD",
    "from_deepspeed_config",
]
