"""Drop-in torch.optim optimizers for CPU tensors, stepped by libstrata's fused,
multithreaded kernels (AVX-512 / AVX2 chosen at run time).

Each class takes the constructor arguments of its torch.optim twin and keeps the
same state_dict (param_groups with the twin's keys; per parameter 'step' as a
float32 scalar tensor, 'exp_avg', 'exp_avg_sq' as fp32 tensors shaped like the
parameter), so a state_dict saved from one loads into the other and training
continues identically.

Parameters must be fp32, contiguous, on the CPU (the fp32 master weights of
ZeRO-Offload-style training). Gradients are p.grad (fp32), or, for 16-bit
gradients (torch does not let an fp32 parameter hold a bf16/fp16 .grad), the
tensors passed to step(grads=...): one per parameter in param_groups order, fp32,
bf16 or fp16, None to skip a parameter. 16-bit gradients are widened exactly
inside the kernel, with no fp32 copy. step(copy_out=...) writes the updated
weights as bf16/fp16 (e.g. a 16-bit model's weights) in the same pass.

Adding an optimizer is one small class: its torch twin, its strata kind and state
names, and how a param group becomes its C config struct.
"""

import ctypes
import inspect
import math

import torch

from strata import _lib
from strata._tensors import DTYPES, check_cpu_contiguous, dtype_code

