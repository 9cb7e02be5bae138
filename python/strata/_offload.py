"""strata.torch's optimizers: ZeRO-Offload for any PyTorch model over the
strata_offload C API (include/strata/strata.h; Ren et al., "ZeRO-Offload:
Democratizing Billion-Scale Model Training", USENIX ATC 2021, and for state on
NVMe Rajbhandari et al., "ZeRO-Infinity", SC 2021).

How a training step flows (see OffloadOptimizer below for the contract):
  backward  a hook on each parameter's AccumulateGrad node (torch 1.13 has no
            register_post_accumulate_grad_hook; the node is reached as
            p.expand_as(p).grad_fn.next_functions[0][0] and its post hook runs once
            per backward, after the parameter's gradient is complete in p.grad)
            copies p.grad into its bucket's staging buffer
            (strata_offload_acquire_staging) and drops p.grad; the bucket's last
            parameter submits the bucket (strata_offload_submit_grad, segment -1).
            Strata folds it into fp32 accumulators on its own threads.
  step()    sends each param group's hyper-parameters, starts the update of every
            bucket (strata_offload_step) and returns.
  forward   a forward pre-hook on each module that owns parameters waits for their
            buckets (strata_offload_wait_bucket) before the module runs, so the
            update of later buckets overlaps the forward of earlier ones.

The hooks hold the optimizer weakly: a model outlives its optimizer, and a dropped
optimizer is freed (its hooks removed, its native state and swap files released)
without close().

This module is imported as strata.torch (python/strata/torch.py re-exports it);
it imports the real torch with an absolute import.
"""

import ctypes
import json
import math
import os
import reprlib
import threading
import weakref

import torch

from strata import _lib
from strata import optim as _optim
from strata._tensors import DTYPES

__all__ = [
    "OffloadAdafactor",
    "OffloadAdagrad",
    "OffloadAdam",
    "OffloadAdamW",
    "OffloadAdamW8bit",
    "OffloadLion",
    "OffloadOptimizer",
    "OffloadSGD",
]

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PARAM_GROUPS_FILE = "torch_param_groups.json"
DEFAULT_BUCKET_SIZE = 1 << 22  # elements: 16 MiB of fp32 gradient per staging buffer

# Modules whose forward reads their children's parameters without calling the
# children: nn.MultiheadAttention passes out_proj.weight and out_proj.bias to
# F.multi_head_attention_forward, and the fast path of nn.TransformerEncoderLayer /
# TransformerDecoderLayer reads every child's parameters in one fused call. Their
# forward pre-hook waits for all the parameters under them, not only their own.
_READS_CHILD_PARAMETERS = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
                           torch.nn.TransformerDecoderLayer)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same_kind(value, want):
    """Whether a param group value read from JSON can stand where `want` (the live
    group's value, None when the key is new) is."""
    if isinstance(want, bool):
        return isinstance(value, bool)
    if _is_number(want):
        return _is_number(value)
    if isinstance(want, (tuple, list)):
        return (isinstance(value, list) and len(value) == len(want)
                and all(_is_number(x) for x in value))
    if isinstance(want, str):
        return isinstance(value, str)
    # None, or a key this optimizer's groups do not have (a scheduler's initial_lr).
    return (value is None or isinstance(value, (bool, str)) or _is_number(value)
            or (isinstance(value, list) and all(_is_number(x) for x in value)))


def _kind_name(want):
    if isinstance(want, bool):
        return "a bool"
    if _is_number(want):
        return "a number"
    if isinstance(want, (tuple, list)):
        return f"a list of {len(want)} numbers"
    if isinstance(want, str):
        return "a string"
    return "null, a bool, a number, a string or a list of numbers"


# Param group keys torch's LR schedulers read as numbers (LRScheduler, OneCycleLR,
# CyclicLR): checked as strictly as the optimizer's own hyper-parameters.
_SCHEDULER_KEYS = frozenset(("initial_lr", "max_lr", "min_lr", "base_momentum",
                             "max_momentum"))


def _json_kind(value):
    """The JSON kind of a param group value: 'a list' for lists and tuples, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a bool"
    if _is_number(value):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _short(text, limit=80):
    return text if len(text) <= limit else text[:limit - 3] + "..."


# Values quoted from a file: bounded in length and depth, control characters escaped.
_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlevel = 3


_FLOAT_P = ctypes.POINTER(ctypes.c_float)


class _Bucket:
    """Consecutive parameters of one param group, dtype and device: the unit of
    gradient hand-off and update (a strata_offload bucket)."""

    def __init__(self, group_index, params, names):
        self.group_index = group_index
        self.params = params
        self.names = names
        self.numels = [p.numel() for p in params]
        self.offsets = []
        offset = 0
        for n in self.numels:
            self.offsets.append(offset)
            offset += n
        self.num_elems = offset
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.index = -1  # the C API's bucket index
        # CUDA parameters: a CPU mirror (pinned when pin_memory) whose slices are
        # the bucket's segments; copied into the parameters after each update.
        self.mirror = None
        # This backward's gradients.
        self.staging = None
        self.staging_ptr = None
        self.arrived = [False] * len(params)
        self.count = 0
        self.events = []  # CUDA events of this step's gradient copies, kept alive
        self.micro_batches = 0  # whole-bucket gradients submitted since the last step
        self.pending = False  # an update whose write-back nobody waited for yet
        # Each parameter's torch version counter when Strata's masters last matched it: an
        # in-place change since (model.load_state_dict, torch.nn.init, p.copy_ under no_grad)
        # is read into the masters before the next update (OffloadOptimizer._refresh_masters).
        self.versions = [p._version for p in params]

    def forget_gradients(self):
        """This step's gradient bookkeeping back to none (after
        strata_offload_discard_grads)."""
        self.staging = None
        self.staging_ptr = None
        self.arrived = [False] * len(self.params)
        self.count = 0
        self.events = []
        self.micro_batches = 0

    def first_missing(self):
        """The name of the first parameter of this bucket still without this
        backward's gradient (the first one when none arrived)."""
        for name, done in zip(self.names, self.arrived):
            if not done:
                return name
        return self.names[0]

    @property
    def is_cuda(self):
        return self.device.type == "cuda"


def _host_view(ptr, num_elems, dtype):
    """A torch tensor over num_elems elements of dtype at host address ptr (not
    owned: valid while Strata keeps that memory)."""
    size = torch.empty((), dtype=dtype).element_size()
    buf = (ctypes.c_char * (num_elems * size)).from_address(ptr)
    return torch.frombuffer(buf, dtype=dtype, count=num_elems)


def _section_dtype(section):
    """The torch dtype of a strata_state_section: uint8 codes or fp32."""
    return torch.uint8 if section.dtype == _lib.STATE_U8 else torch.float32


def _state_shape(p, n):
    """The shape of a state tensor of n values of parameter p in state_dict():
    p's shape when it has one value per element, else 1-D (as strata.optim)."""
    return p.shape if n == p.numel() else (n,)


