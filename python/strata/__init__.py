"""Strata from Python: ctypes bindings over libstrata.so (the C API of
include/strata/strata.h) and drop-in torch.optim CPU optimizers.

    import strata.optim
    opt = strata.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

and ZeRO-Offload for any PyTorch model (state in host memory or on NVMe):

    import strata.torch
    opt = strata.torch.OffloadAdamW(model, lr=3e-4, offload="nvme", nvme_path="/mnt/nvme0")

libstrata.so is looked up, in this order: the file named by the STRATA_LIBRARY
environment variable; libstrata.so.0 (or libstrata.so) beside this package;
libstrata.so.0 on the system library path (LD_LIBRARY_PATH, ldconfig).
library_path() says which file was loaded. No compiled extension is involved.
"""

from strata._lib import (
    StrataError,
    kernel_name,
    library_path,
    library_version,
)

__version__ = "0.4.0"

__all__ = [
    "StrataError",
    "functional",
    "kernel_name",
    "library_path",
    "library_version",
    "optim",
    "torch",
]


def __getattr__(name):
    # strata.optim, strata.functional and strata.torch import torch; load them on
    # first use so that `import strata` works without torch.
    if name in ("optim", "functional", "torch"):
        import importlib

        return importlib.import_module(f"strata.{name}")
    raise AttributeError(f"module 'strata' has no attribute {name!r}")
