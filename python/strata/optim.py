"""Drop-in torch.optim optimizers for CPU tensors, stepped by libstrata's fused,
multithreaded kernels (AVX-512 / AVX2 chosen at run time).

Each class takes the constructor arguments of its torch.optim twin and keeps the
same state_dict (param_groups with the twin's keys; per parameter the twin's
state: 'step' as a float32 scalar tensor where torch keeps one, and fp32 tensors
shaped like the parameter: AdamW/Adam 'exp_avg', 'exp_avg_sq' (+ 'max_exp_avg_sq'
with amsgrad), Adagrad 'sum', SGD 'momentum_buffer' (None without momentum), Lion
'exp_avg' (as the lion-pytorch package; torch has no Lion)), so a state_dict
saved from one loads into the other and training continues identically.

Parameters must be fp32, contiguous, on the CPU (the fp32 master weights of
ZeRO-Offload-style training). Gradients are p.grad (fp32), or, for 16-bit
gradients (torch does not let an fp32 parameter hold a bf16/fp16 .grad), the
tensors passed to step(grads=...): one per parameter in param_groups order, fp32,
bf16 or fp16, None to skip a parameter. 16-bit gradients are widened exactly
inside the kernel, with no fp32 copy. step(copy_out=...) writes the updated
weights as bf16/fp16 (e.g. a 16-bit model's weights) in the same pass.

AdamW8bit and Adafactor keep state that is not one fp32 tensor per parameter; their
state_dict holds each state section of the C API as a tensor: AdamW8bit 'exp_avg'
and 'exp_avg_sq' as uint8 codes shaped like the parameter and 'exp_avg.absmax',
'exp_avg_sq.absmax' as fp32 vectors (one per block of 2048 elements); Adafactor
'exp_avg_sq_row' and 'exp_avg_sq_col' (fp32 vectors, parameters of >= 2 dims) or
'exp_avg_sq' (shaped like the parameter), and 'exp_avg' with beta1 > 0.

Adding an optimizer is one small class: its torch twin, its strata kind and state
names, and how a param group becomes its C config struct.
"""

import ctypes
import inspect
import math

import torch
from torch.optim.optimizer import required as _REQUIRED

from strata import _lib
from strata._tensors import DTYPES, check_cpu_contiguous, dtype_code