class OffloadOptimizer(torch.optim.Optimizer):
    """Base of the strata.torch optimizers: a torch.optim.Optimizer whose fp32
    master weights and optimizer state live in Strata (host memory, or the NVMe
    swap store with offload="nvme"), never in torch memory, and whose gradients
    never stay in torch memory either (p.grad is None after backward).

    Parameters: fp32, fp16 or bf16, contiguous, on the CPU or on CUDA; moved to
    their device BEFORE the optimizer is made, and never re-assigned (p.data = ...)
    afterwards. CPU parameters are the bucket segments themselves (Strata writes
    the updated weights into them); CUDA parameters get a pinned CPU mirror per
    bucket that Strata writes and that is copied to the device when the bucket is
    waited for. Parameters with requires_grad=False (or no elements) when the
    optimizer is made are left out: no state, never updated.

    Every trainable parameter must receive exactly one gradient in every backward
    pass (freeze an unused one with requires_grad_(False) before making the
    optimizer): a bucket left incomplete is a RuntimeError naming the parameter at
    step(), and a parameter that receives a second gradient before another one its
    first (one used in two reentrant checkpoints, torch.utils.checkpoint with
    use_reentrant=True, gets its gradient in pieces: use use_reentrant=False) is
    one naming both, raised from backward. Several backward passes before one
    step() accumulate (a sum, as torch's .grad). zero_grad() discards the gradients
    handed to Strata since the last step(), as torch's discards .grad: after a
    backward that raised halfway (or one of the errors above), zero_grad() and the
    next backward go on as if it had not happened.

    Parameters changed in place after the optimizer is made (model.load_state_dict,
    torch.nn.init, p.copy_ under torch.no_grad(): anything that advances the
    tensor's version counter) are read into the master weights before the next
    update, state_dict() or save(), so the update applies to the new weights, as
    torch.optim's would; for fp16/bf16 parameters only the elements whose value
    changed take it, the others keep their fp32 master bits. A change that
    bypasses the version counter (p.data.copy_(...)) needs reload_parameters().
    Change parameters after synchronize() (or before the first step()), not while
    an update may still write them.

    Overlap: pass the model as params (OffloadAdamW(model, ...)) or as module=
    (or call attach(model)): a forward pre-hook on each module that owns
    parameters waits for its buckets, so the update overlaps the next forward
    (nn.MultiheadAttention and nn.TransformerEncoderLayer / DecoderLayer, which
    read their children's parameters directly, wait for those too; parameter
    groups added later are hooked into the attached modules as well).
    Without an attached module, step() waits for the whole update before it
    returns. Either way, call synchronize() before reading parameters outside the
    attached modules' forward (e.g. model.state_dict(), an evaluation that calls a
    parameter directly); state_dict(), save() and the like synchronize themselves.

    Options (keyword-only, besides the optimizer's own):
      offload         "cpu" (state in host memory), "nvme" (the swap store) or
                      "auto" (chosen by the engine's planning rule,
                      strata_offload_choose_device: host memory while the master
                      weights and state take at most 80 % of the memory available,
                      else the swap store under nvme_path)
      nvme_path       offload="nvme" (or "auto"): a directory, or a list of them (one per
                      drive; extents are striped over them); a private 0700
                      directory is made in each and removed when the optimizer is
                      closed
      max_grad_norm   clip the gradient to this global L2 norm (as
                      torch.nn.utils.clip_grad_norm_, applied inside Strata); 0 = no
                      clipping. An attribute: may be changed between steps
      bucket_size     elements per bucket (a parameter larger than it is a bucket
                      of its own)
      num_threads     Strata's fold and update threads; 0 = all CPUs
      pin_memory      page-lock staging and pipeline buffers (and the CUDA mirrors)
      buffer_count    NVMe read/update/write pipeline buffers, >= 2
      staging_buffers gradient staging buffers, >= 1
      io_backend      "auto", "uring" or "posix" (offload="nvme")
      module          an nn.Module to attach (see Overlap)

    After step(): grad_norm (the global L2 norm of the unscaled gradient before
    clipping, inf/nan when skipped) and skipped (True when a non-finite gradient
    skipped the step: nothing changed).

    Not picklable or copyable (it owns a native handle): use state_dict() /
    load_state_dict() (torch.optim's format, in memory) or save(dir) / load(dir)
    (Strata's checkpoint, streamed bucket by bucket, for NVMe-sized state).
    close() frees the native state (also done when the optimizer is collected:
    the hooks do not keep it alive).

    Threads: the gradient hooks may run on several autograd threads at once (CPU
    and CUDA parameters, or several GPUs); a lock serializes every call on the
    native handle except strata_offload_wait_bucket (the forward pre-hooks), as
    strata.h requires.
    """

    _twin = None  # the strata.optim class whose arguments, defaults and config we use
    _kind = None
    _has_step = True  # per-parameter 'step' in torch's state_dict

    def __init__(self, params, twin_args, *, offload, nvme_path, max_grad_norm, bucket_size,
                 num_threads, pin_memory, buffer_count, staging_buffers=4, io_backend=None,
                 module=None):
        name = f"strata.torch.{type(self).__name__}"
        # Held around every call on the handle but strata_offload_wait_bucket (which may
        # run concurrently with any): the gradient hooks run on each device's autograd
        # thread, and strata.h forbids concurrent calls on one handle.
        self._lock = threading.Lock()
        self._handle = None
        self._buckets = []
        self._least = None  # _least_served()'s cache
        self._hooks = []
        self._module_hooks = []
        self._attached = []  # modules given to attach(): add_param_group hooks them too
        self._ready = False
        self._groups_added = 0  # C groups added (_register_group)
        self._stepped = False
        if isinstance(params, torch.nn.Module):
            if module is not None and module is not params:
                raise ValueError(f"{name}: params is a module and module= another one")
            module = params
            params = [p for p in params.parameters()]
        if offload not in ("cpu", "nvme", "auto"):
            raise ValueError(f"{name}: offload must be \"cpu\", \"nvme\" or \"auto\", got "
                             f"{offload!r}")
        if offload == "nvme" or (offload == "auto" and nvme_path):
            if not nvme_path:
                raise ValueError(f"{name}: offload=\"nvme\" needs nvme_path (a directory on "
                                 "the drive, or a list of them)")
            paths = [nvme_path] if isinstance(nvme_path, (str, os.PathLike)) else list(nvme_path)
            paths = [os.fspath(p) for p in paths]
        else:
            if nvme_path:
                raise ValueError(f"{name}: nvme_path is given but offload is \"cpu\" (state in "
                                 "host memory): pass offload=\"nvme\" to use the drive")
            paths = []
        if not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"{name}: bucket_size must be an int >= 1 (elements), got "
                             f"{bucket_size!r}")
        if not isinstance(staging_buffers, int) or staging_buffers < 1:
            raise ValueError(f"{name}: staging_buffers must be an int >= 1, got "
                             f"{staging_buffers!r}")
        self._check_max_grad_norm(max_grad_norm)
        # The twin validates the arguments and makes the defaults of torch's
        # optimizer (param_groups match torch's key for key); it is not stepped.
        defaults = self._twin([torch.nn.Parameter(torch.zeros(1))], **twin_args).defaults
        self.max_grad_norm = float(max_grad_norm)
        self.grad_norm = None
        self.skipped = False
        self._offload = offload
        self._nvme_paths = paths
        self._bucket_size = bucket_size
        self._staging_buffers = staging_buffers
        self._pin_memory = bool(pin_memory)
        super().__init__(params, defaults)

        library = _lib.lib()
        if offload == "auto":
            # The engine's planning rule chooses (strata_offload_choose_device): host memory
            # while the state fits, else the NVMe swap store under nvme_path.
            offload = self._auto_offload(bool(paths))
            self._offload = offload
            if offload == "cpu":
                paths = []
                self._nvme_paths = paths
        options = _lib.OffloadOptions()
        library.strata_offload_options_init(ctypes.byref(options))
        options.device = _lib.OFFLOAD_NVME if offload == "nvme" else _lib.OFFLOAD_CPU
        encoded = [os.fsencode(p) for p in paths]
        path_array = (ctypes.c_char_p * max(len(encoded), 1))(*encoded)
        options.nvme_paths = ctypes.cast(path_array, ctypes.POINTER(ctypes.c_char_p))
        options.num_nvme_paths = len(encoded)
        options.num_threads = num_threads
        options.buffer_count = buffer_count
        options.staging_buffers = staging_buffers
        options.pin_memory = int(bool(pin_memory))
        if io_backend is not None:
            options.io_backend = io_backend.encode()
        handle = ctypes.c_void_p()
        status = library.strata_offload_create(ctypes.byref(options), ctypes.byref(handle))
        if status != _lib.STATUS_OK:
            message = library.strata_last_error().decode(errors="replace")
            where = f" (nvme_path {', '.join(paths)})" if paths else ""
            code = (_lib.STATUS_NAMES[status] if 0 <= status < len(_lib.STATUS_NAMES)
                    else f"status {status}")
            raise _lib.StrataError(code,
                                   f"{name}: cannot create the offload optimizer{where}: "
                                   f"{message}")
        self._handle = handle
        # Kept on the instance: module globals may be gone when __del__ runs at exit.
        self._destroy = library.strata_offload_destroy
        self._cuda_events = True
        self._names = {}
        if module is not None:
            self._names = {p: n for n, p in module.named_parameters()}
        with self._lock:
            for gi, group in enumerate(self.param_groups):
                self._register_group(gi, group)
        self._ready = True
        if module is not None:
            self.attach(module)

    # -- torch.optim.Optimizer protocol ---------------------------------------------

    def add_param_group(self, param_group):
        if getattr(self, "_ready", False):
            self._live_handle()  # RuntimeError once close() ran
        if getattr(self, "_stepped", False):
            raise RuntimeError(f"{self._name()}.add_param_group: parameter groups must be added "
                               "before the first step()")
        super().add_param_group(param_group)
        if getattr(self, "_ready", False):
            first = len(self._buckets)
            gi = len(self.param_groups) - 1
            try:
                with self._lock:
                    self._register_group(gi, self.param_groups[gi])
            except Exception:
                # Refused before Strata added its group (a parameter's dtype, a
                # hyper-parameter): the group is not kept, as torch.optim validates
                # before it appends.
                if self._groups_added <= gi:
                    self.param_groups.pop()
                raise
            for module in self._attached:
                self._attach_buckets(module, self._buckets[first:])

    def zero_grad(self, set_to_none=True):
        """Discards the gradients handed to Strata since the last step() (as torch's
        zero_grad discards .grad): those of whole backward passes and of one that
        raised halfway (strata_offload_discard_grads). Master weights, state and
        the update in flight are untouched. p.grad of the trainable parameters is
        None already; it is set to None for every parameter of the groups."""
        with self._lock:
            if any(b.micro_batches or b.count for b in self._buckets):
                self._discard_gradients()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self, closure=None, *, loss_scale=1.0):
        """Starts the update of every bucket with the gradients of the backward
        passes since the last step, and returns closure()'s loss (or None).

        loss_scale: the gradients are the true ones times it (fp16 loss scaling);
        Strata divides by it, and skips the step when a gradient is inf/nan
        (self.skipped; nothing changes). strata.torch.GradScaler passes it.

        Errors: RuntimeError naming a parameter that received no gradient (or
        fewer than the others); StrataError for an error of Strata's threads
        (an NVMe write that failed: the optimizer is then unusable; load a saved
        state into a new one)."""
        self._live_handle()  # RuntimeError once close() ran
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not math.isfinite(loss_scale) or loss_scale <= 0:
            raise ValueError(f"{self._name()}.step: loss_scale must be finite and > 0, got "
                             f"{loss_scale}")
        self._check_max_grad_norm(self.max_grad_norm)
        with self._lock:
            self._step_locked(loss_scale)
        if not self._module_hooks:
            self.synchronize()
        return loss

    def _step_locked(self, loss_scale):
        """step() under self._lock."""
        self._check_complete()
        self._refresh_masters(self._buckets)
        library = _lib.lib()
        handle = self._live_handle()
        for gi, group in enumerate(self.param_groups):
            config = self._config(group)
            _lib.check(library.strata_offload_set_group_config(handle, gi, ctypes.byref(config)))
        options = _lib.OffloadStepOptions()
        library.strata_offload_step_options_init(ctypes.byref(options))
        options.max_grad_norm = float(self.max_grad_norm)
        options.loss_scale = float(loss_scale)
        result = _lib.OffloadStepResult()
        _lib.check(library.strata_offload_step(handle, ctypes.byref(options),
                                               ctypes.byref(result)))
        self._stepped = True
        self.grad_norm = result.grad_norm
        self.skipped = bool(result.skipped)
        self._least = None
        for b in self._buckets:
            b.micro_batches = 0
            b.events = []
            # A skipped step writes nothing, but an earlier update may still be
            # unwaited for (a bucket whose module did not run since): keep its flag,
            # or its CUDA mirror would never be copied to the device.
            b.pending = b.pending or not self.skipped

    def state_dict(self):
        """torch.optim's state_dict of the twin (torch.optim.AdamW for
        OffloadAdamW, ...): 'param_groups' as torch's, and per parameter the twin's
        state ('step' as a float32 scalar tensor; fp32 tensors shaped like the
        parameter: 'exp_avg', 'exp_avg_sq', ...), read from Strata, plus 'master'
        (the fp32 master weights) for fp16/bf16 parameters. OffloadAdamW8bit and
        OffloadAdafactor: one tensor per state section of the parameter, as
        strata.optim.AdamW8bit / Adafactor (uint8 codes or fp32; shaped like the
        parameter when it has one value per element, else 1-D). State tensors are on
        the CPU. A parameter has no entry before the first step (torch's lazy
        state), except with Adagrad. Materializes the whole state in host memory:
        for NVMe-sized state use save(dir)."""
        self.synchronize()
        with self._lock:
            self._refresh_masters(self._buckets)
            return self._read_state_dict()

    def _read_state_dict(self):
        """state_dict() under self._lock, after a synchronize."""
        library = _lib.lib()
        handle = self._live_handle()
        index_of = {}
        param_groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = []
            for p in group["params"]:
                index_of.setdefault(id(p), len(index_of))
                packed["params"].append(index_of[id(p)])
            param_groups.append(packed)
        state = {}
        for b in self._buckets:
            step = self._group_step(b.group_index)
            if step == 0 and self._lazy_state():
                continue
            tensors = []  # (tensor index, name, the bucket's whole tensor)
            for t, section in enumerate(self._sections(b)):
                if t == 0 and b.dtype == torch.float32:
                    continue  # fp32 parameters are their own masters
                flat = torch.empty(section.num_elems, dtype=_section_dtype(section))
                _lib.check(library.strata_offload_read_state_bytes(
                    handle, b.index, t, ctypes.c_void_p(flat.data_ptr()), section.size_bytes))
                tensors.append((t, section.name.decode(), flat))
            for slot, p in enumerate(b.params):
                entry = {}
                if self._has_step:
                    entry["step"] = torch.tensor(float(step))
                for t, key, flat in tensors:
                    offset, n = self._segment_range(b, slot, t)
                    if n == 0:
                        continue  # e.g. Adafactor's rows of a 1-D parameter
                    entry[key] = flat[offset:offset + n].view(_state_shape(p, n)).clone()
                entry.update(self._extra_state(self.param_groups[b.group_index], entry))
                state[index_of[id(p)]] = entry
        return {"state": state, "param_groups": param_groups}

    def load_state_dict(self, state_dict):
        """Loads a state_dict of this optimizer or of its twin (torch's, or
        strata.optim's for the 8-bit and factored kinds; same groups, same parameter
        counts per group, each tensor with the element count and kind (uint8 codes
        or floating point) of this optimizer's state; amsgrad, momentum on/off and
        Adafactor's beta1 on/off as this optimizer's).
        Hyper-parameters come from it, as torch.optim. The master weights come from
        'master' where present, else from the parameters as they are now (load the
        model's weights first). Everything is checked before anything changes."""
        self.synchronize()
        with self._lock:
            self._load_state_dict_locked(state_dict)
        self.synchronize()

    def _load_state_dict_locked(self, state_dict):
        """load_state_dict() under self._lock, after a synchronize."""
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for g, sg in zip(groups, saved_groups):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
        saved_state = state_dict["state"]
        index_of = {}
        for g, sg in zip(groups, saved_groups):
            for p, i in zip(g["params"], sg["params"]):
                index_of[id(p)] = i
        new_groups = []
        for g, sg in zip(groups, saved_groups):
            ng = {k: v for k, v in sg.items() if k != "params"}
            ng["params"] = g["params"]
            for key, value in self.defaults.items():
                ng.setdefault(key, value)
            new_groups.append(self._tuples_as_defaults(ng))
        for gi, (g, ng) in enumerate(zip(groups, new_groups)):
            for key, value in self._layout_options(g).items():
                saved = self._layout_options(ng)[key]
                if saved != value:
                    raise ValueError(
                        f"{self._name()}.load_state_dict: param group {gi} was saved with "
                        f"{key}={ng.get(key)!r}, this optimizer has {key}={g.get(key)!r}: it "
                        "decides the kind of state kept, which cannot change; make the "
                        "optimizer with the saved setting")
        library = _lib.lib()
        handle = self._live_handle()
        # Check everything first: configs, then each bucket's tensors.
        configs = [self._config(ng) for ng in new_groups]
        plan = []  # (bucket, {tensor index: (section, whole tensor) or None (reload)})
        group_steps = {}
        for b in self._buckets:
            entries = [saved_state.get(index_of[id(p)]) for p in b.params]
            present = [e is not None and len(e) > 0 for e in entries]
            sections = self._sections(b)
            if not any(present):
                writes = {t: (sections[t], self._initial_state(new_groups[b.group_index],
                                                                sections[t]))
                          for t in range(1, len(sections))}
                writes[0] = None
                step = 0
            else:
                if not all(present):
                    missing = b.names[present.index(False)]
                    raise ValueError(f"{self._name()}.load_state_dict: no state for {missing} "
                                     "while other parameters have one")
                writes = {}
                for t, section in enumerate(sections):
                    key = section.name.decode()
                    if t == 0 and not all(key in e for e in entries):
                        writes[0] = None  # the masters: from the parameters
                        continue
                    writes[t] = (section, self._gather_state(b, t, section, key, entries))
                step = self._loaded_step(entries, b)
            previous = group_steps.setdefault(b.group_index, step)
            if previous != step:
                raise ValueError(f"{self._name()}.load_state_dict: parameters of param group "
                                 f"{b.group_index} have different step counts ({previous} and "
                                 f"{step}); Strata keeps one step count per group")
            plan.append((b, writes))
        for gi, config in enumerate(configs):
            _lib.check(library.strata_offload_set_group_config(handle, gi, ctypes.byref(config)))
        self.param_groups = new_groups
        for gi, step in group_steps.items():
            _lib.check(library.strata_offload_set_group_step(handle, gi, step))
        for b, writes in plan:
            for t, write in writes.items():
                if write is None:
                    _lib.check(library.strata_offload_reload_masters(handle, b.index)) \
                        if b.mirror is None else self._reload_cuda_masters(b)
                else:
                    section, flat = write
                    _lib.check(library.strata_offload_write_state_bytes(
                        handle, b.index, t, ctypes.c_void_p(flat.data_ptr()),
                        section.size_bytes))
            if b.mirror is not None:
                b.pending = True  # write_state(0) rewrote the mirror
            b.versions = [p._version for p in b.params]

    def __getstate__(self):
        raise TypeError(f"{self._name()} owns native state and cannot be pickled or copied; "
                        "use state_dict() or save(dir)")

    def __deepcopy__(self, memo):
        self.__getstate__()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: torch may be half torn down
            pass

    # -- Strata-specific ------------------------------------------------------------

    def attach(self, module):
        """Installs a forward pre-hook on every module of `module` that owns some of
        this optimizer's parameters: it waits for their buckets' update (and, for
        CUDA parameters, copies them to the device) before the module runs (the
        modules of _READS_CHILD_PARAMETERS wait for their children's parameters
        too). From then on step() returns before the update finished. Parameter
        groups added later (add_param_group) are hooked into `module` as well. A
        load_state_dict pre-hook on `module` waits for the update in flight, so
        that it cannot write over the loaded weights. The hooks hold this optimizer
        weakly and do nothing once it is collected."""
        for name, p in module.named_parameters():
            self._names.setdefault(p, name)
        for b in self._buckets:
            b.names = [self._param_name(p) for p in b.params]
        if not any(m is module for m in self._attached):
            self._attached.append(module)
            this = weakref.ref(self)

            def load_pre_hook(*unused):
                # model.load_state_dict() writes the parameters: let the update in flight
                # finish first, or it would write over the loaded weights (which the next
                # step then reads into the masters: _refresh_masters).
                opt = this()
                if opt is not None and opt._handle is not None:
                    opt.synchronize()

            register = getattr(module, "register_load_state_dict_pre_hook", None)
            if register is None:  # torch < 2.5: the same hook, under its older name
                register = module._register_load_state_dict_pre_hook
            self._module_hooks.append(register(load_pre_hook))
        self._attach_buckets(module, self._buckets)

    def _attach_buckets(self, module, buckets):
        """The forward pre-hooks of attach() for `buckets` (a subset of this
        optimizer's) on the modules of `module` that read their parameters."""
        bucket_of = {}
        for b in buckets:
            for p in b.params:
                bucket_of[p] = b
        this = weakref.ref(self)
        for m in module.modules():
            recurse = isinstance(m, _READS_CHILD_PARAMETERS)
            mine = {bucket_of[p].index: bucket_of[p] for p in m.parameters(recurse=recurse)
                    if p in bucket_of}
            if not mine:
                continue
            waited = [mine[i] for i in sorted(mine)]

            def pre_hook(mod, inputs, waited=waited):
                opt = this()
                if opt is not None:
                    opt._wait(waited)

            self._module_hooks.append(m.register_forward_pre_hook(pre_hook))

    def synchronize(self):
        """Waits for every gradient fold and update; afterwards the parameters hold
        the updated weights."""
        with self._lock:
            if self._handle is None:
                return
            _lib.check(_lib.lib().strata_offload_synchronize(self._handle))
        self._wait(self._buckets)

    def reload_parameters(self):
        """Reads the parameters into the master weights, every bucket, whatever their
        version counters say: after a change that bypasses them (p.data.copy_(x),
        writes through numpy or ctypes). For fp16/bf16 parameters only the elements
        whose value differs from the master rounded to their dtype take it. Waits
        for the update in flight first."""
        self.synchronize()
        with self._lock:
            self._refresh_masters(self._buckets, force=True)

    def save(self, path):
        """Writes the whole optimizer state (masters, state, step counts,
        hyper-parameters) to directory `path` in Strata's checkpoint format
        (crash-safe: a temporary directory renamed over `path`), streamed bucket by
        bucket, plus the torch param_groups' hyper-parameters. The model's weights
        are not included: save them yourself (model.state_dict()). A param group
        value JSON cannot hold (a tensor lr, say) is a TypeError naming it, raised
        before anything is written."""
        self.synchronize()
        path = os.fspath(path)
        # Serialized first: the C save exchanges the new directory into place, so a
        # failure after it would leave a state without its param groups.
        text = self._param_groups_json()
        with self._lock:
            self._refresh_masters(self._buckets)
            _lib.check(_lib.lib().strata_offload_save(self._live_handle(), os.fsencode(path)))
        tmp = os.path.join(path, _PARAM_GROUPS_FILE + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, _PARAM_GROUPS_FILE))

    def load(self, path):
        """Restores a state written by save() into an optimizer over the same model
        (same groups, dtypes and parameter sizes; checked before anything changes).
        The parameters receive the saved master weights (rounded to their dtype).
        A directory whose param groups file is only a torch_param_groups.json.tmp (a
        save() that did not finish) is refused with ValueError."""
        self.synchronize()
        path = os.fspath(path)
        groups_file = os.path.join(path, _PARAM_GROUPS_FILE)
        groups = None
        if os.path.exists(groups_file):
            groups = self._read_param_groups(path, groups_file)
        elif os.path.exists(groups_file + ".tmp"):
            raise ValueError(f"{self._name()}.load: {path} holds {_PARAM_GROUPS_FILE}.tmp but "
                             f"no {_PARAM_GROUPS_FILE}: a save() that did not finish (its "
                             "param groups were not written); nothing was loaded")
        with self._lock:
            _lib.check(_lib.lib().strata_offload_load(self._live_handle(), os.fsencode(path)))
        if groups is not None:
            for group, saved in zip(self.param_groups, groups):
                group.update(self._tuples_as_defaults(saved))
        for b in self._buckets:
            b.pending = b.mirror is not None
        self.synchronize()
        for b in self._buckets:  # the parameters hold the loaded masters now
            b.versions = [p._version for p in b.params]

    def stats(self):
        """Strata's counters: a dict of steps, skipped_steps, nvme_bytes_read,
        nvme_bytes_written, update_seconds, wait_seconds (1 - wait/update is the
        fraction of the update hidden under the caller's work), host_state_bytes."""
        s = _lib.OffloadStats()
        with self._lock:
            _lib.check(_lib.lib().strata_offload_get_stats(self._live_handle(),
                                                           ctypes.byref(s)))
        return {name: getattr(s, name) for name, _ in _lib.OffloadStats._fields_}

    def close(self):
        """Removes the hooks, waits for the work in flight and frees Strata's state
        (the NVMe swap files are removed). The optimizer is unusable afterwards."""
        for h in getattr(self, "_hooks", []) + getattr(self, "_module_hooks", []):
            h.remove()
        self._hooks = []
        self._module_hooks = []
        self._attached = []
        lock = getattr(self, "_lock", None)
        if lock is None:  # __init__ failed before making it: no handle either
            return
        with lock:
            handle = getattr(self, "_handle", None)
            destroy = getattr(self, "_destroy", None)
            self._handle = None
            if handle is not None and destroy is not None:
                destroy(handle)

    # -- helpers --------------------------------------------------------------------

    def _name(self):
        return f"strata.torch.{type(self).__name__}"

    def _param_name(self, p, gi=None, pi=None):
        name = self._names.get(p)
        if name is None and gi is not None:
            name = f"param_groups[{gi}]['params'][{pi}]"
        if name is None:
            for gj, group in enumerate(self.param_groups):
                for pj, q in enumerate(group["params"]):
                    if q is p:
                        name = f"param_groups[{gj}]['params'][{pj}]"
        return f"{name} (shape {tuple(p.shape)})"

    def _live_handle(self):
        if self._handle is None:
            raise RuntimeError(f"{self._name()} was closed")
        return self._handle

    @staticmethod
    def _check_max_grad_norm(value):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"max_grad_norm must be finite and >= 0 (0 = no clipping), got "
                             f"{value!r}")

    def _state_bytes(self):
        """The master weights and optimizer state of every trained parameter, in bytes: 4 per
        element plus the state layout of each group's config (strata_optimizer_state_layout)."""
        library = _lib.lib()
        total = 0
        for group in self.param_groups:
            options = _lib.OptimizerOptions()
            library.strata_optimizer_options_init(ctypes.byref(options))
            config = self._config(group)
            handle = ctypes.c_void_p()
            _lib.check(library.strata_optimizer_create(self._kind, ctypes.byref(config),
                                                       ctypes.byref(options),
                                                       ctypes.byref(handle)))
            try:
                for p in group["params"]:
                    if not p.requires_grad or p.numel() == 0:
                        continue
                    shape = (ctypes.c_int64 * max(p.dim(), 1))(*p.shape)
                    sections = (_lib.StateSection * _lib.MAX_STATE_SECTIONS)()
                    count = ctypes.c_int()
                    _lib.check(library.strata_optimizer_state_layout(
                        handle, shape, p.dim(), sections, _lib.MAX_STATE_SECTIONS,
                        ctypes.byref(count)))
                    total += 4 * p.numel() + sum(sec.size_bytes for sec in sections[:count.value])
            finally:
                library.strata_optimizer_destroy(handle)
        return total

    def _auto_offload(self, nvme_paths_given):
        """offload="auto": "cpu" or "nvme", as strata_offload_choose_device (the engine's plan
        target) says for this model's state."""
        device = ctypes.c_int()
        _lib.check(_lib.lib().strata_offload_choose_device(
            self._state_bytes(), 1 if nvme_paths_given else 0, ctypes.byref(device)))
        return "nvme" if device.value == _lib.OFFLOAD_NVME else "cpu"

    def _config(self, group):
        _optim._reject_unsupported(self._name(), group)
        return self._twin._config(group)

    def _group_step(self, gi):
        step = ctypes.c_int64()
        _lib.check(_lib.lib().strata_offload_get_group_step(self._live_handle(), gi,
                                                            ctypes.byref(step)))
        return step.value

    def _param_groups_json(self):
        """The param groups' hyper-parameters (without 'params') as save() writes
        them; TypeError naming the first group and key JSON cannot hold."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        try:
            return json.dumps(groups)
        except (TypeError, ValueError) as e:
            for gi, group in enumerate(groups):
                for key, value in group.items():
                    try:
                        json.dumps({key: value})
                    except (TypeError, ValueError) as why:
                        raise TypeError(
                            f"{self._name()}.save: param group {gi}'s {_REPR.repr(key)} = "
                            f"{_REPR.repr(value)} cannot be written as JSON "
                            f"({_short(str(why))}); nothing was saved") from None
            raise TypeError(f"{self._name()}.save: the param groups cannot be written as "
                            f"JSON ({_short(str(e))}); nothing was saved") from None

    def _read_param_groups(self, path, groups_file):
        """save()'s torch_param_groups.json, checked before load changes anything: a
        list of one object per param group whose values have the kinds this
        optimizer's groups hold (a number where a number is, a bool where a bool is,
        a list of as many numbers where a tuple is) for the keys the optimizer or an
        LR scheduler reads (its defaults, _SCHEDULER_KEYS); any other key (torch's
        param_names, a user's tags) is restored as saved when it is of the live
        group's JSON kind, or the live group lacks it or holds None. A damaged or
        hand-edited file raises ValueError naming it, the group and the key."""
        where = f"{self._name()}.load: {groups_file}"
        try:
            with open(groups_file, "rb") as f:
                groups = json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            raise ValueError(f"{where}: not a JSON file of param groups "
                             f"({_short(str(e))})") from None
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ValueError(f"{where}: not a list of param group objects")
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{self._name()}.load: {path} has {len(groups)} parameter "
                             f"groups, this optimizer {len(self.param_groups)}")
        for gi, (live, saved) in enumerate(zip(self.param_groups, groups)):
            for key, value in saved.items():
                want = live.get(key, self.defaults.get(key))
                if key == "params":
                    kind, ok = _kind_name(want), False
                elif key in self.defaults or key in _SCHEDULER_KEYS:
                    kind, ok = _kind_name(want), _same_kind(value, want)
                else:
                    kind = _json_kind(want)
                    ok = want is None or _json_kind(value) == kind
                if not ok:
                    raise ValueError(
                        f"{where}: param group {gi}'s {_REPR.repr(key)} = "
                        f"{_REPR.repr(value)} is not {kind}")
        return groups

    def _tuples_as_defaults(self, group):
        """group with JSON's lists turned back into tuples where the defaults have
        tuples (betas, Adafactor's eps): param_groups as the constructor makes them."""
        return {k: tuple(v) if isinstance(v, list) and isinstance(self.defaults.get(k), tuple)
                else v for k, v in group.items()}

    def _sections(self, b):
        """The tensors of bucket b: [master, state section 0, ...] as
        strata_state_section structs (name, dtype, num_elems, size_bytes, initial
        value), the bucket's segments back to back in each."""
        library = _lib.lib()
        handle = self._live_handle()
        sections = []
        for t in range(library.strata_offload_bucket_num_state(handle, b.index) + 1):
            section = _lib.StateSection()
            _lib.check(library.strata_offload_state_section(handle, b.index, t,
                                                            ctypes.byref(section)))
            sections.append(section)
        return sections

    def _segment_range(self, b, slot, t):
        """(offset, count) of parameter b.params[slot]'s part of tensor t of bucket b,
        in elements of the tensor's dtype; count 0 when it has none."""
        offset, n = ctypes.c_int64(), ctypes.c_int64()
        _lib.check(_lib.lib().strata_offload_segment_state_range(
            self._live_handle(), b.index, slot, t, ctypes.byref(offset), ctypes.byref(n)))
        return offset.value, n.value

    def _gather_state(self, b, t, section, key, entries):
        """Tensor t of bucket b (dtype and size of section) from the state_dict
        entries of its parameters; ValueError naming the parameter when one is
        missing, of another size, or of another kind (uint8 codes vs fp32)."""
        dtype = _section_dtype(section)
        flat = torch.empty(section.num_elems, dtype=dtype)
        for slot, (e, p, name) in enumerate(zip(entries, b.params, b.names)):
            offset, n = self._segment_range(b, slot, t)
            if n == 0:
                continue
            value = e.get(key)
            if not torch.is_tensor(value):
                raise ValueError(f"{self._name()}.load_state_dict: {name} has no state "
                                 f"'{key}' (a state_dict of another optimizer, or other "
                                 "options?)")
            if value.numel() != n:
                want = (f"the parameter {tuple(p.shape)}" if n == p.numel()
                        else f"this optimizer keeps {n} values")
                raise ValueError(f"{self._name()}.load_state_dict: state '{key}' of {name} has "
                                 f"shape {tuple(value.shape)}, {want}")
            if (dtype == torch.uint8) != (value.dtype == torch.uint8) or value.is_complex():
                raise ValueError(f"{self._name()}.load_state_dict: state '{key}' of {name} is "
                                 f"{value.dtype}; this optimizer keeps it as {dtype} (a "
                                 "state_dict of another optimizer?)")
            flat[offset:offset + n].copy_(value.detach().reshape(-1).to("cpu", dtype))
        return flat

    def _lazy_state(self):
        return True

    def _layout_options(self, group):
        """{option: what of it decides the state's layout} of a param group (fixed
        once the group is added: amsgrad, momentum on/off, Adafactor's beta1 on/off)."""
        return {}

    def _extra_state(self, group, entry):
        return {}

    def _initial_state(self, group, section):
        """A bucket's state section before its first step (section's initial value
        or code)."""
        if section.dtype == _lib.STATE_U8:
            return torch.full((section.num_elems,), section.initial_code, dtype=torch.uint8)
        return torch.full((section.num_elems,), section.initial_value, dtype=torch.float32)

    def _loaded_step(self, entries, bucket):
        steps = {int(torch.as_tensor(e["step"]).item()) if "step" in e else None
                 for e in entries}
        if len(steps) != 1 or None in steps:
            raise ValueError(f"{self._name()}.load_state_dict: the parameters of one bucket "
                             f"({bucket.names[0]}, ...) have different or missing 'step' "
                             "counts; Strata keeps one step count per param group")
        return steps.pop()

    def _prepare_group(self, gi, group):
        """Param group gi's checks, made before anything of it is added: its
        hyper-parameters (the C config, returned) and every trainable parameter's
        dtype, device and layout."""
        config = self._config(group)
        for pi, p in enumerate(group["params"]):
            if not p.requires_grad or p.numel() == 0:
                continue
            what = f"{self._name()}: {self._param_name(p, gi, pi)}"
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"{what} has dtype {p.dtype}; strata.torch supports float32, "
                                "float16 and bfloat16 parameters")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{what} is on {p.device}; strata.torch supports CPU and CUDA "
                                 "parameters")
            if p.layout != torch.strided or not p.is_contiguous():
                raise ValueError(f"{what} is not a dense contiguous tensor")
        return config

    def _register_group(self, gi, group):
        """Adds the C group of param group gi and its buckets, and the gradient
        hooks of its parameters; every check that can refuse the group runs
        before the C group is added (self._groups_added counts those)."""
        library = _lib.lib()
        handle = self._handle
        config = self._prepare_group(gi, group)
        index = ctypes.c_int()
        _lib.check(library.strata_offload_add_group(handle, self._kind, ctypes.byref(config),
                                                    ctypes.byref(index)))
        if index.value != gi:
            raise RuntimeError(f"{self._name()}: internal: group {gi} became {index.value}")
        self._groups_added = gi + 1
        current, size = [], 0
        for p in group["params"]:
            if not p.requires_grad or p.numel() == 0:
                continue
            if current and (p.dtype != current[0].dtype or p.device != current[0].device
                            or size + p.numel() > self._bucket_size):
                self._add_bucket(gi, current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            self._add_bucket(gi, current)

    def _add_bucket(self, gi, params):
        library = _lib.lib()
        b = _Bucket(gi, params, [self._param_name(p) for p in params])
        if b.is_cuda:
            mirror = torch.empty(b.num_elems, dtype=b.dtype)
            if self._pin_memory and torch.cuda.is_available():
                mirror = mirror.pin_memory()
            for p, offset, n in zip(params, b.offsets, b.numels):
                mirror[offset:offset + n].copy_(p.detach().reshape(-1))
            b.mirror = mirror
            base = mirror.data_ptr()
            size = mirror.element_size()
            pointers = [base + offset * size for offset in b.offsets]
        else:
            pointers = [p.data_ptr() for p in params]
        segments = (ctypes.c_void_p * len(params))(*pointers)
        lengths = (ctypes.c_int64 * len(params))(*b.numels)
        # Each parameter's shape (copied by the call): Adafactor factors the
        # parameters of >= 2 dimensions; a 0-dim parameter is flat (one element).
        dims = [(ctypes.c_int64 * max(p.dim(), 1))(*p.shape) for p in params]
        shapes = (ctypes.POINTER(ctypes.c_int64) * len(params))(
            *[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims])
        ndims = (ctypes.c_int * len(params))(*[p.dim() for p in params])
        index = ctypes.c_int()
        _lib.check(library.strata_offload_add_bucket_shaped(
            self._handle, gi, DTYPES[b.dtype], segments, lengths, shapes, ndims, len(params),
            ctypes.byref(index)))
        b.index = index.value
        self._buckets.append(b)
        self._least = None
        this = weakref.ref(self)  # the node outlives us; a strong self would leak us
        with torch.enable_grad():
            for slot, p in enumerate(params):
                # The AccumulateGrad node of p; kept alive by the hook handle's
                # closure list below (a dropped node loses its hook).
                accumulate = p.expand_as(p).grad_fn.next_functions[0][0]

                def hook(*unused, b=b, slot=slot):
                    opt = this()
                    if opt is not None:
                        opt._on_gradient(b, slot)

                self._hooks.append(_NodeHook(accumulate, accumulate.register_hook(hook)))

    def _on_gradient(self, b, slot):
        """AccumulateGrad post hook: p.grad holds this backward's gradient of
        b.params[slot]. Runs on the autograd thread of p's device, possibly
        while another device's thread runs it for another bucket."""
        with self._lock:
            self._take_gradient(b, slot)

    def _take_gradient(self, b, slot):
        p = b.params[slot]
        g = p.grad
        if g is None:
            return
        behind = None
        if b.arrived[slot]:
            behind = b if b.count < len(b.params) else None
            if behind is None:  # a whole bucket whose submission failed: see zero_grad
                raise RuntimeError(
                    f"{self._name()}: {b.names[slot]} received a gradient while its bucket's "
                    "last one could not be handed to Strata (the error raised then); call "
                    "zero_grad() to discard this step's gradients")
        elif b.count == 0 and b.micro_batches > self._least_served()[0]:
            # The bucket's next micro-batch starts while another bucket has not finished the
            # one before: a second gradient within one backward.
            least = self._least_served()[0]
            behind = next(c for c in self._buckets if c.micro_batches == least)
        if behind is not None:
            raise RuntimeError(
                f"{self._name()}: {b.names[slot]} received a second gradient in one backward "
                f"before {behind.first_missing()} received its first: every trainable parameter "
                "must receive exactly one gradient per backward (a parameter used in two "
                "reentrant checkpoints, or inside one and outside it, gets its gradient in "
                "pieces: pass use_reentrant=False to torch.utils.checkpoint); zero_grad() "
                "discards this step's gradients")
        if g.layout != torch.strided:
            raise RuntimeError(f"{self._name()}: {b.names[slot]} has a sparse gradient; "
                               "strata.torch needs dense gradients")
        library = _lib.lib()
        if b.staging is None:
            open_buckets = [c for c in self._buckets if c.staging is not None]
            if len(open_buckets) >= self._staging_buffers:
                waiting = [f"{c.names[c.arrived.index(False)]}" for c in open_buckets]
                raise RuntimeError(
                    f"{self._name()}: {len(open_buckets)} buckets wait for gradients of "
                    f"{', '.join(waiting)} and hold every staging buffer: every trainable "
                    "parameter must receive a gradient in every backward (or raise "
                    "staging_buffers)")
            ptr = ctypes.c_void_p()
            _lib.check(library.strata_offload_acquire_staging(self._handle, b.index,
                                                              DTYPES[b.dtype], ctypes.byref(ptr)))
            b.staging_ptr = ptr.value
            b.staging = _host_view(ptr.value, b.num_elems, b.dtype)
        offset, n = b.offsets[slot], b.numels[slot]
        b.staging[offset:offset + n].copy_(g.reshape(-1), non_blocking=b.is_cuda)
        p.grad = None
        b.arrived[slot] = True
        b.count += 1
        if b.count < len(b.params):
            return
        event = None
        if b.is_cuda:
            # The copies above are queued on the current stream; Strata folds after
            # this event (cudaEvent_t handed to strata_offload_submit_grad). Without
            # an event handle, or when libstrata finds no CUDA runtime, we wait here.
            ev = torch.cuda.Event()
            ev.record()
            event = getattr(ev, "cuda_event", None) if self._cuda_events else None
            if event is None:
                ev.synchronize()
            b.events.append(ev)
        status = library.strata_offload_submit_grad(self._handle, b.index, -1, b.staging_ptr,
                                                    DTYPES[b.dtype], b.num_elems, event)
        if (status == _lib.STATUS_FAILED_PRECONDITION and event is not None
                and b"no CUDA runtime" in library.strata_last_error()):
            # No CUDA runtime that libstrata can use: nothing was queued; submit
            # after a host-side wait from now on. (Other refusals, a sticky error
            # say, are raised below as they are.)
            self._cuda_events = False
            b.events[-1].synchronize()
            status = library.strata_offload_submit_grad(self._handle, b.index, -1,
                                                        b.staging_ptr, DTYPES[b.dtype],
                                                        b.num_elems, None)
        _lib.check(status)
        b.staging = None
        b.staging_ptr = None
        b.arrived = [False] * len(b.params)
        b.count = 0
        if self._least is not None and b.micro_batches == self._least[0]:
            self._least[1] -= 1
            if self._least[1] == 0:
                self._least = None  # every bucket is past it: recounted when next asked
        b.micro_batches += 1

    def _least_served(self):
        """[the fewest whole-bucket gradients any bucket received since the last step,
        how many buckets have that few]: counted once per micro-batch, then kept up
        to date as buckets complete (so a backward costs O(buckets), not O(buckets²))."""
        if self._least is None:
            least = min((b.micro_batches for b in self._buckets), default=0)
            self._least = [least, sum(1 for b in self._buckets if b.micro_batches == least)]
        return self._least

    def _check_complete(self):
        for b in self._buckets:
            if b.count:
                missing = [n for n, done in zip(b.names, b.arrived) if not done]
                raise RuntimeError(
                    f"{self._name()}.step: {missing[0]} received no gradient in the last "
                    "backward while other parameters did: every trainable parameter must "
                    "receive a gradient in every backward (freeze unused ones with "
                    "requires_grad_(False) before making the optimizer); zero_grad() "
                    "discards this step's gradients")
        counts = [b.micro_batches for b in self._buckets]
        if not counts:
            return
        if max(counts) == 0:
            raise RuntimeError(f"{self._name()}.step: no gradient since the last step (call "
                               "backward() first)")
        most = max(counts)
        for b in self._buckets:
            if b.micro_batches != most:
                raise RuntimeError(
                    f"{self._name()}.step: {b.names[0]} received gradients in "
                    f"{b.micro_batches} of {most} backward passes since the last step: every "
                    "trainable parameter must receive exactly one gradient in every backward "
                    "(a parameter used in two reentrant checkpoints gets it in pieces: pass "
                    "use_reentrant=False to torch.utils.checkpoint); zero_grad() discards "
                    "this step's gradients")

    def _wait(self, buckets):
        library = None
        for b in buckets:
            if not b.pending:
                continue
            library = library or _lib.lib()
            _lib.check(library.strata_offload_wait_bucket(self._live_handle(), b.index))
            if b.mirror is not None:
                with torch.no_grad():
                    for p, offset, n in zip(b.params, b.offsets, b.numels):
                        p.copy_(b.mirror[offset:offset + n].view(p.shape), non_blocking=True)
                b.versions = [p._version for p in b.params]  # our own copy
            b.pending = False

    def _discard_gradients(self):
        """zero_grad()'s work under self._lock: Strata drops what it holds, and the
        buckets' bookkeeping starts over."""
        devices = {b.device for b in self._buckets if b.is_cuda and b.staging is not None}
        for device in devices:
            # Copies into a held staging buffer may still be queued: the pool reuses it.
            torch.cuda.synchronize(device)
        _lib.check(_lib.lib().strata_offload_discard_grads(self._live_handle()))
        for b in self._buckets:
            b.forget_gradients()
        self._least = None

    def _refresh_masters(self, buckets, force=False):
        """Reads parameters changed in place since Strata last wrote them (their
        version counter moved; every one with force) into the master weights: fp32
        parameters whole, fp16/bf16 ones element by element where the value differs
        from the master rounded to their dtype (the others keep their fp32 bits).
        Under self._lock; waits for the bucket's update in flight (read_state)."""
        library = _lib.lib()
        for b in buckets:
            versions = [p._version for p in b.params]
            if not force and versions == b.versions:
                continue
            handle = self._live_handle()
            with torch.no_grad():
                current = torch.cat([p.detach().reshape(-1).cpu() for p in b.params])
            master = torch.empty(b.num_elems, dtype=torch.float32)
            _lib.check(library.strata_offload_read_state(
                handle, b.index, 0, ctypes.cast(master.data_ptr(), _FLOAT_P), b.num_elems))
            bits = torch.int32 if b.dtype == torch.float32 else torch.int16
            changed = master.to(b.dtype).view(bits) != current.view(bits)
            if bool(changed.any()):
                master[changed] = current[changed].float()
                # Also writes the masters, rounded, into the segments (the CUDA mirror):
                # the changed elements are the parameter's, the others round to it.
                _lib.check(library.strata_offload_write_state(
                    handle, b.index, 0, ctypes.cast(master.data_ptr(), _FLOAT_P),
                    b.num_elems))
            b.versions = versions

    def _reload_cuda_masters(self, b):
        with torch.no_grad():
            for p, offset, n in zip(b.params, b.offsets, b.numels):
                b.mirror[offset:offset + n].copy_(p.detach().reshape(-1))
        _lib.check(_lib.lib().strata_offload_reload_masters(self._live_handle(), b.index))


class _NodeHook:
    """A hook's RemovableHandle together with its autograd node, which must stay
    alive for the hook to stay registered."""

    def __init__(self, node, handle):
        self.node = node
        self.handle = handle

    def remove(self):
        self.handle.remove()
        self.node = None


def _offload_kwargs(offload, nvme_path, max_grad_norm, bucket_size, num_threads, pin_memory,
                    buffer_count, staging_buffers, io_backend, module):
    return dict(offload=offload, nvme_path=nvme_path, max_grad_norm=max_grad_norm,
                bucket_size=bucket_size, num_threads=num_threads, pin_memory=pin_memory,
                buffer_count=buffer_count, staging_buffers=staging_buffers,
                io_backend=io_backend, module=module)


class OffloadAdamW(OffloadOptimizer):
    """torch.optim.AdamW (Loshchilov & Hutter, ICLR 2019) with master weights and
    state in Strata: same arguments, param_groups and state_dict as torch's (see
    strata.optim.AdamW for the accepted torch options), plus the offload options
    of OffloadOptimizer."""

    _twin = _optim.AdamW
    _kind = _lib.OPTIMIZER_ADAMW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=_optim._UNSET, foreach=_optim._UNSET,
                 offload="cpu", nvme_path=None, max_grad_norm=0.0,
                 bucket_size=DEFAULT_BUCKET_SIZE, num_threads=0, pin_memory=True,
                 buffer_count=4, staging_buffers=4, io_backend=None, module=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize, foreach=foreach),
                         **_offload_kwargs(offload, nvme_path, max_grad_norm, bucket_size,
                                           num_threads, pin_memory, buffer_count,
                                           staging_buffers, io_backend, module))

    def _layout_options(self, group):
        return {"amsgrad": bool(group.get("amsgrad", False))}


