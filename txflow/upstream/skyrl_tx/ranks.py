"""What every rank process gets before upstream's entry point runs: txflow's checkpoint I/O (`rank0-checkpoint-io`,
`adapter-state-program`), the default SIGTERM action after `jax.distributed.initialize` (`default-sigterm`), Tinker's
losses (`tinker-losses`), the compilation cache written by every rank (`compilation-cache`), loss chunks sized to the
batch (`loss-chunks`), each example's own adapter in every LoRA linear layer (`lora-per-example`), the model code of
`models` (`tied-head-from-arguments`, `scanned-layers`), sampling prompts in one length bucket (`sampling-buckets`),
the optimizer's compile in the log, and each model's optimizer step confined to its own slot (`optimizer-own-slot`);
`run` imports upstream without torch (`rank-imports`)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import threading
import types

from txflow.upstream.skyrl_tx import losses, models
from txflow.upstream.skyrl_tx.checkpoint_io import adapter_state_in_one_program, install_checkpoint_io


def default_sigterm_after_distributed_init() -> None:
    """Make `jax.distributed.initialize` give SIGTERM its default action back (`default-sigterm`)."""
    import signal

    import jax

    initialize = jax.distributed.initialize

    def initialize_then_default_sigterm(*args, **kwargs):
        initialize(*args, **kwargs)
        # A kernel-level action: it stops the rank also while its main thread waits in a collective.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    jax.distributed.initialize = initialize_then_default_sigterm


def compilation_cache_written_by_every_rank() -> None:
    """Let ranks > 0 write their programs to the persistent compilation cache, as rank 0 does (`compilation-cache`)."""
    import warnings

    from jax._src import compilation_cache, compiler, config, distributed

    write = compiler._cache_write

    def write_on_every_rank(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if distributed.global_state.process_id == 0:
            return write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        # JAX's own conditions, without its "process 0 only"; a rank's keys are its own, so no two
        # ranks write one entry.
        if host_callbacks or compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as error:  # a cache that cannot be written costs time, never the run
            warnings.warn(f"txflow: compilation cache entry for {module_name!r} not written: "
                          f"{type(error).__name__}: {error}", stacklevel=2)

    compiler._cache_write = write_on_every_rank


def balanced_chunk(tokens: int, chunk_size: int) -> int:
    """The chunk size that covers `tokens` in as many chunks as `chunk_size` needs, as evenly as possible:
    the memory bound stays (never above `chunk_size`) and the padding is below one token per chunk (`loss-chunks`)."""
    chunks = -(-tokens // chunk_size)
    return -(-tokens // chunks)


def loss_chunks_fit_the_batch() -> None:
    """Upstream's chunked logprobs pad a batch's tokens to a multiple of `loss_chunk_size` (`loss-chunks`)."""
    from tx.utils.logits_processor import LogitsProcessorMixin

    upstream = LogitsProcessorMixin._compute_chunked_logprobs

    def _compute_chunked_logprobs(self, hidden_states, target_ids, chunk_size, adapter_indices):
        tokens = hidden_states.shape[0] * hidden_states.shape[1]  # static at trace time
        return upstream(self, hidden_states, target_ids, balanced_chunk(tokens, chunk_size), adapter_indices)

    LogitsProcessorMixin._compute_chunked_logprobs = _compute_chunked_logprobs


def lora_per_example(self, x, base_output, adapter_indices):
    """A LoRA linear layer's output with each example's own adapter (`lora-per-example`): its A and B gathered by the
    example's adapter index, then two small matmuls. Upstream sorts the tokens by adapter and runs `ragged_dot` against
    every adapter slot, which XLA on CPU computes densely for all `max_lora_adapters` of them."""
    import jax.numpy as jnp

    if self.max_lora_adapters == 0 or adapter_indices is None:
        return base_output
    batch, seq_len = x.shape[:2]
    down = jnp.einsum("bti,bir->btr", x.reshape(batch, seq_len, -1), self.lora_A[...][adapter_indices])
    out = jnp.einsum("btr,bro->bto", down, self.lora_B[...][adapter_indices])
    out = out * self.lora_scaling[...][adapter_indices, None, None]
    return base_output + out.reshape(base_output.shape).astype(base_output.dtype)


def lora_computes_each_examples_adapter() -> None:
    """Every LoRA linear layer computes each example's adapter only (`lora-per-example`); embeddings and experts stay
    upstream's."""
    from tx.layers.lora import LoRALinear

    LoRALinear.apply_lora = lora_per_example