__all__ = ["Adafactor", "Adagrad", "Adam", "AdamW", "AdamW8bit", "Lion", "SGD"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _StrataOptimizer(torch.optim.Optimizer):
    """Base of the strata optimizers. Subclasses set:
      _twin        the torch.optim class whose arguments and state_dict they mirror
      _kind        strata_optimizer_kind
      _keys        per-parameter fp32 state tensors, in the C API's order
      _counts_step whether the state keeps torch's 'step' count (not SGD, Lion)
    and implement _config(group) -> ctypes config struct. Optimizers whose state
    differs from "a 'step' tensor plus zero-initialised _keys" (amsgrad, SGD,
    Lion, Adagrad) override _state_keys, _new_state and _advance."""

    _twin = None
    _kind = None
    _keys = ()
    _counts_step = True

    def __init__(self, params, defaults, num_threads, cores=None):
        if not isinstance(num_threads, int) or num_threads < 0:
            raise ValueError(f"num_threads must be an int >= 0 (0 = all CPUs), got "
                             f"{num_threads!r}")
        if cores is not None:
            cores = tuple(cores)
            if not all(isinstance(c, int) and c >= 0 for c in cores):
                raise ValueError(f"cores must be logical CPU ids (ints >= 0), got {cores!r}")
        self._num_threads = num_threads
        self._cores = cores or None
        self._handle = None
        super().__init__(params, defaults)
        if self._cores:
            self._get_handle()  # a bad core list fails here, not at the first step

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
        state["_cores"] = getattr(self, "_cores", None)
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

        Every param group's hyper-parameters and every parameter, gradient,
        copy_out and state tensor are checked before any is updated, and nothing
        changes when one is refused: TypeError/ValueError for a bad dtype, device,
        layout or shape, for tensors that share memory (a gradient or copy_out
        that is a view of its parameter, two state tensors that are one), or a
        state's bad 'step'; StrataError naming the param group for
        hyper-parameters the library refuses (a NaN lr). A parameter's new state
        and step count are stored only once its update succeeded. Returns the
        closure's loss (or None)."""
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
        # Every group's config and every step count first: nothing changes when one is bad.
        plan = [(group, p, g, out, *self._advance(group, p, self.state.get(p, {})))
                for group, p, g, out in self._configured(handle, work)]
        for group, p, g, out, t, new in self._configured(handle, plan):
            state = {**self.state.get(p, {}), **new}
            keys = self._state_keys(group)
            state_ptrs = (ctypes.c_void_p * max(len(keys), 1))(
                *[state[key].data_ptr() for key in keys])
            _lib.check(library.strata_optimizer_step(
                handle, t, float(grad_scale), p.data_ptr(), state_ptrs, len(keys),
                g.data_ptr(), DTYPES[g.dtype], None if out is None else out.data_ptr(),
                _lib.DTYPE_F32 if out is None else DTYPES[out.dtype], p.numel()))
            self._commit(p, new)
        return loss

    # -- helpers -----------------------------------------------------------------

    def _name(self):
        return f"strata.optim.{type(self).__name__}"

    def _state_keys(self, group):
        """The state tensors a step of this group passes, in the C API's order."""
        return self._keys

    def _new_state(self, group, p):
        """The state of a parameter before its first step (torch's lazy init)."""
        state = {"step": torch.tensor(0.0)}
        for key in self._keys:
            state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _advance(self, group, p, state):
        """The C API's step t of p's next step and the state entries it creates
        (torch's lazy init, {} after the first step), leaving state (p's current
        state, {} before its first step) as it is: step() stores them with
        _commit once the update succeeded."""
        new = {} if state else self._new_state(group, p)
        return int(float((state or new)["step"] + 1)), new  # fp32 count, as torch's

    def _commit(self, p, new):
        """After p's update succeeded: stores the state entries _advance created and
        counts the step (in place, as torch)."""
        state = self.state[p]
        state.update(new)
        if self._counts_step:
            state["step"] += 1

    def _stored_keys(self, group, state):
        """The state tensors an existing (possibly loaded) state must have."""
        return self._state_keys(group)

    def _group_defaults(self):
        return {k: v for k, v in self.defaults.items() if k != "params"}

    def _get_handle(self):
        if getattr(self, "_handle", None) is None:
            library = _lib.lib()
            options = _lib.OptimizerOptions()
            library.strata_optimizer_options_init(ctypes.byref(options))
            options.num_threads = getattr(self, "_num_threads", 0)
            cores = getattr(self, "_cores", None)
            if cores:
                # Copied by strata_optimizer_create; only needs to live until it returns.
                core_ids = (ctypes.c_int * len(cores))(*cores)
                options.cores = ctypes.cast(core_ids, ctypes.POINTER(ctypes.c_int))
                options.num_cores = len(cores)
            config = self._config(self.param_groups[0])
            handle = ctypes.c_void_p()
            _lib.check(library.strata_optimizer_create(
                self._kind, ctypes.byref(config), ctypes.byref(options), ctypes.byref(handle)))
            self._handle = handle
            # Kept on the instance: module globals may be gone when __del__ runs at exit.
            self._destroy = library.strata_optimizer_destroy
        return self._handle

    def _configured(self, handle, work):
        """Yields work's (group, ...) items in order, first sending each group's
        hyper-parameters to the handle, which checks them: StrataError naming the
        group for values the library refuses (e.g. a NaN lr)."""
        current = None
        for item in work:
            group = item[0]
            if group is not current:
                config = self._config(group)
                try:
                    _lib.check(_lib.lib().strata_optimizer_set_config(handle,
                                                                      ctypes.byref(config)))
                except _lib.StrataError as e:
                    index = next(i for i, g in enumerate(self.param_groups) if g is group)
                    raise _lib.StrataError(e.status,
                                           f"{self._name()}: param_groups[{index}]: {e}") from None
                current = group
            yield item

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
                if state and self._counts_step:
                    step = state.get("step")
                    if step is None or not (math.isfinite(float(step)) and float(step) >= 0):
                        raise ValueError(f"{what}: state['step'] is {step!r}, expected a step "
                                         "count >= 0 (a state_dict of another optimizer?)")
                if state:
                    for key in self._stored_keys(group, state):
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
                stored = self._stored_keys(group, state) if state else ()
                _check_disjoint(what, {"the parameter": p, "its gradient": g, "its copy_out": out,
                                       **{f"state['{key}']": state[key] for key in stored}})
                work.append((group, p, g, out))
        return work

    def _check_group(self, group):
        """Rejects options a param group may have gained from a loaded state_dict."""
        _reject_unsupported(self._name(), group)


def _check_disjoint(what, tensors):
    """ValueError when two of the named (contiguous) tensors share memory, which the
    library refuses: a step reads and writes them as separate buffers."""
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for name, t in tensors.items() if t is not None and t.numel() > 0]
    for i, (a, a_begin, a_end) in enumerate(spans):
        for b, b_begin, b_end in spans[i + 1:]:
            if a_begin < b_end and b_begin < a_end:
                raise ValueError(f"{what}: {a} and {b} share memory; the step needs separate "
                                 "tensors (e.g. pass a .clone())")