class OffloadAdam(OffloadOptimizer):
    """torch.optim.Adam (Kingma & Ba, ICLR 2015; weight decay as L2) with master
    weights and state in Strata; as OffloadAdamW."""

    _twin = _optim.Adam
    _kind = _lib.OPTIMIZER_ADAM

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, maximize=_optim._UNSET, foreach=_optim._UNSET,
                 offload="cpu", nvme_path=None, max_grad_norm=0.0,
                 bucket_size=DEFAULT_BUCKET_SIZE, num_threads=0, pin_memory=True,
                 buffer_count=4, staging_buffers=4, io_backend=None, module=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize, foreach=foreach),
                         **_offload_kwargs(offload, nvme_path, max_grad_norm, bucket_size,
                                           num_threads, pin_memory, buffer_count,
                                           staging_buffers, io_backend, module))

    def _layout_options(self, group):
        return {"amsgrad": bool(group.get("amsgrad", False))}


class OffloadAdagrad(OffloadOptimizer):
    """torch.optim.Adagrad (Duchi, Hazan & Singer, JMLR 2011) with master weights
    and state in Strata; state_dict as torch's ('step', 'sum', present from the
    start)."""

    _twin = _optim.Adagrad
    _kind = _lib.OPTIMIZER_ADAGRAD

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0,
                 eps=1e-10, *, maximize=_optim._UNSET, offload="cpu", nvme_path=None,
                 max_grad_norm=0.0, bucket_size=DEFAULT_BUCKET_SIZE, num_threads=0,
                 pin_memory=True, buffer_count=4, staging_buffers=4, io_backend=None,
                 module=None):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value,
                                      eps=eps, maximize=maximize),
                         **_offload_kwargs(offload, nvme_path, max_grad_norm, bucket_size,
                                           num_threads, pin_memory, buffer_count,
                                           staging_buffers, io_backend, module))

    def _lazy_state(self):
        return False

    def _initial_state(self, group, section):
        return torch.full((section.num_elems,), float(group["initial_accumulator_value"]),
                          dtype=torch.float32)


