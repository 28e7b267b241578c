"""Everything megatron-core needs to run on a CPU-only torch build, in one place.

Megatron-core is written for CUDA. On a machine without a GPU (laptops, CI, this project's test
machines) it still imports, builds models, runs forward/backward at any TP/PP layout on gloo, but a
handful of CUDA-only calls stand in the way. `apply()` removes exactly those, and nothing else:

==============================================  =================================================
what megatron does                              what `apply()` changes (only without CUDA)
==============================================  =================================================
`pipeline_parallel/schedules.py` imports        register a stub for
`transformer/moe/ops/paged_stash.py`, the only  `megatron.core.transformer.moe.ops.paged_stash`
module that needs `triton` (~1 GB, GPU only)    in `sys.modules` (only when triton is missing)
~200 allocations on `torch.cuda.current_device` `torch.cuda.current_device()` returns the CPU
(RoPE `inv_freq`, memory buffer, p2p shapes)    device instead of raising
the tensor-parallel RNG tracker saves/restores  the tracker class keeps CPU generator states
CUDA generator states                           (same seeds, same fork semantics)
literal `device="cuda"`, `torch.cuda.synchronize`  those modules see a `torch` whose factory
`torch.cuda.current_stream()` in schedules, DDP,  functions map "cuda" to "cpu" and whose
optimizer, grad clipping, dist_checkpointing    `torch.cuda` stream/sync calls are no-ops
`weight.data.cuda()` when tied embeddings are   `Tensor.cuda()` is the identity while that one
synchronised across pipeline stages             method runs
grad clipping asserts `torch.cuda.FloatTensor`  a CPU version of `clip_grad_by_total_norm_fp32`
bf16 training: the mixed-precision optimizer   while its constructor runs, `Tensor.type()` names a
sorts parameters by `param.type()`, CUDA names  CPU float tensor by its CUDA name
only (`torch.cuda.BFloat16Tensor`)
the MoE `alltoall` token dispatcher (EP > 1)    its stream attribute is a no-op stream, and its
makes a CUDA stream when built, and copies its  split sizes become host arrays where its CUDA
split sizes to host arrays on that stream       path copies them (no stream, no event)
==============================================  =================================================

Every change is scoped to the megatron modules named here (except `current_device`, which megatron
calls from too many places to list; without CUDA it could only have raised). `apply()` is idempotent
and does nothing on a machine with CUDA, so GPU runs execute megatron's own code unchanged.

Call `apply()` before the first `import megatron.core` (the triton stub must be in place first);
every module of this package that imports megatron does so through `import_megatron()`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
import types
from typing import Any, Callable, Iterator, List

import torch

_APPLIED = False
_PATCHES: List[str] = []  # names of the patches in effect, for tests and logs

# The megatron modules that spell "cuda" literally or call CUDA streams/synchronisation on the paths
# we use (forward/backward schedules, p2p, DDP grad sync, optimizer, grad clipping, checkpoints).
_MODULES_WITH_LITERAL_CUDA = (
    "megatron.core.utils",
    "megatron.core.transformer.utils",  # get_default_causal_mask (attention_mask=None)
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def applied_patches() -> List[str]:
    """The patches `apply()` installed in this process (empty on a CUDA machine)."""
    return list(_PATCHES)


def apply() -> None:
    """Make megatron-core usable on this machine. Idempotent; a no-op where CUDA is available."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    _stub_triton_only_module()
    if cuda_available():
        return
    _current_device_is_cpu()
    import megatron.core  # noqa: F401  (after the stub; the patches below need the modules loaded)

    _cpu_rng_tracker()
    _cpu_torch_in_modules_with_literal_cuda()
    _tied_embedding_sync_stays_on_cpu()
    _cpu_grad_clipping()
    _mixed_precision_optimizer_takes_cpu_params()
    _alltoall_token_dispatcher_on_cpu()


def import_megatron() -> types.ModuleType:
    """`import megatron.core` after `apply()`; the one way this package imports megatron first."""
    apply()
    return importlib.import_module("megatron.core")