def _reject_unsupported(name, options):
    """ValueError for torch options that make no sense for strata's CPU kernels."""
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


def _check_twin_options(name, twin, options):
    """TypeError for a keyword the installed torch's twin does not have; returns
    the given (not _UNSET) options."""
    accepted = _twin_keywords(twin)
    given = {k: v for k, v in options.items() if v is not _UNSET}
    for key in given:
        if key not in accepted:
            raise TypeError(f"{name}: torch {torch.__version__}'s {twin.__name__} has "
                            f"no argument {key!r}")
    return given


def _add_twin_defaults(twin, defaults, given, keys):
    """Adds the twin's keyword-only group keys it has (given value, else torch's
    default), so that param_groups match torch's key for key."""
    accepted = _twin_keywords(twin)
    twin_defaults = inspect.signature(twin.__init__).parameters
    for key in keys:
        if key in accepted:
            defaults[key] = given.get(key, twin_defaults[key].default)


class _AdamBase(_StrataOptimizer):
    _keys = ("exp_avg", "exp_avg_sq")

    def _state_keys(self, group):
        return self._keys + ("max_exp_avg_sq",) if group["amsgrad"] else self._keys

    def _new_state(self, group, p):
        state = super()._new_state(group, p)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def __init__(self, params, lr, betas, eps, weight_decay, amsgrad, options, num_threads,
                 cores):
        name = f"strata.optim.{type(self).__name__}"
        _check_adam_args(lr, betas, eps, weight_decay)
        given = _check_twin_options(name, self._twin, options)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        # The twin's group keys and defaults, so state_dicts match key for key.
        _add_twin_defaults(self._twin, defaults, given,
                           ("maximize", "foreach", "capturable", "differentiable", "fused"))
        _reject_unsupported(name, defaults)
        super().__init__(params, defaults, num_threads, cores)

    @staticmethod
    def _config(group):
        config = _lib.AdamWConfig()
        _lib.lib().strata_adamw_config_init(ctypes.byref(config))
        config.lr = group["lr"]
        config.beta1, config.beta2 = group["betas"]
        config.eps = group["eps"]
        config.weight_decay = group["weight_decay"]
        config.amsgrad = int(bool(group["amsgrad"]))
        config.maximize = int(bool(group.get("maximize", False)))
        return config


class _Unset:
    def __repr__(self):
        return "<torch default>"


_UNSET = _Unset()