class OffloadSGD(OffloadOptimizer):
    """torch.optim.SGD with momentum, dampening and Nesterov momentum, with master
    weights and state in Strata; state_dict as torch's ('momentum_buffer', None
    without momentum; no 'step')."""

    _twin = _optim.SGD
    _kind = _lib.OPTIMIZER_SGD
    _has_step = False

    def __init__(self, params, lr=_optim._REQUIRED, momentum=0, dampening=0, weight_decay=0,
                 nesterov=False, *, maximize=_optim._UNSET, foreach=_optim._UNSET,
                 offload="cpu", nvme_path=None, max_grad_norm=0.0,
                 bucket_size=DEFAULT_BUCKET_SIZE, num_threads=0, pin_memory=True,
                 buffer_count=4, staging_buffers=4, io_backend=None, module=None):
        if lr is _optim._REQUIRED:
            raise TypeError("strata.torch.OffloadSGD: lr is required")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov,
                                      maximize=maximize, foreach=foreach),
                         **_offload_kwargs(offload, nvme_path, max_grad_norm, bucket_size,
                                           num_threads, pin_memory, buffer_count,
                                           staging_buffers, io_backend, module))

    def _extra_state(self, group, entry):
        return {} if group["momentum"] != 0 else {"momentum_buffer": None}

    def _layout_options(self, group):
        return {"momentum": group["momentum"] != 0}

    def _loaded_step(self, entries, bucket):
        # torch keeps no step count for SGD: t = 1 starts the momentum buffer as
        # the gradient, t > 1 uses it; a loaded buffer means t >= 1.
        return 1