# --------------------------------------------------------------------------------------------
# 1. triton: only the MoE paged-stash kernels need it, yet `pipeline_parallel.schedules` imports
#    them unconditionally (schedules -> transformer/moe/paged_stash.py -> moe/ops/paged_stash.py).
#    A stub with the same names lets the import chain finish; calling a kernel raises.
# --------------------------------------------------------------------------------------------
def _stub_triton_only_module() -> None:
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return

    def _needs_triton(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("MoE paged stash needs triton, which is not installed")

    stub = types.ModuleType(name, "stub installed by hacpo_megatron.megatron_cpu (no triton)")
    stub.GLOBAL_BLOCK_SIZE = 1024  # the value of the real module, read at import time
    stub.paged_stash_copy_kernel = _needs_triton
    stub.paged_stash_pop_kernel = _needs_triton
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[name] = stub
    _PATCHES.append("triton-stub:" + name)


# --------------------------------------------------------------------------------------------
# 2. torch.cuda.current_device(): megatron allocates on it everywhere (`device=torch.cuda.
#    current_device()`), e.g. RotaryEmbedding.inv_freq, GlobalMemoryBuffer, p2p shape tensors.
#    Without CUDA the call raises; returning the CPU device turns those allocations into CPU ones.
# --------------------------------------------------------------------------------------------
def _current_device_is_cpu() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    _PATCHES.append("torch.cuda.current_device->cpu")


# --------------------------------------------------------------------------------------------
# 3. The tensor-parallel RNG tracker (tensor_parallel/random.py: CudaRNGStatesTracker) keeps named
#    CUDA generator states ("model-parallel-rng" differs per TP rank, "data-parallel-rng" per DP
#    group) and `fork()`s into them around dropout/initialisation. On CPU the tensors live on the
#    CPU generator, so the same bookkeeping is done with CPU generator states.
#    `model_parallel_cuda_manual_seed` also calls `torch.cuda.manual_seed`, a lazy no-op here.
# --------------------------------------------------------------------------------------------
def _cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """`CudaRNGStatesTracker` over the CPU generator: same names, seeds and fork semantics."""

        def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)

    # initialize_rng_tracker() instantiates the class through this module-level name; subclassing keeps
    # get_all_rng_states()' isinstance check true.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)
    _PATCHES.append("rng-tracker->cpu")