__all__ = ["Adam", "AdamW"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _StrataOptimizer(torch.optim.Optimizer):
    """Base of the strata optimizers. Subclasses set:
      _twin        the torch.optim class whose arguments and state_dict they mirror
      _kind        strata_optimizer_kind
      _state_keys  per-parameter fp32 state tensors, in the C API's order
    and implement _config(group) -> ctypes config struct."""

    _twin = None
    _kind = None
    _state_keys = ()

    def __init__(self, params, defaults, num_threads):
        if not isinstance(num_threads, int) or num_threads < 0:
            raise ValueError(f"num_threads must be an int >= 0 (0 = all CPUs), got "
                             f"{num_threads!r}")
        self._num_threads = num_threads
        self._handle = None
        super().__init__(params, defaults)

    # -- torch.optim.Optimizer protocol ----------------------------------------

    def __setstate__(self, state):
        # load_state_dict() and unpickling come here; hyper-parameters are sent to
        # the handle at every step, so an existing handle stays valid.
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self._group_defaults().items():
                group.setdefault(key, value)
        for s in self.state.values():
            if "step" in s and not torch.is_tensor(s["step"]):
                s["step"] = torch.tensor(float(s["step"]))

    def __del__(self):
        handle = getattr(self, "_handle", None)
        destroy = getattr(self, "_destroy", None)
        if handle is not None and destroy is not None:
            destroy(handle)
        self._handle = None

    def __getstate__(self):
        # torch's state plus the thread count; not the C handle (a copy or an
        # unpickled optimizer makes its own on its first step).
        state = super().__getstate__()
        state["_num_threads"] = getattr(self, "_num_threads", 0)
        return state

    @torch.no_grad()
    def step(self, closure=None, *, grads=None, grad_scale=1.0, copy_out=None):
        """One optimizer step over every parameter with a gradient.

        closure: as torch.optim (re-evaluates the model, returns the loss).
        grads: optional gradients used instead of p.grad, one per parameter in
          param_groups order (None skips it): fp32, bf16 or fp16 CPU tensors shaped
          like the parameter.
        grad_scale: every gradient is multiplied by it first (e.g. clip_coef /
          loss_scale); 1.0 for none.
        copy_out: optional output tensors, one per parameter in param_groups order
          (None for none): bf16, fp16 or fp32 CPU tensors shaped like the parameter
          that receive the updated weights in the same pass (round to nearest
          even, as tensor.to(dtype)), e.g. a bf16 model's weights.

        Every parameter, gradient and state tensor is checked before any is
        updated: TypeError/ValueError for a bad dtype, device, layout or shape, and
        nothing changes. Returns the closure's loss (or None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be finite, got {grad_scale}")

        work = self._collect(grads, copy_out)  # [(group, param, grad, out)], checked
        if not work:
            return loss
        library = _lib.lib()
        handle = self._get_handle()
        num_state = len(self._state_keys)
        state_ptrs = (ctypes.c_void_p * num_state)()
        current_group = None
        for group, p, g, out in work:
            if group is not current_group:
                config = self._config(group)
                _lib.check(library.strata_optimizer_set_config(handle, ctypes.byref(config)))
                current_group = group
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0)
                for key in self._state_keys:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            for i, key in enumerate(self._state_keys):
                state_ptrs[i] = state[key].data_ptr()
            _lib.check(library.strata_optimizer_step(
                handle, int(state["step"].item()), float(grad_scale), p.data_ptr(), state_ptrs,
                num_state, g.data_ptr(), DTYPES[g.dtype], None if out is None else out.data_ptr(),
                _lib.DTYPE_F32 if out is None else DTYPES[out.dtype], p.numel()))
        return loss

    # -- helpers -----------------------------------------------------------------

    def _name(self):
        return f"strata.optim.{type(self).__name__}"

    def _group_defaults(self):
        return {k: v for k, v in self.defaults.items() if k != "params"}

    def _get_handle(self):
        if getattr(self, "_handle", None) is None:
            library = _lib.lib()
            options = _lib.OptimizerOptions()
            library.strata_optimizer_options_init(ctypes.byref(options))
            options.num_threads = getattr(self, "_num_threads", 0)
            config = self._config(self.param_groups[0])
            handle = ctypes.c_void_p()
            _lib.check(library.strata_optimizer_create(
                self._kind, ctypes.byref(config), ctypes.byref(options), ctypes.byref(handle)))
            self._handle = handle
            # Kept on the instance: module globals may be gone when __del__ runs at exit.
            self._destroy = library.strata_optimizer_destroy
        return self._handle

    def _collect(self, grads, copy_out):
        """Checks every parameter that will be stepped, its gradient, its copy-out
        tensor and its state."""
        flat = [p for group in self.param_groups for p in group["params"]]
        if grads is not None:
            grads = list(grads)
            if len(grads) != len(flat):
                raise ValueError(f"{self._name()}.step: grads has {len(grads)} entries, the "
                                 f"optimizer has {len(flat)} parameters (one per parameter, "
                                 "None to skip)")
        if copy_out is not None:
            copy_out = list(copy_out)
            if len(copy_out) != len(flat):
                raise ValueError(f"{self._name()}.step: copy_out has {len(copy_out)} entries, "
                                 f"the optimizer has {len(flat)} parameters (one per "
                                 "parameter, None for none)")
        work = []
        index = 0
        for gi, group in enumerate(self.param_groups):
            self._check_group(group)
            for pi, p in enumerate(group["params"]):
                g = grads[index] if grads is not None else p.grad
                out = copy_out[index] if copy_out is not None else None
                index += 1
                if g is None:
                    continue
                what = f"{self._name()}: param_groups[{gi}]['params'][{pi}]"
                check_cpu_contiguous(what, p)
                dtype_code(what, p, (torch.float32,))
                check_cpu_contiguous(f"{what}: its gradient", g)
                dtype_code(f"{what}: its gradient", g, _GRAD_DTYPES)
                if g.shape != p.shape:
                    raise ValueError(f"{what}: gradient shape {tuple(g.shape)} differs from the "
                                     f"parameter's {tuple(p.shape)}")
                state = self.state.get(p)
                if state:
                    for key in self._state_keys:
                        t = state.get(key)
                        if t is None:
                            raise ValueError(f"{what}: state has no '{key}' (a state_dict of "
                                             "another optimizer?)")
                        check_cpu_contiguous(f"{what}: state['{key}']", t)
                        dtype_code(f"{what}: state['{key}']", t, (torch.float32,))
                        if t.shape != p.shape:
                            raise ValueError(f"{what}: state['{key}'] has shape "
                                             f"{tuple(t.shape)}, the parameter {tuple(p.shape)}")
                if out is not None:
                    check_cpu_contiguous(f"{what}: its copy_out", out)
                    dtype_code(f"{what}: its copy_out", out, _GRAD_DTYPES)
                    if out.shape != p.shape:
                        raise ValueError(f"{what}: copy_out shape {tuple(out.shape)} differs "
                                         f"from the parameter's {tuple(p.shape)}")
                work.append((group, p, g, out))
        return work

    def _check_group(self, group):
        """Rejects options a param group may have gained from a loaded state_dict."""
        _reject_unsupported(self._name(), group)


def _reject_unsupported(name, options):
    """NotImplementedError / ValueError for torch options strata does not support."""
    if options.get("amsgrad", False):
        raise NotImplementedError(
            f"{name}: amsgrad=True is not supported by libstrata 0.1 yet; use amsgrad=False "
            "(or torch.optim for AMSGrad)")
    if options.get("maximize", False):
        raise NotImplementedError(
            f"{name}: maximize=True is not supported by libstrata 0.1 yet; negate the loss "
            "instead")
    if options.get("capturable", False):
        raise ValueError(f"{name}: capturable=True is for CUDA graph capture; strata optimizers "
                         "update CPU tensors: leave capturable=False")
    if options.get("differentiable", False):
        raise ValueError(f"{name}: differentiable=True (autograd through the step) is not "
                         "supported: leave differentiable=False")
    if options.get("fused", None):
        raise ValueError(f"{name}: fused=True selects torch's fused CUDA kernel; strata's CPU "
                         "kernel is always fused: leave fused unset")


def _twin_keywords(twin):
    """The keyword arguments the installed torch version's twin accepts."""
    return set(inspect.signature(twin.__init__).parameters) - {"self", "params"}


def _check_adam_args(lr, betas, eps, weight_decay):
    # The checks and messages of torch.optim.Adam/AdamW.
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class _AdamBase(_StrataOptimizer):
    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr, betas, eps, weight_decay, amsgrad, options, num_threads):
        name = f"strata.optim.{type(self).__name__}"
        _check_adam_args(lr, betas, eps, weight_decay)
        accepted = _twin_keywords(self._twin)
        given = {k: v for k, v in options.items() if v is not _UNSET}
        for key in given:
            if key not in accepted:
                raise TypeError(f"{name}: torch {torch.__version__}'s {self._twin.__name__} has "
                                f"no argument {key!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        # The twin's group keys and defaults, so state_dicts match key for key.
        twin_defaults = inspect.signature(self._twin.__init__).parameters
        for key in ("maximize", "foreach", "capturable", "differentiable", "fused"):
            if key in accepted:
                defaults[key] = given.get(key, twin_defaults[key].default)
        _reject_unsupported(name, defaults)
        super().__init__(params, defaults, num_threads)

    def _config(self, group):
        config = _lib.AdamWConfig()
        _lib.lib().strata_adamw_config_init(ctypes.byref(config))
        config.lr = group["lr"]
        config.beta1, config.beta2 = group["betas"]
        config.eps = group["eps"]
        config.weight_decay = group["weight_decay"]
        return config


class _Unset:
    def __repr__(self):
        return "<torch default>"


_UNSET = _Unset()


class AdamW(_AdamBase):
    """torch.optim.AdamW on CPU tensors (Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", ICLR 2019). Same arguments and state_dict as torch's; foreach
    is accepted and has no effect (one fused pass per tensor either way);
    amsgrad/maximize=True raise NotImplementedError; capturable, differentiable and
    fused=True raise ValueError. num_threads: 0 = all CPUs (oneTBB), n = n threads;
    results do not depend on it."""

    _twin = torch.optim.AdamW
    _kind = _lib.OPTIMIZER_ADAMW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=_UNSET, foreach=_UNSET, capturable=_UNSET,
                 differentiable=_UNSET, fused=_UNSET, num_threads=0):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad,
                         dict(maximize=maximize, foreach=foreach, capturable=capturable,
                              differentiable=differentiable, fused=fused), num_threads)


class Adam(_AdamBase):
    """torch.optim.Adam on CPU tensors (Kingma & Ba, "Adam: A Method for Stochastic
    Optimization", ICLR 2015; weight decay as L2 added to the gradient). Same
    arguments, options and state_dict rules as strata.optim.AdamW."""

    _twin = torch.optim.Adam
    _kind = _lib.OPTIMIZER_ADAM

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=_UNSET, maximize=_UNSET, capturable=_UNSET,
                 differentiable=_UNSET, fused=_UNSET, num_threads=0):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad,
                         dict(maximize=maximize, foreach=foreach, capturable=capturable,
                              differentiable=differentiable, fused=fused), num_threads)