class AdamW(_AdamBase):
    """torch.optim.AdamW on CPU tensors (Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", ICLR 2019; amsgrad: Reddi et al., ICLR 2018). Same arguments
    and state_dict as torch's, amsgrad and maximize included; foreach is accepted
    and has no effect (one fused pass per tensor either way); capturable,
    differentiable and fused=True raise ValueError. num_threads: 0 = all CPUs
    (oneTBB; with cores, one per core), n = n threads; cores: logical CPU ids to
    bind the step's threads to (strata_optimizer_options.cores; Linux). Results
    depend on neither."""

    _twin = torch.optim.AdamW
    _kind = _lib.OPTIMIZER_ADAMW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=_UNSET, foreach=_UNSET, capturable=_UNSET,
                 differentiable=_UNSET, fused=_UNSET, num_threads=0, cores=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad,
                         dict(maximize=maximize, foreach=foreach, capturable=capturable,
                              differentiable=differentiable, fused=fused),
                         num_threads, cores)


class Adam(_AdamBase):
    """torch.optim.Adam on CPU tensors (Kingma & Ba, "Adam: A Method for Stochastic
    Optimization", ICLR 2015; weight decay as L2 added to the gradient). Same
    arguments, options and state_dict rules as strata.optim.AdamW."""

    _twin = torch.optim.Adam
    _kind = _lib.OPTIMIZER_ADAM

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=_UNSET, maximize=_UNSET, capturable=_UNSET,
                 differentiable=_UNSET, fused=_UNSET, num_threads=0, cores=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad,
                         dict(maximize=maximize, foreach=foreach, capturable=capturable,
                              differentiable=differentiable, fused=fused),
                         num_threads, cores)


class Adagrad(_StrataOptimizer):
    """torch.optim.Adagrad on CPU tensors (Duchi, Hazan & Singer, "Adaptive
    Subgradient Methods for Online Learning and Stochastic Optimization", JMLR
    2011). Same arguments and state_dict as torch's: like torch, the state
    ('step', and 'sum' filled with initial_accumulator_value) is created by the
    constructor. foreach is accepted and has no effect; differentiable=True raises
    ValueError. num_threads and cores as strata.optim.AdamW."""

    _twin = torch.optim.Adagrad
    _kind = _lib.OPTIMIZER_ADAGRAD
    _keys = ("sum",)

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0,
                 eps=1e-10, foreach=None, *, maximize=_UNSET, differentiable=_UNSET,
                 num_threads=0, cores=None):
        name = "strata.optim.Adagrad"
        # The checks and messages of torch.optim.Adagrad.
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= lr_decay:
            raise ValueError(f"Invalid lr_decay value: {lr_decay}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not 0.0 <= initial_accumulator_value:
            raise ValueError(f"Invalid initial_accumulator_value value: "
                             f"{initial_accumulator_value}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        given = _check_twin_options(name, self._twin,
                                    dict(maximize=maximize, differentiable=differentiable))
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach)
        _add_twin_defaults(self._twin, defaults, given, ("maximize", "differentiable"))
        _reject_unsupported(name, defaults)
        super().__init__(params, defaults, num_threads, cores)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(self._new_state(group, p))

    def _new_state(self, group, p):
        return {"step": torch.tensor(0.0),
                "sum": torch.full_like(p, group["initial_accumulator_value"],
                                       memory_format=torch.preserve_format)}

    @staticmethod
    def _config(group):
        config = _lib.AdagradConfig()
        _lib.lib().strata_adagrad_config_init(ctypes.byref(config))
        config.lr = group["lr"]
        config.lr_decay = group["lr_decay"]
        config.weight_decay = group["weight_decay"]
        config.initial_accumulator_value = group["initial_accumulator_value"]
        config.eps = group["eps"]
        config.maximize = int(bool(group.get("maximize", False)))
        return config