def optimizer_compile_logged() -> None:
    """The first optimizer step of the process (the one that compiles its program) is logged as upstream logs
    its train and sample compiles, so that the run can say what it waits for (`txflow.cluster.compiles`)."""
    import time

    from tx.tinker.backends.jax import JaxBackendImpl
    from tx.utils.log import logger

    upstream = JaxBackendImpl.optim_step

    # The rank-0 wrapper serialises a broadcast call's arguments by the method's annotations (and the workers
    # read them back so): `wraps` keeps upstream's.
    @functools.wraps(upstream)
    def optim_step(self, model_id, request_data):
        nothing_to_apply = model_id in self.models and int(
            self.accumulated_grads.counts[self.models[model_id].adapter_index]) == 0  # upstream skips the step
        if getattr(JaxBackendImpl, "_txflow_optimizer_compiled", False) or nothing_to_apply:
            return upstream(self, model_id, request_data)
        logger.info("JIT compiling for optimizer seq_len=0 in progress...")
        began = time.monotonic()
        result = upstream(self, model_id, request_data)
        JaxBackendImpl._txflow_optimizer_compiled = True
        logger.info(f"JIT compilation for optimizer seq_len=0 took {time.monotonic() - began:.2f}s")
        return result

    JaxBackendImpl.optim_step = optim_step


