"""strata.torch.from_deepspeed_config: a strata.torch optimizer (and loss
scaler) from a DeepSpeed configuration, for users coming from DeepSpeed's
ZeRO-Offload / ZeRO-Infinity."""

import json
import os

from strata import _offload
from strata._offload import _REPR  # values quoted from a file: bounded, escaped
from strata._scaler import GradScaler

__all__ = ["from_deepspeed_config"]

# Top-level keys that only concern DeepSpeed's engine, launcher or logging: they
# change nothing in what the optimizer computes, and are ignored.
_IGNORED_TOP = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "tensorboard",
    "wandb", "csv_monitor", "comms_logger", "flops_profiler", "aio", "activation_checkpointing",
    "checkpoint", "bf16", "seed",
}
_IGNORED_ZERO = {
    "stage", "contiguous_gradients", "overlap_comm", "reduce_scatter", "allgather_partitions",
    "allgather_bucket_size", "round_robin_gradients", "sub_group_size", "elastic_checkpoint",
    "load_from_fp32_weights", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "memory_efficient_linear", "ignore_unused_parameters", "cpu_offload",
}
_IGNORED_OFFLOAD = {"fast_init", "pipeline", "pipeline_read", "pipeline_write"}
_OPTIMIZERS = {
    "adamw": _offload.OffloadAdamW,
    "adam": _offload.OffloadAdamW,  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
    "adamw8bit": _offload.OffloadAdamW8bit,
    "adafactor": _offload.OffloadAdafactor,
    "adagrad": _offload.OffloadAdagrad,
    "lion": _offload.OffloadLion,
    "sgd": _offload.OffloadSGD,
}


def _error(where, message):
    return ValueError(f"strata.torch.from_deepspeed_config: {where}: {message}")


def _name(where, key):
    """A key's place for messages: "file.json: fp16.hysteresis", "fp16.hysteresis", or
    a top-level "file.json: gradient_clipping" (where is then "file.json: " or "")."""
    return f"{where}{key}" if not where or where.endswith(": ") else f"{where}.{key}"