class SGD(_StrataOptimizer):
    """torch.optim.SGD on CPU tensors, with momentum, dampening and Nesterov
    momentum (Sutskever et al., "On the importance of initialization and momentum
    in deep learning", ICML 2013). Same arguments and state_dict as torch's: no
    'step'; 'momentum_buffer' created from the first gradient, None when momentum
    is 0 (a buffer that exists is kept, untouched, through steps taken with
    momentum 0, as torch keeps it). foreach is accepted and has no effect;
    differentiable=True raises ValueError. num_threads and cores as strata.optim.AdamW."""

    _twin = torch.optim.SGD
    _kind = _lib.OPTIMIZER_SGD
    _counts_step = False

    def __init__(self, params, lr=_REQUIRED, momentum=0, dampening=0,
                 weight_decay=0, nesterov=False, *, maximize=_UNSET, foreach=_UNSET,
                 differentiable=_UNSET, num_threads=0, cores=None):
        name = "strata.optim.SGD"
        # The checks and messages of torch.optim.SGD.
        if lr is not _REQUIRED and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        given = _check_twin_options(
            name, self._twin, dict(maximize=maximize, foreach=foreach,
                                   differentiable=differentiable))
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        _add_twin_defaults(self._twin, defaults, given,
                           ("maximize", "foreach", "differentiable"))
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        _reject_unsupported(name, defaults)
        super().__init__(params, defaults, num_threads, cores)

    def _state_keys(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _stored_keys(self, group, state):
        # A None buffer (a step taken without momentum) is created afresh, as torch.
        if state.get("momentum_buffer") is None:
            return ()
        return self._state_keys(group)

    def _new_state(self, group, p):
        return {}

    def _advance(self, group, p, state):
        # torch: the buffer starts as a clone of the gradient (the C API's t == 1),
        # and is updated with momentum and dampening afterwards (t > 1).
        if group["momentum"] == 0:
            # torch keeps a buffer that exists, untouched, for a later step with momentum.
            return 1, ({} if state.get("momentum_buffer") is not None
                       else {"momentum_buffer": None})
        if state.get("momentum_buffer") is None:
            return 1, {"momentum_buffer": torch.empty_like(p,
                                                           memory_format=torch.preserve_format)}
        return 2, {}

    @staticmethod
    def _config(group):
        config = _lib.SgdConfig()
        _lib.lib().strata_sgd_config_init(ctypes.byref(config))
        config.lr = group["lr"]
        config.momentum = group["momentum"]
        config.dampening = group["dampening"]
        config.weight_decay = group["weight_decay"]
        config.nesterov = int(bool(group["nesterov"]))
        config.maximize = int(bool(group.get("maximize", False)))
        return config


class Lion(_StrataOptimizer):
    """Lion, EvoLved Sign Momentum (Chen et al., "Symbolic Discovery of
    Optimization Algorithms", NeurIPS 2023), with decoupled weight decay. torch.optim
    has no Lion: the constructor and state are those of the lion-pytorch package
    (lr=1e-4, betas=(0.9, 0.99), weight_decay=0; state 'exp_avg' only, no 'step'),
    plus maximize. Lion wants an lr 3-10x smaller and a weight_decay 3-10x larger
    than AdamW's. num_threads and cores as strata.optim.AdamW."""

    _kind = _lib.OPTIMIZER_LION
    _keys = ("exp_avg",)
    _counts_step = False

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 maximize=False, num_threads=0, cores=None):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not all(0.0 <= beta <= 1.0 for beta in betas):
            raise ValueError(f"Invalid betas {betas}: each must lie in [0, 1]")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, num_threads, cores)

    def _new_state(self, group, p):
        return {"exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def _advance(self, group, p, state):
        return 1, {} if state else self._new_state(group, p)  # Lion has no step count

    @staticmethod
    def _config(group):
        config = _lib.LionConfig()
        _lib.lib().strata_lion_config_init(ctypes.byref(config))
        config.lr = group["lr"]
        config.beta1, config.beta2 = group["betas"]
        config.weight_decay = group["weight_decay"]
        config.maximize = int(bool(group.get("maximize", False)))
        return config


class _SectionOptimizer(_StrataOptimizer):
    """Base of the optimizers whose state is described by the C API's state layout
    (strata_optimizer_state_layout) and stepped by strata_optimizer_step_state: each
    section is a state tensor, uint8 or float32, shaped like the parameter when it
    has one value per element, else 1-D."""

    def _stored_keys(self, group, state):
        return ()  # checked against the layout in step()

    def load_state_dict(self, state_dict):
        # torch.optim casts every state tensor to the parameter's dtype: the uint8 codes
        # are put back as they were saved (bit for bit).
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for p, i in zip(params, ids):
            saved = state_dict["state"].get(i)
            for key, value in (saved or {}).items():
                if torch.is_tensor(value) and value.dtype == torch.uint8:
                    self.state[p][key] = value.detach().to("cpu").clone().contiguous()

    def _layout(self, handle, p):
        library = _lib.lib()
        shape = (ctypes.c_int64 * max(p.dim(), 1))(*p.shape)
        sections = (_lib.StateSection * _lib.MAX_STATE_SECTIONS)()
        count = ctypes.c_int()
        _lib.check(library.strata_optimizer_state_layout(handle, shape, p.dim(), sections,
                                                         _lib.MAX_STATE_SECTIONS,
                                                         ctypes.byref(count)))
        return shape, list(sections[:count.value])

    @staticmethod
    def _section_tensor(section, p):
        dtype = torch.uint8 if section.dtype == _lib.STATE_U8 else torch.float32
        fill = section.initial_code if section.dtype == _lib.STATE_U8 else section.initial_value
        shape = p.shape if section.num_elems == p.numel() else (section.num_elems,)
        return torch.full(shape, fill, dtype=dtype)

    @torch.no_grad()
    def step(self, closure=None, *, grads=None, grad_scale=1.0, copy_out=None):
        """As strata.optim.AdamW.step (grads, grad_scale, copy_out). A parameter with
        no elements has nothing to update and no state (the C API's layout refuses a
        zero dimension): it is left out, as the offload optimizers leave it out."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be finite, got {grad_scale}")
        work = [w for w in self._collect(grads, copy_out) if w[1].numel() > 0]
        if not work:
            return loss
        library = _lib.lib()
        handle = self._get_handle()
        plan = []
        # Every group's config and every state first: nothing changes when one is wrong.
        for group, p, g, out in self._configured(handle, work):
            shape, sections = self._layout(handle, p)
            state = self.state.get(p, {})
            names = [sec.name.decode() for sec in sections]
            if state:
                for sec, key in zip(sections, names):
                    t = state.get(key)
                    want = torch.uint8 if sec.dtype == _lib.STATE_U8 else torch.float32
                    what = f"{self._name()}: state['{key}'] of a parameter of shape {tuple(p.shape)}"
                    if t is None:
                        raise ValueError(f"{what} is missing (a state_dict of another optimizer, "
                                         "or other options?)")
                    if (not torch.is_tensor(t) or t.dtype != want or t.numel() != sec.num_elems
                            or t.device.type != "cpu" or not t.is_contiguous()):
                        raise ValueError(f"{what} must be a contiguous CPU {want} tensor of "
                                         f"{sec.num_elems} elements")
                _check_disjoint(f"{self._name()}: a parameter of shape {tuple(p.shape)}",
                                {"the parameter": p, "its gradient": g, "its copy_out": out,
                                 **{f"state['{key}']": state[key] for key in names}})
                new = {}
            else:
                new = {"step": torch.tensor(0.0),
                       **{key: self._section_tensor(sec, p) for sec, key in zip(sections, names)}}
            t = int(float((state or new)["step"] + 1))  # fp32 count, as torch's
            plan.append((group, p, g, out, shape, sections, t, new))
        for group, p, g, out, shape, sections, t, new in self._configured(handle, plan):
            state = {**self.state.get(p, {}), **new}
            n = max(len(sections), 1)
            ptrs = (ctypes.c_void_p * n)(*[state[s.name.decode()].data_ptr() for s in sections])
            sizes = (ctypes.c_int64 * n)(*[s.size_bytes for s in sections])
            _lib.check(library.strata_optimizer_step_state(
                handle, t, float(grad_scale), p.data_ptr(), shape, p.dim(), ptrs, sizes,
                len(sections), g.data_ptr(), DTYPES[g.dtype],
                None if out is None else out.data_ptr(),
                _lib.DTYPE_F32 if out is None else DTYPES[out.dtype]))
            self._commit(p, new)
        return loss


class AdamW8bit(_SectionOptimizer):
    """AdamW with 8-bit block-wise quantized moments (Dettmers et al., "8-bit
    Optimizers via Block-wise Quantization", ICLR 2022): the arguments of
    torch.optim.AdamW (amsgrad is not supported) and about 2 bytes of state per
    parameter instead of 8. Each parameter is its own tensor: quantization blocks
    of 2048 elements start at its first element. state_dict per parameter: 'step',
    'exp_avg' and 'exp_avg_sq' (uint8 codes shaped like the parameter),
    'exp_avg.absmax' and 'exp_avg_sq.absmax' (fp32, one per block). num_threads and
    cores as strata.optim.AdamW."""

    _kind = _lib.OPTIMIZER_ADAMW8BIT

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 maximize=False, num_threads=0, cores=None):
        _check_adam_args(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=maximize)
        super().__init__(params, defaults, num_threads, cores)

    def _check_group(self, group):
        super()._check_group(group)
        if group.get("amsgrad", False):
            raise ValueError(f"{self._name()}: amsgrad is not supported with 8-bit state")

    @staticmethod
    def _config(group):
        return _AdamBase._config(group)


class Adafactor(_SectionOptimizer):
    """Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear
    Memory Cost", ICML 2018) with the arguments of Hugging Face transformers'
    Adafactor, except lr=None: relative_step=True uses the paper's relative step
    size, else lr is required. Parameters of >= 2 dims keep a factored second
    moment (one value per row and per column; a tensor of > 2 dims is factored as
    the (prod(shape[:-1]), shape[-1]) matrix). state_dict per parameter: 'step',
    'exp_avg_sq_row' and 'exp_avg_sq_col' (fp32 vectors) or 'exp_avg_sq' (shaped
    like the parameter), and 'exp_avg' when beta1 > 0. num_threads and cores as
    strata.optim.AdamW."""

    _kind = _lib.OPTIMIZER_ADAFACTOR

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0,
                 decay_rate=-0.8, beta1=None, weight_decay=0.0, scale_parameter=True,
                 relative_step=True, warmup_init=False, *, maximize=False, num_threads=0,
                 cores=None):
        if lr is not None and relative_step:
            raise ValueError("Cannot combine manual `lr` and `relative_step=True` options")
        if warmup_init and not relative_step:
            raise ValueError("`warmup_init=True` requires `relative_step=True`")
        if lr is None and not relative_step:
            raise ValueError("lr is required without relative_step")
        defaults = dict(lr=lr, eps=tuple(eps), clip_threshold=clip_threshold,
                        decay_rate=decay_rate, beta1=beta1, weight_decay=weight_decay,
                        scale_parameter=scale_parameter, relative_step=relative_step,
                        warmup_init=warmup_init, maximize=maximize)
        super().__init__(params, defaults, num_threads, cores)
        self._get_handle()  # bad hyper-parameters fail here

    @staticmethod
    def _config(group):
        config = _lib.AdafactorConfig()
        _lib.lib().strata_adafactor_config_init(ctypes.byref(config))
        if group["lr"] is not None:
            config.lr = group["lr"]
        config.eps1, config.eps2 = group["eps"]
        config.clip_threshold = group["clip_threshold"]
        config.decay_rate = group["decay_rate"]
        config.beta1 = group["beta1"] or 0.0
        config.weight_decay = group["weight_decay"]
        config.relative_step = int(bool(group["relative_step"]))
        config.scale_parameter = int(bool(group["scale_parameter"]))
        config.warmup_init = int(bool(group["warmup_init"]))
        config.maximize = int(bool(group.get("maximize", False)))
        return config