def optimizer_steps_only_its_own_slot() -> None:
    """Upstream gives each model an `nnx.Optimizer` over the LoRA weights of every slot, so AdamW's weight decay
    (`lr * weight_decay * w`, applied to every parameter it covers) shrank every other run's adapter on the
    cluster at each of this model's steps: a neighbour's `optim_step` with `weight_decay > 0` reached another run's
    weights. Here the step writes only its own slot back (`optimizer-own-slot`); the others keep their values bit
    for bit. Its own slot's update is upstream's, and the optimizer's state keeps its shape (its checkpoints too).
    With `weight_decay = 0` nothing changes: Adam's update of a slot without gradients is 0 there."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tx.tinker.backends.jax import JaxBackendImpl

    upstream = JaxBackendImpl._create_loss_and_grad_fn
    if getattr(upstream, "txflow", False):
        return

    @functools.wraps(upstream)
    def create_loss_and_grad_fn(self):
        upstream(self)
        step = self._compute_grads_and_update
        step = getattr(step, "__wrapped__", step)  # nnx.jit's function (the eager one as it is)
        slots = self.config.max_lora_adapters

        def keep_other_slots(before, after, adapter_index):
            if after.shape[0] != slots:  # every LoRA weight is stacked by slot on its first axis
                raise ValueError(f"a LoRA weight of shape {after.shape} is not stacked by slot ({slots} slots)")
            mine = (jnp.arange(slots) == adapter_index).reshape((slots,) + (1,) * (after.ndim - 1))
            return jnp.where(mine, after, before)

        def compute_grads_and_update(accumulated_grads, lora_params, optimizer, adapter_index):
            before = nnx.as_pure(lora_params)
            result = step(accumulated_grads, lora_params, optimizer, adapter_index)
            nnx.update(lora_params, jax.tree.map(lambda b, a: keep_other_slots(b, a, adapter_index), before,
                                                 nnx.as_pure(lora_params)))
            return result

        self._compute_grads_and_update = (compute_grads_and_update if self.config.enforce_eager
                                          else nnx.jit(compute_grads_and_update))

    create_loss_and_grad_fn.txflow = True
    JaxBackendImpl._create_loss_and_grad_fn = create_loss_and_grad_fn


# Every sampling batch's prompts are padded to at least this many tokens (`sampling-buckets`).
SAMPLE_BUCKET_FLOOR = 64


def sample_prompts_share_a_bucket(floor: int = SAMPLE_BUCKET_FLOOR) -> None:
    """Sampling pads its prompts to upstream's length buckets (32, 48, 64, ...), and each bucket is a program of its
    own: a run's readiness sample (32), its held-out prompts (48) and its sequences' logprobs (64) compiled three
    sampling programs of 12-25 s each for SmolLM2. Prompts shorter than `floor` share one bucket (`sampling-buckets`);
    the prefill of a few padded positions costs far less than a compile. Training keeps its own buckets. Can go when
    upstream compiles fewer sampling shapes."""
    from tx.tinker.backends import jax as backend

    upstream_sample, upstream_round = backend.JaxBackendImpl.sample, backend.round_up_seq_len

    @functools.wraps(upstream_sample)  # its annotations serialise the broadcast call (see above)
    def sample(self, prepared_batch):
        backend.round_up_seq_len = lambda length: upstream_round(max(length, floor))
        try:
            return upstream_sample(self, prepared_batch)
        finally:
            backend.round_up_seq_len = upstream_round  # the engine serves one batch at a time

    backend.JaxBackendImpl.sample = sample


def install() -> None:
    """Every change a rank gets in upstream's backend and model code (also what a benchmark of the engine in
    one process installs, so that it measures what the ranks run)."""
    install_checkpoint_io()
    adapter_state_in_one_program()
    default_sigterm_after_distributed_init()
    compilation_cache_written_by_every_rank()
    losses.install_backend()
    loss_chunks_fit_the_batch()
    lora_computes_each_examples_adapter()
    models.install()
    optimizer_compile_logged()
    optimizer_steps_only_its_own_slot()
    sample_prompts_share_a_bucket()


class DeferredModule(types.ModuleType):
    """A module that imports the real one at its first attribute access, as `import name` would have."""

    _lock = threading.Lock()

    def __getattr__(self, attr: str):
        with self._lock:  # the engine's threads may reach it together
            real = self.__dict__.get("_real")
            if real is None:
                if sys.modules.get(self.__name__) is self:
                    del sys.modules[self.__name__]
                real = importlib.import_module(self.__name__)
                self._real = real
        return getattr(real, attr)


def defer_import(name: str) -> None:
    """`import name` from now on gives a `DeferredModule` (the real module loads when it is first used)."""
    if name not in sys.modules:
        module = DeferredModule(name)
        module.__spec__ = importlib.util.find_spec(name)  # found, not loaded: what `import` and find_spec ask
        sys.modules[name] = module


def imports_without_torch() -> None:
    """Upstream's backend imports transformers for configs and tokenizers, which imports torch when it is installed,
    and peft for one `LoraConfig(...).save_pretrained` at a sampler save, which imports torch too: 9 s of a rank's
    start, 6.5 of them torch, transformers' torch side and peft, none of which the JAX engine runs. Transformers is
    told there is no torch and peft loads at its first use (`rank-imports`)."""
    os.environ.setdefault("USE_TORCH", "0")
    if os.environ["USE_TORCH"].upper() in ("0", "FALSE", "OFF", "NO"):
        defer_import("peft")  # (torch, when asked for, walks the imported modules and would load it mid-import)


def run(module: str, argv: list[str], patch=None) -> None:
    """Import upstream's entry point `module`, install what every rank gets and then `patch(entry)`,
    and run it with `argv`."""
    imports_without_torch()
    entry = importlib.import_module(module)  # the slow part (~3 s), before any gate
    install()
    if patch is not None:
        patch(entry)
    sys.argv = [module, *argv]
    entry.main()