class OffloadLion(OffloadOptimizer):
    """Lion (Chen et al., NeurIPS 2023) with master weights and state in Strata;
    arguments and state_dict as strata.optim.Lion ('exp_avg', no 'step')."""

    _twin = _optim.Lion
    _kind = _lib.OPTIMIZER_LION
    _has_step = False

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False,
                 offload="cpu", nvme_path=None, max_grad_norm=0.0,
                 bucket_size=DEFAULT_BUCKET_SIZE, num_threads=0, pin_memory=True,
                 buffer_count=4, staging_buffers=4, io_backend=None, module=None):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay,
                                      maximize=maximize),
                         **_offload_kwargs(offload, nvme_path, max_grad_norm, bucket_size,
                                           num_threads, pin_memory, buffer_count,
                                           staging_buffers, io_backend, module))

    def _loaded_step(self, entries, bucket):
        return 1  # Lion does not use the step count


class OffloadAdamW8bit(OffloadOptimizer):
    """AdamW with 8-bit block-wise quantized moments (Dettmers et al., "8-bit
    Optimizers via Block-wise Quantization", ICLR 2022) with master weights and
    state in Strata: about 2 bytes of state per parameter instead of AdamW's 8 (in
    host memory, or on NVMe: a quarter of the drive traffic). Arguments, param_groups
    and state_dict as strata.optim.AdamW8bit (torch.optim.AdamW's arguments without
    amsgrad; per parameter 'step', 'exp_avg' and 'exp_avg_sq' as uint8 codes shaped
    like the parameter, 'exp_avg.absmax' and 'exp_avg_sq.absmax' as fp32 vectors,
    one per block of 2048 elements counted from the parameter's first element), so
    the numbers are strata.optim.AdamW8bit's bit for bit; plus the offload options
    of OffloadOptimizer."""

    _twin = _optim.AdamW8bit
    _kind = _lib.OPTIMIZER_ADAMW8BIT

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 maximize=False, offload="cpu", nvme_path=None, max_grad_norm=0.0,
                 bucket_size=DEFAULT_BUCKET_SIZE, num_threads=0, pin_memory=True,
                 buffer_count=4, staging_buffers=4, io_backend=None, module=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      maximize=maximize),
                         **_offload_kwargs(offload, nvme_path, max_grad_norm, bucket_size,
                                           num_threads, pin_memory, buffer_count,
                                           staging_buffers, io_backend, module))

    def _config(self, group):
        if group.get("amsgrad", False):
            raise ValueError(f"{self._name()}: amsgrad is not supported with 8-bit state")
        return super()._config(group)


