"""Loading libstrata.so and the ctypes prototypes of include/strata/strata.h.

The library is loaded once, on first use, from (in this order):
  1. the path in the STRATA_LIBRARY environment variable (an error if it does not
     load: an explicit choice never silently falls back);
  2. libstrata.so.0 or libstrata.so in this package's directory;
  3. libstrata.so.0 on the system library path (dlopen's search: LD_LIBRARY_PATH,
     the ldconfig cache, /usr/lib ...).
"""

import ctypes
import ctypes.util
import os
import threading

# The C API major version this package speaks (STRATA_VERSION_MAJOR), and the
# minor version that has every function declared below.
ABI_MAJOR = 0
ABI_MINOR = 4

# strata_dtype
DTYPE_F32 = 0
DTYPE_F16 = 1
DTYPE_BF16 = 2

# strata_status
STATUS_OK = 0
STATUS_FAILED_PRECONDITION = 9
STATUS_NAMES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS")

# strata_optimizer_kind
OPTIMIZER_ADAMW = 1
OPTIMIZER_ADAM = 2
OPTIMIZER_ADAGRAD = 3
OPTIMIZER_LION = 4
OPTIMIZER_SGD = 5
OPTIMIZER_ADAMW8BIT = 6
OPTIMIZER_ADAFACTOR = 7

# strata_state_dtype
STATE_F32 = 0
STATE_U8 = 1
MAX_STATE_SECTIONS = 8

# strata_offload_device
OFFLOAD_CPU = 0
OFFLOAD_NVME = 1


class StrataError(RuntimeError):
    """A non-OK strata_status; .status is its name ("INVALID_ARGUMENT", ...), the
    message is strata_last_error()."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class AdamWConfig(ctypes.Structure):
    """strata_adamw_config."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("bias_correction", ctypes.c_int),
        ("amsgrad", ctypes.c_int),
        ("maximize", ctypes.c_int),
    ]


class AdagradConfig(ctypes.Structure):
    """strata_adagrad_config."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("lr", ctypes.c_float),
        ("lr_decay", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("initial_accumulator_value", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("maximize", ctypes.c_int),
    ]


class LionConfig(ctypes.Structure):
    """strata_lion_config."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("maximize", ctypes.c_int),
    ]


class SgdConfig(ctypes.Structure):
    """strata_sgd_config."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("lr", ctypes.c_float),
        ("momentum", ctypes.c_float),
        ("dampening", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("nesterov", ctypes.c_int),
        ("maximize", ctypes.c_int),
    ]


class AdafactorConfig(ctypes.Structure):
    """strata_adafactor_config."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("lr", ctypes.c_float),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("clip_threshold", ctypes.c_float),
        ("decay_rate", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("relative_step", ctypes.c_int),
        ("scale_parameter", ctypes.c_int),
        ("warmup_init", ctypes.c_int),
        ("maximize", ctypes.c_int),
    ]


class StateSection(ctypes.Structure):
    """strata_state_section."""
    _fields_ = [
        ("name", ctypes.c_char * 48),
        ("dtype", ctypes.c_int),
        ("num_elems", ctypes.c_int64),
        ("size_bytes", ctypes.c_int64),
        ("initial_value", ctypes.c_float),
        ("initial_code", ctypes.c_int),
    ]


class OptimizerOptions(ctypes.Structure):
    """strata_optimizer_options."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_threads", ctypes.c_int),
        ("cores", ctypes.POINTER(ctypes.c_int)),
        ("num_cores", ctypes.c_int),
    ]


class GradStats(ctypes.Structure):
    """strata_grad_stats."""
    _fields_ = [
        ("sum_squares", ctypes.c_double),
        ("nonfinite", ctypes.c_int),
        ("num_elems", ctypes.c_int64),
    ]


class OffloadOptions(ctypes.Structure):
    """strata_offload_options."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("device", ctypes.c_int),
        ("nvme_paths", ctypes.POINTER(ctypes.c_char_p)),
        ("num_nvme_paths", ctypes.c_int),
        ("num_threads", ctypes.c_int),
        ("buffer_count", ctypes.c_int),
        ("staging_buffers", ctypes.c_int),
        ("pin_memory", ctypes.c_int),
        ("io_backend", ctypes.c_char_p),
    ]