# --------------------------------------------------------------------------------------------
# 4. Literal CUDA in a few modules: `torch.zeros(..., device="cuda")` (schedules' token counter,
#    FP32Optimizer, clip_grads, utils.local_multi_tensor_l2_norm, the default causal mask), `torch.cuda.synchronize()`
#    (p2p, DDP, dist_checkpointing writers), `torch.cuda.current_stream()` (DDP grad buckets).
#    Each such module gets its own `torch` name bound to a thin view of torch that maps
#    device "cuda" to "cpu" and makes stream/synchronise calls no-ops; all else is torch itself.
# --------------------------------------------------------------------------------------------
class _NoOpStream:
    """What `torch.cuda.current_stream()` returns on CPU: CPU ops are already ordered."""

    def wait_stream(self, _other: Any) -> None:
        pass

    def wait_event(self, _event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, _event: Any = None) -> None:
        return None


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as seen by the patched modules."""

    def __init__(self) -> None:
        super().__init__("torch.cuda (cpu view)")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(_device: Any = None) -> None:
        pass

    @staticmethod
    def current_stream(_device: Any = None) -> _NoOpStream:
        return _NoOpStream()


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int):  # a CUDA ordinal
        return "cpu"
    return device


def _with_cpu_device(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return wrapper


class _CpuTorch(types.ModuleType):
    """`torch` as seen by the patched modules: identical except for CUDA devices and streams."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like",
                  "empty_like", "full_like", "randn", "rand")

    def __init__(self) -> None:
        super().__init__("torch (cpu view)")
        self.cuda = _CpuCuda()
        for name in self._FACTORIES:
            setattr(self, name, _with_cpu_device(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cpu_torch_in_modules_with_literal_cuda() -> None:
    cpu_torch = _CpuTorch()
    for module_name in _MODULES_WITH_LITERAL_CUDA:
        module = importlib.import_module(module_name)
        if getattr(module, "torch", None) is torch:
            module.torch = cpu_torch
            _PATCHES.append("cpu-torch-view:" + module_name)


# --------------------------------------------------------------------------------------------
# 5. Tied embeddings with PP > 1: LanguageModule.setup_embeddings_and_output_layer moves the
#    output-layer copy with `weight.data = weight.data.cuda()` before all-reducing it over the
#    embedding group. On CPU it stays where it is.
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _tensor_method_replaced(name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """`torch.Tensor.<name>` is `replacement(original, self, *args, **kwargs)` inside the block."""
    original = getattr(torch.Tensor, name)
    setattr(torch.Tensor, name, lambda self, *args, **kwargs: replacement(original, self, *args, **kwargs))
    try:
        yield
    finally:
        setattr(torch.Tensor, name, original)


def _run_within(cls: type, method: str, context: Callable[[], Any], patch_name: str) -> None:
    """`cls.<method>` runs inside `context()`, and nothing else changes."""
    original = getattr(cls, method)

    @functools.wraps(original)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with context():
            return original(self, *args, **kwargs)

    setattr(cls, method, wrapped)
    _PATCHES.append(patch_name)


def _tensor_cuda_is_identity() -> Any:
    return _tensor_method_replaced("cuda", lambda original, self, *args, **kwargs: self)


def _tied_embedding_sync_stays_on_cpu() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _run_within(LanguageModule, "setup_embeddings_and_output_layer", _tensor_cuda_is_identity,
                "tied-embedding-sync->cpu")


# --------------------------------------------------------------------------------------------
# 6. Gradient clipping: optimizer/clip_grads.py:clip_grad_by_total_norm_fp32 asserts
#    `param.grad.type() == 'torch.cuda.FloatTensor'`. The CPU version scales the same grads by the
#    same coefficient. (The norm itself, get_grad_norm_fp32, works through the torch view of 4.)
# --------------------------------------------------------------------------------------------
def _cpu_grad_clipping() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    def clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                     use_decoupled_grad: bool = False) -> None:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attribute = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attribute) for p in parameters if getattr(p, attribute, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff = clip_coeff.clamp_max(1.0)
        elif clip_coeff >= 1.0:
            return
        for grad in grads:
            grad.detach().mul_(clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    _PATCHES.append("clip-grad-by-total-norm->cpu")


# --------------------------------------------------------------------------------------------
# 7. bf16 training (train.params_dtype: bf16): Float16OptimizerWithFloat16Params keeps an fp32 main
#    copy of every bf16 parameter, and sorts the parameters by `param.type()` against the CUDA type
#    names only, refusing anything else. While its constructor runs, a CPU float tensor's `type()`
#    answers with the CUDA name of the same dtype; everything after (main-param copies, Adam on the
#    fp32 copies, copying back to bf16) is plain torch and runs on CPU as it is.
# --------------------------------------------------------------------------------------------
_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _cuda_type_name(original: Callable[..., Any], self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    name = original(self, *args, **kwargs)
    return _CUDA_TYPE_NAMES.get(name, name) if not args and not kwargs else name


def _mixed_precision_optimizer_takes_cpu_params() -> None:
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    _run_within(Float16OptimizerWithFloat16Params, "__init__", lambda: _tensor_method_replaced("type", _cuda_type_name),
                "mixed-precision-optimizer->cpu-params")


# --------------------------------------------------------------------------------------------
# 8. The MoE `alltoall` token dispatcher (models/architectures.moe_config_settings: at EP > 1).
#    `MoEAlltoAllTokenDispatcher.__init__` makes a class-wide `torch.cuda.Stream()` for its
#    device-to-host copies, and `_maybe_dtoh_and_synchronize` copies the all-to-all's split sizes
#    (input_splits, output_splits, output_splits_tp) to numpy arrays on that stream and waits on an
#    event. On a CPU the stream is a no-op one and the split sizes, already host tensors (megatron's
#    copy leaves them tensors there), become the numpy arrays its CUDA path hands the all-to-all.
# --------------------------------------------------------------------------------------------
def _alltoall_token_dispatcher_on_cpu() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoOpStream()  # __init__ makes a CUDA stream only while None

    def _maybe_dtoh_and_synchronize(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize
    _PATCHES.append("alltoall-token-dispatcher->cpu")