class OffloadAdafactor(OffloadOptimizer):
    """Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear
    Memory Cost", ICML 2018) with master weights and state in Strata. Arguments,
    param_groups and state_dict as strata.optim.Adafactor (Hugging Face transformers'
    Adafactor arguments; lr=None with relative_step=True; per parameter 'step',
    'exp_avg_sq_row' and 'exp_avg_sq_col' (fp32 vectors) for parameters of >= 2
    dimensions, else 'exp_avg_sq' shaped like the parameter, and 'exp_avg' when
    beta1 > 0), so the numbers are strata.optim.Adafactor's bit for bit; plus the
    offload options of OffloadOptimizer. Each parameter is factored with its own
    shape, whatever bucket it shares. With relative_step=True param_groups' lr is
    None: torch.optim.lr_scheduler cannot drive it (as transformers' Adafactor)."""

    _twin = _optim.Adafactor
    _kind = _lib.OPTIMIZER_ADAFACTOR

    def _layout_options(self, group):
        return {"beta1": bool(group.get("beta1"))}

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0,
                 decay_rate=-0.8, beta1=None, weight_decay=0.0, scale_parameter=True,
                 relative_step=True, warmup_init=False, *, maximize=False, offload="cpu",
                 nvme_path=None, max_grad_norm=0.0, bucket_size=DEFAULT_BUCKET_SIZE,
                 num_threads=0, pin_memory=True, buffer_count=4, staging_buffers=4,
                 io_backend=None, module=None):
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold,
                                      decay_rate=decay_rate, beta1=beta1,
                                      weight_decay=weight_decay,
                                      scale_parameter=scale_parameter,
                                      relative_step=relative_step, warmup_init=warmup_init,
                                      maximize=maximize),
                         **_offload_kwargs(offload, nvme_path, max_grad_norm, bucket_size,
                                           num_threads, pin_memory, buffer_count,
                                           staging_buffers, io_backend, module))