def _number(where, section, key, default, integer=False, lo=None, hi=None):
    """section[key] (default when absent) as a float, or an int where integer is set
    (an integral float such as 5e8 is taken): ValueError naming where.key when it is
    a bool, a string, null, fractional where an integer is wanted, or outside
    [lo, hi]."""
    value = section.get(key, default)
    name = _name(where, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise _error(name, f"must be a number, got {_REPR.repr(value)}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise _error(name, f"must be an integer, got {value!r}")
        value = int(value)
    elif abs(value) > 3.4e38:
        raise _error(name, f"{value!r} does not fit fp32")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _error(name, f"must be in [{lo}, {hi}], got {value!r}")
    return float(value) if not integer else value


def _flag(where, section, key, default):
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise _error(_name(where, key), f"must be true or false, got {_REPR.repr(value)}")
    return value


def _check_keys(where, section, known):
    if not isinstance(section, dict):
        raise _error(where, f"must be a JSON object, got {type(section).__name__}")
    for key in section:
        if key not in known:
            raise _error(where, f"unknown or unsupported key {_REPR.repr(key)} (strata.torch reads "
                         f"{', '.join(sorted(known))}; keys that only tune DeepSpeed's own "
                         "engine are ignored, others are refused rather than silently dropped)")


def from_deepspeed_config(config, params, *, module=None, num_threads=0, bucket_size=None):
    """(optimizer, scaler) for a DeepSpeed config: a dict, or the path of a JSON
    file. params as for the optimizers (an nn.Module, or parameters / param groups
    with module= for the overlap hooks).

    Read:
      optimizer.type        AdamW, Adam (AdamW unless params.adam_w_mode is false, as
                            DeepSpeed's), Adagrad, Lion, SGD; and, not DeepSpeed types,
                            AdamW8bit and Adafactor (strata.torch.OffloadAdamW8bit /
                            OffloadAdafactor); case-insensitive
      optimizer.params      the optimizer's arguments (lr, betas, eps, weight_decay,
                            amsgrad, momentum, ...; Adafactor's are transformers'
                            names: beta1, relative_step, scale_parameter, ...);
                            adam_w_mode, torch_adam are read; bias_correction must be
                            true
      zero_optimization.offload_optimizer
                            device "cpu" | "nvme" ("none" or no section: "cpu"),
                            nvme_path, pin_memory, buffer_count; ratio must be 1
      zero_optimization.reduce_bucket_size   the bucket size (elements)
      gradient_clipping     max_grad_norm
      fp16                  enabled; loss_scale (0 = dynamic: initial_scale_power
                            (16), loss_scale_window (1000), min_loss_scale (1));
                            hysteresis (2: back off at the second overflow) and
                            consecutive_hysteresis, as DeepSpeed's DynamicLossScaler
    Ignored (they tune DeepSpeed's engine, launcher or logging, not what the
    optimizer computes): train_batch_size, train_micro_batch_size_per_gpu,
    gradient_accumulation_steps (your loop decides when to call step(); every
    backward before it accumulates), steps_per_print, wall_clock_breakdown, aio
    (Strata's I/O engine has its own), activation_checkpointing, bf16 (a bf16
    model needs no loss scaling), logging and monitoring sections; and in
    zero_optimization: stage, overlap_comm, contiguous_gradients, the allgather /
    reduce-scatter / stage3 bucket and prefetch settings, sub_group_size;
    offload_optimizer.fast_init and pipeline*.
    Refused with a ValueError naming the key: everything else, among it scheduler
    (use a torch.optim.lr_scheduler on the returned optimizer), offload_param (the
    parameters stay where the model keeps them), amp, prescale_gradients,
    gradient_predivide_factor, fp16.auto_cast, any unknown key.

    Returns the optimizer and a strata.torch.GradScaler (disabled unless fp16 is
    enabled, so the training loop reads the same either way)."""
    at = ""  # a file's name before each key in messages
    if isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        at = f"{source}: "
        try:
            with open(source, "rb") as f:
                config = json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            raise _error(source, f"not a JSON file ({_REPR.repr(str(e))[1:-1]})") from None
    if not isinstance(config, dict):
        raise _error(f"{at}config", f"must be a dict or a JSON file path, got "
                     f"{type(config).__name__}")
    _check_keys(f"{at}config", config, _IGNORED_TOP | {
        "optimizer", "zero_optimization", "gradient_clipping", "fp16"})

    optimizer = config.get("optimizer")
    if optimizer is None:
        raise _error(f"{at}optimizer", "missing: strata.torch needs optimizer.type and "
                     "optimizer.params")
    _check_keys(f"{at}optimizer", optimizer, {"type", "params"})
    kind = str(optimizer.get("type", "")).lower()
    if kind not in _OPTIMIZERS:
        raise _error(f"{at}optimizer.type", f"{_REPR.repr(optimizer.get('type'))} is not one of AdamW, Adam, "
                     "Adagrad, Lion, SGD, AdamW8bit, Adafactor")
    if not isinstance(optimizer.get("params", {}), dict):
        raise _error(f"{at}optimizer.params", "must be a JSON object of the optimizer's "
                     f"arguments, got {type(optimizer['params']).__name__}")
    args = dict(optimizer.get("params", {}))
    cls = _OPTIMIZERS[kind]
    adam_w_mode = args.pop("adam_w_mode", True)
    args.pop("torch_adam", None)
    if kind == "adam" and not adam_w_mode:
        cls = _offload.OffloadAdam
    if not args.pop("bias_correction", True):
        raise _error(f"{at}optimizer.params.bias_correction", "false is not supported")
    for key in ("betas", "eps"):
        if isinstance(args.get(key), list):
            args[key] = tuple(args[key])

    zero = config.get("zero_optimization", {})
    _check_keys(f"{at}zero_optimization", zero, _IGNORED_ZERO | {
        "offload_optimizer", "reduce_bucket_size"})
    offload = zero.get("offload_optimizer") or {}
    _check_keys(f"{at}zero_optimization.offload_optimizer", offload, _IGNORED_OFFLOAD | {
        "device", "nvme_path", "pin_memory", "buffer_count", "ratio"})
    device = offload.get("device", "cpu")
    if device == "none":
        device = "cpu"
    if device not in ("cpu", "nvme"):
        raise _error(f"{at}zero_optimization.offload_optimizer.device",
                     f"{_REPR.repr(device)} is not \"cpu\", \"nvme\" or \"none\"")
    if _number(f"{at}zero_optimization.offload_optimizer", offload, "ratio", 1.0) != 1.0:
        raise _error(f"{at}zero_optimization.offload_optimizer.ratio",
                     "partial offload is not supported (ratio must be 1)")
    options = dict(
        offload=device,
        nvme_path=offload.get("nvme_path") if device == "nvme" else None,
        pin_memory=_flag(f"{at}zero_optimization.offload_optimizer", offload, "pin_memory", True),
        buffer_count=_number(f"{at}zero_optimization.offload_optimizer", offload, "buffer_count",
                             4, integer=True, lo=1, hi=1 << 16),
        max_grad_norm=_number(at, config, "gradient_clipping", 0.0, lo=0.0),
        num_threads=num_threads,
        module=module,
    )
    if device == "nvme" and not options["nvme_path"]:
        raise _error(f"{at}zero_optimization.offload_optimizer.nvme_path",
                     "device \"nvme\" needs nvme_path")
    if bucket_size is not None:
        options["bucket_size"] = int(bucket_size)
    elif "reduce_bucket_size" in zero:
        options["bucket_size"] = _number(f"{at}zero_optimization", zero, "reduce_bucket_size",
                                         None, integer=True, lo=1, hi=1 << 40)

    fp16 = config.get("fp16", {})
    _check_keys(f"{at}fp16", fp16, {"enabled", "loss_scale", "initial_scale_power",
                               "loss_scale_window", "hysteresis", "min_loss_scale",
                               "consecutive_hysteresis"})
    if fp16.get("enabled", False):
        hysteresis = _number(f"{at}fp16", fp16, "hysteresis", 2, integer=True,  # DeepSpeed's
                             lo=-(1 << 31), hi=1 << 31)
        if hysteresis < 1:
            raise _error(f"{at}fp16.hysteresis", f"must be >= 1, got {hysteresis}")
        loss_scale = _number(f"{at}fp16", fp16, "loss_scale", 0, lo=0.0)
        if loss_scale > 0:
            scaler = GradScaler(init_scale=loss_scale, dynamic=False)
        else:
            power = _number(f"{at}fp16", fp16, "initial_scale_power", 16, integer=True, lo=0,
                            hi=127)
            scaler = GradScaler(
                init_scale=2.0 ** power,
                growth_interval=_number(f"{at}fp16", fp16, "loss_scale_window", 1000,
                                        integer=True, lo=1, hi=1 << 62),
                min_scale=_number(f"{at}fp16", fp16, "min_loss_scale", 1, lo=0.0),
                hysteresis=hysteresis,
                consecutive_hysteresis=_flag(f"{at}fp16", fp16, "consecutive_hysteresis", False))
    else:
        scaler = GradScaler(enabled=False)
    return cls(params, **args, **options), scaler