class OffloadStepOptions(ctypes.Structure):
    """strata_offload_step_options."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("max_grad_norm", ctypes.c_double),
        ("loss_scale", ctypes.c_float),
    ]


class OffloadStepResult(ctypes.Structure):
    """strata_offload_step_result."""
    _fields_ = [
        ("grad_norm", ctypes.c_double),
        ("skipped", ctypes.c_int),
        ("micro_batches", ctypes.c_int),
    ]


class OffloadStats(ctypes.Structure):
    """strata_offload_stats."""
    _fields_ = [
        ("steps", ctypes.c_int64),
        ("skipped_steps", ctypes.c_int64),
        ("nvme_bytes_read", ctypes.c_uint64),
        ("nvme_bytes_written", ctypes.c_uint64),
        ("update_seconds", ctypes.c_double),
        ("wait_seconds", ctypes.c_double),
        ("host_state_bytes", ctypes.c_uint64),
    ]


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


_lock = threading.Lock()
_lib = None
_path = None


def _candidates():
    """(how it was found, name or path) in lookup order."""
    env = os.environ.get("STRATA_LIBRARY")
    if env:
        return [("STRATA_LIBRARY", env)]
    here = os.path.dirname(os.path.abspath(__file__))
    found = [("beside the package", os.path.join(here, name))
             for name in ("libstrata.so.0", "libstrata.so")
             if os.path.exists(os.path.join(here, name))]
    found.append(("system library path", "libstrata.so.0"))
    system = ctypes.util.find_library("strata")
    if system and system != "libstrata.so.0":
        found.append(("system library path", system))
    return found


def _declare(lib):
    c_int, c_int64, c_float, c_void_p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    c_char_p, c_size_t = ctypes.c_char_p, ctypes.c_size_t
    float_p = ctypes.POINTER(ctypes.c_float)
    protos = {
        "strata_version": (c_char_p, []),
        "strata_version_number": (c_int, []),
        "strata_status_name": (c_char_p, [c_int]),
        "strata_last_error": (c_char_p, []),
        "strata_dtype_size": (c_size_t, [c_int]),
        "strata_kernel_name": (c_char_p, []),
        "strata_adamw_config_init": (None, [ctypes.POINTER(AdamWConfig)]),
        "strata_adagrad_config_init": (None, [ctypes.POINTER(AdagradConfig)]),
        "strata_lion_config_init": (None, [ctypes.POINTER(LionConfig)]),
        "strata_sgd_config_init": (None, [ctypes.POINTER(SgdConfig)]),
        "strata_adafactor_config_init": (None, [ctypes.POINTER(AdafactorConfig)]),
        "strata_optimizer_options_init": (None, [ctypes.POINTER(OptimizerOptions)]),
        "strata_optimizer_create": (
            c_int, [c_int, c_void_p, ctypes.POINTER(OptimizerOptions), ctypes.POINTER(c_void_p)]),
        "strata_optimizer_destroy": (None, [c_void_p]),
        "strata_optimizer_set_config": (c_int, [c_void_p, c_void_p]),
        "strata_optimizer_num_state": (c_int, [c_void_p]),
        "strata_optimizer_step": (
            c_int, [c_void_p, c_int64, c_float, c_void_p, ctypes.POINTER(c_void_p), c_int,
                    c_void_p, c_int, c_void_p, c_int, c_int64]),
        "strata_optimizer_state_layout": (
            c_int, [c_void_p, ctypes.POINTER(c_int64), c_int, ctypes.POINTER(StateSection), c_int,
                    ctypes.POINTER(c_int)]),
        "strata_optimizer_init_state": (
            c_int, [c_void_p, ctypes.POINTER(c_int64), c_int, ctypes.POINTER(c_void_p), c_int]),
        "strata_optimizer_step_state": (
            c_int, [c_void_p, c_int64, c_float, c_void_p, ctypes.POINTER(c_int64), c_int,
                    ctypes.POINTER(c_void_p), ctypes.POINTER(c_int64), c_int, c_void_p, c_int,
                    c_void_p, c_int]),
        "strata_grad_stats_compute": (
            c_int, [c_void_p, c_int, c_int64, c_float, ctypes.POINTER(GradStats)]),
        "strata_grad_accumulate": (
            c_int, [float_p, c_void_p, c_int, c_int64, c_int, ctypes.POINTER(GradStats)]),
        "strata_convert_from_f32": (c_int, [c_void_p, c_void_p, c_int, c_int64]),
        "strata_convert_to_f32": (c_int, [c_void_p, c_int, c_void_p, c_int64]),
        # Offload optimizer (strata_offload*: an opaque handle, passed as c_void_p).
        "strata_offload_options_init": (None, [ctypes.POINTER(OffloadOptions)]),
        "strata_offload_choose_device": (c_int, [ctypes.c_uint64, c_int, ctypes.POINTER(c_int)]),
        "strata_offload_create": (
            c_int, [ctypes.POINTER(OffloadOptions), ctypes.POINTER(c_void_p)]),
        "strata_offload_destroy": (None, [c_void_p]),
        "strata_offload_add_group": (c_int, [c_void_p, c_int, c_void_p, ctypes.POINTER(c_int)]),
        "strata_offload_set_group_config": (c_int, [c_void_p, c_int, c_void_p]),
        "strata_offload_get_group_step": (c_int, [c_void_p, c_int, ctypes.POINTER(c_int64)]),
        "strata_offload_set_group_step": (c_int, [c_void_p, c_int, c_int64]),
        "strata_offload_add_bucket": (
            c_int, [c_void_p, c_int, c_int, ctypes.POINTER(c_void_p), ctypes.POINTER(c_int64),
                    c_int, ctypes.POINTER(c_int)]),
        "strata_offload_bucket_num_elems": (c_int64, [c_void_p, c_int]),
        "strata_offload_add_bucket_shaped": (
            c_int, [c_void_p, c_int, c_int, ctypes.POINTER(c_void_p), ctypes.POINTER(c_int64),
                    ctypes.POINTER(ctypes.POINTER(c_int64)), ctypes.POINTER(c_int), c_int,
                    ctypes.POINTER(c_int)]),
        "strata_offload_state_section": (
            c_int, [c_void_p, c_int, c_int, ctypes.POINTER(StateSection)]),
        "strata_offload_segment_state_range": (
            c_int, [c_void_p, c_int, c_int, c_int, ctypes.POINTER(c_int64),
                    ctypes.POINTER(c_int64)]),
        "strata_offload_read_state_bytes": (c_int, [c_void_p, c_int, c_int, c_void_p, c_int64]),
        "strata_offload_write_state_bytes": (c_int, [c_void_p, c_int, c_int, c_void_p, c_int64]),
        "strata_offload_acquire_staging": (
            c_int, [c_void_p, c_int, c_int, ctypes.POINTER(c_void_p)]),
        "strata_offload_submit_grad": (
            c_int, [c_void_p, c_int, c_int, c_void_p, c_int, c_int64, c_void_p]),
        "strata_offload_wait_grads": (c_int, [c_void_p]),
        "strata_offload_discard_grads": (c_int, [c_void_p]),
        "strata_offload_step_options_init": (None, [ctypes.POINTER(OffloadStepOptions)]),
        "strata_offload_step": (
            c_int, [c_void_p, ctypes.POINTER(OffloadStepOptions),
                    ctypes.POINTER(OffloadStepResult)]),
        "strata_offload_wait_bucket": (c_int, [c_void_p, c_int]),
        "strata_offload_synchronize": (c_int, [c_void_p]),
        "strata_offload_bucket_num_state": (c_int, [c_void_p, c_int]),
        "strata_offload_tensor_name": (c_char_p, [c_void_p, c_int, c_int]),
        "strata_offload_read_state": (c_int, [c_void_p, c_int, c_int, float_p, c_int64]),
        "strata_offload_write_state": (c_int, [c_void_p, c_int, c_int, float_p, c_int64]),
        "strata_offload_reload_masters": (c_int, [c_void_p, c_int]),
        "strata_offload_save": (c_int, [c_void_p, c_char_p]),
        "strata_offload_load": (c_int, [c_void_p, c_char_p]),
        "strata_offload_get_stats": (c_int, [c_void_p, ctypes.POINTER(OffloadStats)]),
    }
    for name, (restype, argtypes) in protos.items():
        # A library older than ABI_MINOR lacks some: the version check after this
        # reports it; a call of a missing function is an AttributeError.
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.restype = restype
        fn.argtypes = argtypes


def _loaded_file(lib, fallback):
    """The file dlopen actually mapped (dladdr of a symbol), else fallback."""
    try:
        libc = ctypes.CDLL(None)
        info = _DlInfo()
        addr = ctypes.cast(lib.strata_version, ctypes.c_void_p)
        if libc.dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(os.fsdecode(info.dli_fname))
    except (OSError, AttributeError):
        pass
    return fallback


def lib():
    """The loaded libstrata (ctypes.CDLL), loading it on first use."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        errors = []
        for how, name in _candidates():
            try:
                candidate = ctypes.CDLL(name)
            except OSError as e:
                errors.append(f"  {how}: {name}: {e}")
                if how == "STRATA_LIBRARY":
                    break
                continue
            _declare(candidate)
            number = candidate.strata_version_number()
            if number // 10000 != ABI_MAJOR or (number // 100) % 100 < ABI_MINOR:
                errors.append(
                    f"  {how}: {name}: libstrata {candidate.strata_version().decode()} is not "
                    f"compatible with this package (needs {ABI_MAJOR}.x, x >= {ABI_MINOR})")
                if how == "STRATA_LIBRARY":
                    break
                continue
            _path = _loaded_file(candidate, name)
            _lib = candidate
            return _lib
        raise OSError(
            "strata: could not load libstrata.so; tried:\n" + "\n".join(errors) +
            "\nBuild it (cmake --build build/release --target strata_shared) and set "
            "STRATA_LIBRARY=/path/to/libstrata.so, or install it (cmake --install).")


def library_path():
    """Absolute path of the libstrata.so file in use (loads it if needed)."""
    lib()
    return _path


def library_version():
    """strata_version() of the loaded library, e.g. "0.1.0"."""
    return lib().strata_version().decode()


def kernel_name():
    """The CPU kernel variant in use: "avx512", "avx2" or "generic"."""
    return lib().strata_kernel_name().decode()


def check(status):
    """Raises StrataError for a non-OK strata_status."""
    if status != STATUS_OK:
        name = STATUS_NAMES[status] if 0 <= status < len(STATUS_NAMES) else f"status {status}"
        raise StrataError(name, lib().strata_last_error().decode(errors="replace"))
