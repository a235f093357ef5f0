"""What every rank process gets before upstream's entry point runs: txflow's checkpoint I/O (`rank0-checkpoint-io`,
`adapter-state-program`), the default SIGTERM action after `jax.distributed.initialize` (`default-sigterm`), Tinker's
losses (`tinker-losses`), the compilation cache written by every rank (`compilation-cache`), loss chunks sized to the
batch (`loss-chunks`), each example's own adapter in every LoRA linear layer (`lora-per-example`), the model code of
`models` (`tied-head-from-arguments`, `scanned-layers`), sampling prompts in one length bucket (`sampling-buckets`),
sampling calls in batches sized to them (`sampling-rows`), every program's compile in the log under what it computes
(`compile-log`), each model's optimizer over its own slot only (`optimizer-own-slot`), its step one jitted call over
arrays (`optimizer-flat-call`), the rows of a training batch that share a prompt computed once (`packed-prefixes`) and
a one-model batch's gradient over its own slot only (`one-slot-gradient`), and the memory freed by an evaluation's or
a checkpoint's request returned to the system (`freed-memory-returned`), a sampler save's config written without
peft (`adapter-config-without-peft`); `run` imports upstream without torch (`rank-imports`)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import threading
import time
import types

from txflow.upstream.skyrl_tx import losses, models, packing
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
    example's adapter index, then two small matmuls (in a decoding step, every slot's, masked: see below). Upstream
    sorts the tokens by adapter and runs `ragged_dot` against every adapter slot, which XLA on CPU computes densely
    for all `max_lora_adapters` of them."""
    import jax
    import jax.numpy as jnp

    if self.max_lora_adapters == 0 or adapter_indices is None:
        return base_output
    batch, seq_len = x.shape[:2]
    x = x.reshape(batch, seq_len, -1)
    slots = self.lora_A.shape[0]  # `max_lora_adapters`, or 1 in a view of one slot (`one-slot-gradient`)
    if seq_len == 1:
        # A decoding step: every slot's factors read where they are, each row's own kept by a 0/1 mask. The
        # gathered copies (rows x in x rank, per module) do not change from step to step, so XLA hoisted them out
        # of the decoding loop, all 420 of SmolLM2's at once: 1.8 GB held through a 32-row batch's decode.
        own = jax.nn.one_hot(adapter_indices, slots, dtype=x.dtype)[:, None, :, None]
        down = jnp.einsum("bti,nir->btnr", x, self.lora_A[...]) * own
        out = jnp.einsum("btnr,nro->bto", down, self.lora_B[...])
    else:
        down = jnp.einsum("bti,bir->btr", x, self.lora_A[...][adapter_indices])
        out = jnp.einsum("btr,bro->bto", down, self.lora_B[...][adapter_indices])
    out = out * self.lora_scaling[...][adapter_indices, None, None]
    return base_output + out.reshape(base_output.shape).astype(base_output.dtype)


def lora_computes_each_examples_adapter() -> None:
    """Every LoRA linear layer computes each example's adapter only (`lora-per-example`); embeddings and experts stay
    upstream's."""
    from tx.layers.lora import LoRALinear

    LoRALinear.apply_lora = lora_per_example


# The program shapes this process has compiled since `every_program_compile_logged` (`compile-log`; one engine per
# process).
COMPILED: set[tuple] = set()


# What JAX's persistent compilation cache did in this process: executables asked of it, found in it, and the
# seconds their compiles had taken (what loading them saved); and the seconds JAX spent making executables (tracing,
# lowering, XLA's compile or the cache's load). JAX reports these as monitoring events.
CACHE_EVENTS = {"asked": 0, "found": 0, "saved_s": 0.0, "compiling_s": 0.0}
# The stages of making an executable (jax._src.dispatch names them): a program's first call minus these is its run.
COMPILE_STAGES = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def count_cache_events() -> None:
    """Listen to JAX's persistent-cache events (once per process), so that a compile's log line can say whether its
    programs were compiled or loaded from this machine's cache."""
    from jax import monitoring

    if getattr(count_cache_events, "installed", False):
        return

    def on_event(event: str, **_) -> None:
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            CACHE_EVENTS["asked"] += 1
        elif event == "/jax/compilation_cache/cache_hits":
            CACHE_EVENTS["found"] += 1

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            CACHE_EVENTS["saved_s"] += max(seconds, 0.0)
        elif event in COMPILE_STAGES:
            CACHE_EVENTS["compiling_s"] += seconds

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)
    count_cache_events.installed = True


@contextlib.contextmanager
def compile_logged(kind: str, length: int, shapes: set[tuple], enforce_eager: bool = False):
    """Logs the call inside as `kind` of `length` compiling, in upstream's words, when it runs a program of `shapes`
    this process has not compiled yet (`compile-log`). Upstream's figure is the whole first call, the program's
    first run included (a 32-row sample of SmolLM2 runs ~5 s); the end adds how much of it went to making the
    program's executables (tracing, lowering, compiling or loading them), how many came from the persistent cache
    and what compiling those had taken (`txflow.cluster.compiles` reads it)."""
    from tx.utils.log import logger

    if enforce_eager or shapes <= COMPILED:
        yield
        return
    logger.info(f"JIT compiling for {kind} seq_len={length} in progress...")
    began, before = time.time(), dict(CACHE_EVENTS)
    yield
    COMPILED.update(shapes)
    asked, found = (CACHE_EVENTS[k] - before[k] for k in ("asked", "found"))
    compiling = f"compiling {CACHE_EVENTS['compiling_s'] - before['compiling_s']:.2f}s"
    cache = (f"; persistent cache: {found} of {asked} loaded, {CACHE_EVENTS['saved_s'] - before['saved_s']:.1f}s of "
             f"compiling saved") if asked else ""
    logger.info(f"JIT compilation for {kind} seq_len={length} took {time.time() - began:.2f}s ({compiling}{cache})")


def optimizer_compile_logged() -> None:
    """The first optimizer step of the process (the one that compiles its program) is logged as upstream logs
    its train and sample compiles, so that the run can say what it waits for (`txflow.cluster.compiles`)."""
    from tx.tinker.backends.jax import JaxBackendImpl

    upstream = JaxBackendImpl.optim_step

    # The rank-0 wrapper serialises a broadcast call's arguments by the method's annotations (and the workers
    # read them back so): `wraps` keeps upstream's.
    @functools.wraps(upstream)
    def optim_step(self, model_id, request_data):
        if model_id in self.models and int(self.accumulated_grads.counts[self.models[model_id].adapter_index]) == 0:
            return upstream(self, model_id, request_data)  # upstream skips the step: nothing compiles
        with compile_logged("optimizer", 0, {("optimizer",)}):
            return upstream(self, model_id, request_data)

    JaxBackendImpl.optim_step = optim_step


def every_program_compile_logged() -> None:
    """Each model-pass and sampling program is logged when it first compiles, named by what it computes
    (`compile-log`), so that the run can say what it waits for and the report has its seconds
    (`txflow.cluster.compiles`).

    Upstream logs a compile the first time it meets a length: `train` for a forward_backward and a forward alike,
    `sample` for every sampling program of that length. But a forward is a program of its own, and so is each
    micro-batch's row count, and a sampling batch's prompt-logprob flag, new-token count and prefill rows: each
    came after the first of its length compiled in silence (the demo's evaluation forward of 64 tokens: 4.8 s,
    in no report). Here each shape is logged the first time it comes, as `train`, `forward` or `sample` of
    its length; the run adds up the compiles of one name."""
    from tx.tinker.backends import jax as backend
    from tx.tinker.backends.jax import JaxBackendImpl
    from tx.utils import generator

    count_cache_events()
    if hasattr(generator.GeneratorMixin.generate, "upstream"):
        return
    COMPILED.clear()  # installed once per process; a test installs it again over upstream's methods
    current: dict[str, tuple] = {}  # the shapes the call in progress will run, by the kind it is logged as

    upstream_pass = JaxBackendImpl._model_pass

    def _model_pass(self, prepared_batch, model_pass_fn):
        kind = "forward" if model_pass_fn is self._forward else "train"
        total, fsdp = len(prepared_batch.all_input_ids), self.mesh.shape["fsdp"]
        micro = self._micro_batch_size(total) if total else 1
        length = backend.round_up_seq_len(max((len(ids) for ids in prepared_batch.all_input_ids), default=0))
        adapters = packing.adapters_of(self, prepared_batch.all_model_ids)
        shapes = set()
        for start in range(0, total, micro):  # a micro-batch's rows, padded to the devices, and its packing
            rows = prepared_batch.all_input_ids[start:start + micro]
            targets = prepared_batch.all_targets[start:start + micro]
            packed = packing.shapes_of(self, rows, targets, adapters[start:start + micro], length)[1:]
            one_slot = ("one slot",) if getattr(self, "_txflow_one_slot", None) is not None else ()
            shapes.add((kind, length, -(-len(rows) // fsdp) * fsdp, *packed, *one_slot))
        current["pass"] = (kind, length, shapes)
        try:
            return upstream_pass(self, prepared_batch, model_pass_fn)
        finally:
            current.pop("pass", None)

    @contextlib.contextmanager
    def _jit_timing_context(self, seq_len: int, mode: str):
        # Upstream's metrics keep their figures by length; the log says what compiled.
        times = self.metrics.train_seq_len_jit_times if mode == "train" else self.metrics.sample_seq_len_jit_times
        began = time.time()
        if mode == "train" and "pass" in current:
            kind, length, shapes = current["pass"]
            with compile_logged(kind, length, shapes, self.config.enforce_eager):
                yield
        else:  # sampling is logged by `generate`, which knows the program's shape
            yield
        times.setdefault(seq_len, time.time() - began)

    upstream_generate = generator.GeneratorMixin.generate

    @functools.wraps(upstream_generate)
    def generate(self, input_ids, attention_mask, *, sampling_params, adapter_indices=None, prompt_logprobs=False,
                 tokenizer=None):
        # The arguments `_prefill_and_decode` is compiled for (upstream's `generate` derives them so), and the
        # rows its prefill runs on (`prefill-once-per-prompt`).
        plan = None if prompt_logprobs else models.shared_prompts(input_ids, attention_mask, adapter_indices)
        shape = ("sample", *input_ids.shape, max(p.max_tokens for p in sampling_params),
                 max((p.top_k for p in sampling_params if p.top_k > 0), default=0),
                 any(p.top_p < 1.0 for p in sampling_params), bool(prompt_logprobs),
                 None if plan is None else len(plan[0]))
        with compile_logged("sample", input_ids.shape[1], {shape}):
            return upstream_generate(self, input_ids, attention_mask, sampling_params=sampling_params,
                                     adapter_indices=adapter_indices, prompt_logprobs=prompt_logprobs,
                                     tokenizer=tokenizer)

    generate.upstream = upstream_generate
    JaxBackendImpl._model_pass, JaxBackendImpl._jit_timing_context = _model_pass, _jit_timing_context
    generator.GeneratorMixin.generate = generate


def slot_optimizer(self, adapter_index: int):
    """The optimizer `optimizer-own-slot` gives a model: upstream's (`nnx.Optimizer`, AdamW through
    `inject_hyperparams`, its rate set at each step) over a one-slot view of the LoRA weights, so its moments are
    the model's slot alone, shaped as upstream's with the slot axis of length 1 (the same tree, the same paths: the
    checkpoint's optimizer state, upstream's slot slice, keeps its format)."""
    import jax
    import optax
    from flax import nnx

    weights = nnx.state(self.model, self.model.is_lora_param)
    slots = self.config.max_lora_adapters
    for leaf in jax.tree.leaves(weights):  # what the step's slicing relies on (upstream's slicing does too)
        if leaf.shape[0] != slots:
            raise ValueError(f"a LoRA weight of shape {leaf.shape} is not stacked by slot ({slots} slots)")
    with jax.set_mesh(self.mesh):
        tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0)
        view = jax.tree.map(lambda w: w[adapter_index:adapter_index + 1], weights)
        return nnx.Optimizer(view, tx, wrt=self.model.is_lora_param)


def is_variable(x) -> bool:
    from flax import nnx

    return isinstance(x, nnx.Variable)


def slot_of(w, adapter_index):
    """A LoRA weight's (or gradient sum's) slot `adapter_index`, the slot axis kept: it comes first in every one, and
    the index may be traced."""
    import jax

    return jax.lax.dynamic_slice_in_dim(w, adapter_index, 1, axis=0)


@functools.lru_cache(maxsize=16)  # (each model's optimizer has a transform of its own)
def flat_step_program(tx, wrt, lora_tree, grad_tree, opt_tree):
    """The optimizer step of `flat_optimizer_step` for one structure of weights, gradients and optimizer state when
    the engine runs eagerly (`enforce_eager`): upstream's step on one slot (`optimizer-own-slot`), the slot's mean
    gradient through the optimizer's transform, taking and returning lists of arrays; it writes the slot's new
    weights back and resets its gradient sum itself. (Jitted, the step runs `layer_by_layer_step`.)"""
    import jax
    import optax
    from flax import nnx

    def step(grad_leaves, counts, lora_leaves, opt_leaves, count, adapter_index):

        # The trees as nnx.jit rebuilt them (Variables around the arrays), and upstream's `Optimizer.update` on them.
        lora = jax.tree_util.tree_unflatten(lora_tree, lora_leaves)
        grad_sum = jax.tree_util.tree_unflatten(grad_tree, grad_leaves)
        opt_state = jax.tree_util.tree_unflatten(opt_tree, opt_leaves)
        n = counts[adapter_index]
        view = jax.tree.map(lambda w: slot_of(w, adapter_index), lora)
        grads = jax.tree.map(lambda g: slot_of(g, adapter_index) / n.astype(g.dtype), grad_sum)
        params = nnx.as_pure(nnx.state(view, wrt))
        updates, new_state = tx.update(nnx.as_pure(nnx.state(grads, wrt)), nnx.as_pure(opt_state), params)
        mine = jax.tree.leaves(optax.apply_updates(params, updates))
        whole = jax.tree.leaves(nnx.as_pure(lora))
        new_opt = jax.tree.leaves(new_state)
        if len(mine) != len(whole) or len(new_opt) != len(opt_leaves):  # (at trace time)
            raise ValueError("the optimizer's state does not match the LoRA weights it steps")
        return ([g.at[adapter_index].set(0) for g in grad_leaves], counts.at[adapter_index].set(0),
                [jax.lax.dynamic_update_slice_in_dim(w, m, adapter_index, axis=0) for w, m in zip(whole, mine)],
                new_opt, count + 1)

    return step


@functools.lru_cache(maxsize=16)  # (each model's optimizer has a transform of its own)
def layer_step_program(tx):
    """A group of a model's LoRA weights stepped (`optimizer-layer-by-layer`): upstream's step on the slot
    (`optimizer-own-slot`), the slot's mean gradient through the optimizer's transform, over lists of arrays: the
    weights and gradient sums (stacked by slot) of the group, and the optimizer's state with each of its subtrees
    shaped as the weights (Adam's two moments) cut to the group. Returns the slot's new weights and that state."""
    import jax
    import optax

    def step(grad_leaves, counts, lora_leaves, state, adapter_index):

        n = counts[adapter_index]
        params = [slot_of(w, adapter_index) for w in lora_leaves]
        updates, new_state = tx.update([slot_of(g, adapter_index) / n.astype(g.dtype) for g in grad_leaves], state,
                                       params)
        return optax.apply_updates(params, updates), new_state

    return jax.jit(step)


# Decoder layers a program of `layer_by_layer_step` steps: fewer hold less code but make more calls a step; five hold
# a fraction of one program's code and step as fast (docs/performance.md).
LAYERS_A_PROGRAM = 5


@functools.lru_cache(maxsize=16)
def layer_groups(lora_tree, grad_tree, opt_tree):
    """How `layer_by_layer_step` cuts a model's step, for the trees' structures (the variables as nodes): the LoRA
    weights' positions by `LAYERS_A_PROGRAM` decoder layers (the weights outside the layers a group of their own),
    and the optimizer state's nodes, each either its leaves' positions in the weights' order (a subtree shaped as
    the weights: Adam's moments) or a leaf's position (a step count, a hyperparameter)."""
    import jax
    from flax import nnx

    def pure(tree):
        return nnx.as_pure(jax.tree_util.tree_unflatten(tree, range(tree.num_leaves)))

    weights = jax.tree.structure(pure(lora_tree))
    if jax.tree.structure(pure(grad_tree)) != weights:
        raise ValueError("the gradient sums are not shaped as the LoRA weights they step")
    groups: dict[int, list[int]] = {}
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(pure(lora_tree))[0]):
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        layer = int(keys[keys.index("layers") + 1]) // LAYERS_A_PROGRAM if "layers" in keys[:-1] else -1
        groups.setdefault(layer, []).append(i)

    def like_weights(node) -> bool:
        return jax.tree.structure(node) == weights

    nodes, node_tree = jax.tree.flatten(pure(opt_tree), is_leaf=like_weights)
    if not any(like_weights(node) for node in nodes):
        raise ValueError("the optimizer's state holds nothing shaped as the LoRA weights it steps")
    return list(groups.values()), [jax.tree.leaves(n) if like_weights(n) else n for n in nodes], node_tree


def layer_by_layer_step(optimizer, lora_tree, grad_tree, grad_leaves, counts, lora_leaves, opt_leaves,
                        adapter_index):
    """A model's optimizer step (`optimizer-layer-by-layer`) as one program per `LAYERS_A_PROGRAM` decoder layers,
    the same program for every such group, and one for the weights outside the layers. Returns the slot's new
    weights (in the weights' order) and the optimizer's new state (its leaves, in their order). Adam's arithmetic is
    elementwise, so each weight is computed as in one program over all of them (a test holds the bits); but XLA's
    CPU runtime holds code in proportion to a program's instructions, and that program, dozens of instructions a
    weight and moment, was the largest a rank held and the slowest to load from the cache (docs/performance.md)."""
    import jax

    groups, nodes, node_tree = layer_groups(lora_tree, grad_tree, jax.tree_util.tree_structure(optimizer.opt_state))
    program = layer_step_program(optimizer.tx)
    mine: list = [None] * len(lora_leaves)
    new_opt: list = [None] * len(opt_leaves)
    for group in groups:
        state = jax.tree.unflatten(node_tree, [[opt_leaves[node[i]] for i in group] if isinstance(node, list)
                                               else opt_leaves[node] for node in nodes])
        new_weights, new_state = program([grad_leaves[i] for i in group], counts, [lora_leaves[i] for i in group],
                                         state, adapter_index)
        for i, weight in zip(group, new_weights):
            mine[i] = weight
        for node, value in zip(nodes, jax.tree.flatten(new_state, is_leaf=lambda x: isinstance(x, list))[0]):
            if isinstance(node, list):
                for i, leaf in zip(group, value):
                    new_opt[node[i]] = leaf
            else:  # a step count or a hyperparameter: the same from every group
                new_opt[node] = value
    return mine, new_opt


def slot_written(whole, part, slot):
    """`whole` (stacked by slot) with `part` (one slot) written at `slot`; a bfloat16 array through its bits
    (`slots-written-in-place`): XLA's CPU runtime widens a bfloat16 dynamic-update-slice to float32, which rewrites
    the whole array, twice converted, where the bits are written in place into a donated buffer."""
    import jax
    import jax.numpy as jnp

    if whole.dtype == jnp.bfloat16:
        bits = jax.lax.dynamic_update_slice_in_dim(models.bits_of(whole), models.bits_of(part.astype(whole.dtype)),
                                                   slot, axis=0)
        return models.bfloat16_of(bits)
    return jax.lax.dynamic_update_slice_in_dim(whole, part.astype(whole.dtype), slot, axis=0)


@functools.cache
def slot_write_program():
    """A model's step written into the engine's slot-stacked arrays in place (`slots-written-in-place`): the slot's
    new LoRA weights, its gradient sums and count reset, every other slot untouched, the arrays donated. A program of
    its own: where the step's reads of the slot and these writes shared one donated program, XLA copied every donated
    array first (docs/performance.md)."""
    import jax
    import jax.numpy as jnp

    def write(lora_leaves, grad_leaves, counts, mine, adapter_index):
        return ([slot_written(w, m, adapter_index) for w, m in zip(lora_leaves, mine)],
                [slot_written(g, jnp.zeros((1, *g.shape[1:]), g.dtype), adapter_index) for g in grad_leaves],
                counts.at[adapter_index].set(0))

    return jax.jit(write, donate_argnums=(0, 1, 2))


def flat_optimizer_step(accumulated_grads, lora_params, optimizer, adapter_index, jitted: bool = True):
    """`optimizer-flat-call`: one model's optimizer step (`optimizer-own-slot`) as programs over lists of arrays
    (jitted unless the engine runs eagerly; jitted, one per group of layers: `optimizer-layer-by-layer`), whose
    results are written into the weights' and the optimizer's variables in place.

    nnx.jit flattened the engine's LoRA weights, the gradient sums and the optimizer's moments (422 + 422 + 844
    variables on SmolLM2) through flax's graph on the way in and again on the way out, at every step: 0.11 s of
    Python against a program of a few hundredths (docs/performance.md). The same arithmetic (a test holds the
    two to the same bits). Jitted, the slot is then written into the engine's arrays in place
    (`slots-written-in-place`): the arrays given are donated, so nothing may hold them across a step."""
    import jax

    lora_vars = jax.tree_util.tree_leaves(lora_params, is_leaf=is_variable)
    opt_vars = jax.tree_util.tree_leaves(optimizer.opt_state, is_leaf=is_variable)
    grad_leaves, grad_tree = jax.tree_util.tree_flatten(accumulated_grads.grad_sum)
    lora_leaves = [v.get_raw_value() for v in lora_vars]
    opt_leaves = [v.get_raw_value() for v in opt_vars]
    if jitted:
        mine, opt = layer_by_layer_step(optimizer, jax.tree_util.tree_structure(lora_params), grad_tree, grad_leaves,
                                        accumulated_grads.counts, lora_leaves, opt_leaves, adapter_index)
        count = optimizer.step.get_raw_value() + 1
        lora, grads, counts = slot_write_program()(lora_leaves, grad_leaves, accumulated_grads.counts, mine,
                                                   adapter_index)
    else:
        # The structures with the variables as pytree nodes, as the program rebuilds them from its arguments.
        program = flat_step_program(optimizer.tx, optimizer.wrt, jax.tree_util.tree_structure(lora_params),
                                    grad_tree, jax.tree_util.tree_structure(optimizer.opt_state))
        grads, counts, lora, opt, count = program(grad_leaves, accumulated_grads.counts, lora_leaves, opt_leaves,
                                                  optimizer.step.get_raw_value(), adapter_index)
    for variable, value in zip(lora_vars, lora):
        variable.set_raw_value(value)
    for variable, value in zip(opt_vars, opt):
        variable.set_raw_value(value)
    optimizer.step.set_raw_value(count)
    return type(accumulated_grads)(grad_sum=jax.tree_util.tree_unflatten(grad_tree, grads), counts=counts)


def optimizer_covers_its_own_slot() -> None:
    """Upstream gives each model an `nnx.Optimizer` over the LoRA weights of every slot: Adam's two moments of every
    slot for each model (k models on a cluster of S slots hold 2kS slots of moments, ~1.45 GB a model on SmolLM2's
    32-slot warm cluster, all but its own slot zeros), a step that reads and writes all of them, and AdamW's weight
    decay (`lr * weight_decay * w`, on every parameter it covers) shrank every other run's adapter on the cluster at
    each of this model's steps. Here a model's optimizer holds its own slot only (`slot_optimizer`), and its step
    reads that slot's mean gradient and weights, updates them as upstream's step does, and writes that slot back
    (`optimizer-own-slot`); every other slot keeps its weights bit for bit. The checkpoint's optimizer state is the
    same slice as upstream's (slot index 0 of the one-slot view), so checkpoints load either way.

    A new model starts from no gradient (`fresh-slot-gradient`): upstream's `delete_model` leaves the slot's
    gradient sum and count as they were, so a model unloaded between its forward_backward and its optimizer step
    (a run killed or cancelled mid-step, a client that stops) put its gradient into the first step of the slot's
    next model, another run's."""
    import jax
    from flax import nnx
    from tx.tinker.backends import jax as backend
    from tx.tinker.backends.jax import JaxBackendImpl

    upstream = JaxBackendImpl._create_loss_and_grad_fn
    if getattr(upstream, "txflow", False):
        return

    @functools.wraps(upstream)
    def create_loss_and_grad_fn(self):
        upstream(self)
        self._compute_grads_and_update = functools.partial(flat_optimizer_step,
                                                           jitted=not self.config.enforce_eager)

    def create_model(self, model_id, lora_config):
        # Upstream's `create_model`, with the optimizer of the model's own slot.
        used = {m.adapter_index for m in self.models.values()}
        free = set(range(1, self.config.max_lora_adapters)) - used
        if not free:
            raise ValueError(f"Maximum number of LoRA adapters ({self.config.max_lora_adapters}) reached")
        adapter_index = min(free)
        if not (0 < lora_config.rank <= self.config.max_lora_rank):
            raise ValueError(f"LoRA rank {lora_config.rank} must be between 1 and {self.config.max_lora_rank}")
        self.models[model_id] = backend.types.ModelMetadata(adapter_index=adapter_index, lora_config=lora_config)
        if int(self.accumulated_grads.counts[adapter_index]):  # the slot's last model left a gradient unstepped
            with jax.set_mesh(self.mesh):  # (`fresh-slot-gradient`)
                self.accumulated_grads = self.accumulated_grads.reset_adapter(adapter_index)
        self.optimizers[model_id] = slot_optimizer(self, adapter_index)
        backend.init_lora_adapter(self.model, adapter_index, lora_config)
        backend.logger.info(f"Created model {model_id} with adapter_index={adapter_index}, config={lora_config}")

    def extract_checkpoint_data(self, model_id):
        model = self.models[model_id]
        rank = model.lora_config.rank
        return {"lora_weights": backend.extract_adapter_state(model.adapter_index, self.lora_params, rank),
                "optimizer_state": backend.extract_adapter_state(0, nnx.state(self.optimizers[model_id]), rank),
                "lora_config": model.lora_config.model_dump()}

    def insert_checkpoint_data(self, model_id, checkpoint_data):
        model = self.models[model_id]
        rank = checkpoint_data["lora_config"]["rank"]
        if model.lora_config.rank != rank:
            raise ValueError(f"Rank mismatch: checkpoint has rank {rank}, model configured with rank "
                             f"{model.lora_config.rank}")
        backend.insert_adapter_state(model.adapter_index, self.lora_params, checkpoint_data["lora_weights"], rank)
        backend.insert_adapter_state(0, nnx.state(self.optimizers[model_id]), checkpoint_data["optimizer_state"],
                                     rank)

    create_loss_and_grad_fn.txflow = True
    JaxBackendImpl._create_loss_and_grad_fn = create_loss_and_grad_fn
    # The rank-0 wrapper serialises a broadcast call's arguments by the method's annotations: keep upstream's.
    for name, replacement in (("create_model", create_model), ("_extract_checkpoint_data", extract_checkpoint_data),
                              ("_insert_checkpoint_data", insert_checkpoint_data)):
        setattr(JaxBackendImpl, name, functools.wraps(getattr(JaxBackendImpl, name))(replacement))
    JaxBackendImpl.new_optimizer = slot_optimizer  # what a state load without the optimizer gives (checkpoint_io)


def embed_lora_per_example(self, x, base_output, adapter_indices):
    """An embedding's LoRA with each example's own adapter (`lora-per-example`): A's rows of the example's tokens in
    its own slot, times its own B. Upstream sorts the tokens by adapter and runs `ragged_dot` over every slot (the
    same figures), which also ties the program to the number of slots the weights hold (`one-slot-gradient`)."""
    import jax.numpy as jnp

    if self.max_lora_adapters == 0 or adapter_indices is None:
        return base_output
    down = self.lora_A[...][adapter_indices[:, None], x]  # (batch, tokens, rank)
    out = jnp.einsum("btr,bro->bto", down, self.lora_B[...][adapter_indices])
    out = out * self.lora_scaling[...][adapter_indices, None, None]
    return base_output + out.astype(base_output.dtype)


# The leaves outside the LoRA weights that hold one entry per slot (`tx.layers.lora.LoRAMixin`).
_PER_SLOT = ("lora_scaling", "lora_ranks")


def _take(grad_sum, lora, per_slot, slot):
    import jax

    def one(w):
        return jax.lax.dynamic_slice_in_dim(w, slot, 1, axis=0)

    return jax.tree.map(one, grad_sum), jax.tree.map(one, lora), [one(w) for w in per_slot]


def _put(accumulated, grad_sum, slot, adapter_indices):
    import jax
    import jax.numpy as jnp

    counts = accumulated.counts + jnp.bincount(adapter_indices, length=accumulated.counts.shape[0])
    return type(accumulated)(grad_sum=jax.tree.map(
        lambda whole, mine: slot_written(whole, mine, slot), accumulated.grad_sum, grad_sum), counts=counts)


@functools.cache
def slot_programs():
    """The jitted `_take` and `_put` (`one-slot-gradient`), compiled once per process and shape."""
    import jax

    return jax.jit(_take), jax.jit(_put, donate_argnums=(0,))


def slot_view(grad_sum, lora, rest, slot: int):
    """One slot's view (`one-slot-gradient`): the slot's gradient sum (any tree stacked by slot, [] for none), its
    LoRA weights, and the rest of the weights with the slot's scales in place of every slot's."""
    import jax
    import jax.numpy as jnp

    leaves, tree = jax.tree_util.tree_flatten_with_path(rest)
    where = [i for i, (path, _) in enumerate(leaves) if any(getattr(k, "key", None) in _PER_SLOT for k in path)]
    grads, view, per_slot = slot_programs()[0](grad_sum, lora, [leaves[i][1] for i in where], jnp.int32(slot))
    rest_leaves = [leaf for _, leaf in leaves]
    for i, leaf in zip(where, per_slot):
        rest_leaves[i] = leaf
    return grads, view, jax.tree_util.tree_unflatten(tree, rest_leaves)


class OneSlotPass:
    """A forward_backward (or forward) program that, when every row of the batch is one model's
    (`one-slot-gradient`), runs on that model's slot alone: the slot's LoRA weights, scales and accumulated gradient
    are taken out (a view of one slot, each row's adapter index 0 in it), upstream's program (or the packed one)
    runs on the view, and the slot's gradient sum is written back into the donated accumulator; the counts are
    upstream's. A forward (`gradient` false) changes no gradient, so the accumulator it is given comes back as it
    is: upstream's forward program returns a copy of every slot's (182 MB for SmolLM2 on 8 slots, on top of its
    buffers over every slot's weights). Otherwise the whole program, as upstream runs it."""

    def __init__(self, engine, inner, gradient: bool = True):
        self.engine, self.inner, self.gradient = engine, inner, gradient

    def __call__(self, accumulated, lora, rest, input_ids, attention_mask, adapter_indices, *batch):
        import jax.numpy as jnp

        slot = getattr(self.engine, "_txflow_one_slot", None)
        if slot is None:
            return self.inner(accumulated, lora, rest, input_ids, attention_mask, adapter_indices, *batch)
        grads, view, view_rest = slot_view(accumulated.grad_sum, lora, rest, slot)
        counts = jnp.zeros((1,), dtype=accumulated.counts.dtype)
        mine, losses, logprobs = self.inner(type(accumulated)(grad_sum=grads, counts=counts), view, view_rest,
                                            input_ids, attention_mask, jnp.zeros_like(adapter_indices), *batch)
        if not self.gradient:
            return accumulated, losses, logprobs
        put = slot_programs()[1]
        return put(accumulated, mine.grad_sum, jnp.int32(slot), adapter_indices), losses, logprobs


def views_serve(engine) -> bool:
    """Whether one slot's view can stand for the engine's weights (`one-slot-gradient`): its LoRA layers take each
    example's own factors (`lora-per-example`), which read a view as they read every slot; upstream's routing over
    `max_lora_adapters` slots (its linear and embedding layers, and LoRA experts always) does not."""
    from tx.layers.lora import LoRAEmbed, LoRALinear

    if LoRALinear.apply_lora is not lora_per_example or LoRAEmbed.apply_lora is not embed_lora_per_example:
        return False
    if not hasattr(engine, "_txflow_experts"):
        from flax import nnx
        from tx.layers.lora import LoRAExpert

        engine._txflow_experts = any(isinstance(m, LoRAExpert) for _, m in nnx.iter_modules(engine.model))
    return not engine._txflow_experts


def one_slot_gradient() -> None:
    """A forward_backward whose rows all train one model differentiates that model's slot only, a forward of one
    model's rows runs on its slot alone, and a sampling batch of one adapter samples from that slot alone
    (`one-slot-gradient`).

    Upstream differentiates the LoRA weights of every slot: the program stacks every slot's weights per layer,
    carries a gradient of every slot through the backward (zeros but for the batch's own), and adds them all to
    the accumulator. On SmolLM2 with 8 slots that was most of the program's 2.4 GB of buffers. Its sampling
    programs stack every slot's weights the same way in the prefill, and a decoding step of more rows than slots
    multiplies by every slot's factors. Rows of several models (a shared cluster's batch) keep upstream's
    programs. Embeddings take their LoRA per example too (`embed_lora_per_example`), so that no program depends on
    how many slots its weights hold."""
    from tx.layers.lora import LoRAEmbed
    from tx.tinker.backends.jax import JaxBackendImpl

    upstream = JaxBackendImpl._create_loss_and_grad_fn
    if getattr(upstream, "one_slot", False):
        return
    LoRAEmbed.apply_lora = embed_lora_per_example
    upstream_pass = JaxBackendImpl._model_pass

    @functools.wraps(upstream_pass)
    def _model_pass(self, prepared_batch, model_pass_fn):
        slots = set(packing.adapters_of(self, prepared_batch.all_model_ids))
        self._txflow_one_slot = slots.pop() if len(slots) == 1 and views_serve(self) else None
        try:
            return upstream_pass(self, prepared_batch, model_pass_fn)
        finally:
            self._txflow_one_slot = None

    @functools.wraps(upstream)
    def _create_loss_and_grad_fn(self):
        upstream(self)
        self._forward_backward_and_accumulate = OneSlotPass(self, self._forward_backward_and_accumulate)
        self._forward = OneSlotPass(self, self._forward, gradient=False)

    upstream_sample, upstream_load = JaxBackendImpl.sample, JaxBackendImpl.load_sampler_weights

    @functools.wraps(upstream_load)
    def load_sampler_weights(self, prepared_batch):
        # Within `sample` (upstream merges its model from these weights right after): a batch of one adapter samples
        # from that slot's view, each row's index 0 in it; `sample` puts the whole weights back.
        indices = upstream_load(self, prepared_batch)
        if not getattr(self, "_txflow_sampling", False) or self._txflow_whole is not None \
                or len(set(indices)) != 1 or not views_serve(self):  # (a view already stands for them)
            return indices
        self._txflow_whole = (self.lora_params, self.non_lora_params)
        _, self.lora_params, self.non_lora_params = slot_view([], self.lora_params, self.non_lora_params, indices[0])
        return [0] * len(indices)

    @functools.wraps(upstream_sample)  # its annotations serialise the broadcast call
    def sample(self, prepared_batch):
        self._txflow_sampling, self._txflow_whole = True, None
        try:
            return upstream_sample(self, prepared_batch)
        finally:
            if self._txflow_whole is not None:  # whatever happened
                self.lora_params, self.non_lora_params = self._txflow_whole
            self._txflow_sampling, self._txflow_whole = False, None

    JaxBackendImpl.sample, JaxBackendImpl.load_sampler_weights = sample, load_sampler_weights
    _model_pass.upstream, _create_loss_and_grad_fn.upstream = upstream_pass, upstream
    _create_loss_and_grad_fn.one_slot = True
    JaxBackendImpl._model_pass, JaxBackendImpl._create_loss_and_grad_fn = _model_pass, _create_loss_and_grad_fn


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


# A sampling call of more sequences than upstream's batch (`sample_max_num_sequences`) runs in batches of this many
# times as many rows, while each holds no more key-value positions than one of upstream's batches of rows of
# SAMPLE_ROW_TOKENS (`sampling-rows`).
SAMPLE_ROWS_FACTOR, SAMPLE_ROW_TOKENS = 4, 512
# A call that asks for prompt logprobs (an evaluation) runs in batches of this many times upstream's rows, however
# few its rows: half the larger batch, since an evaluation's sampling is where a run's rank peaks (the demo's restore
# check). 16 rows of SmolLM2 held ~100 MB less than 32 while they ran, and the demo took as long (docs/performance.md).
EVALUATION_ROWS_FACTOR = 2


def rows_are_short(prompt_lengths: list[int], max_tokens: list[int], factor: int = SAMPLE_ROWS_FACTOR,
                   row_tokens: int = SAMPLE_ROW_TOKENS) -> bool:
    """Whether rows of these prompts and new tokens are short enough for `factor` times upstream's rows in one
    batch (`sampling-rows`): their prompt bucket plus their new tokens, `factor` times, within `row_tokens`."""
    from tx.tinker.backends import jax as backend

    width = backend.round_up_seq_len(max(max(prompt_lengths), SAMPLE_BUCKET_FLOOR)) + max(max_tokens)
    return factor * width <= row_tokens


def sampling_batches_fit_the_call(factor: int = SAMPLE_ROWS_FACTOR) -> None:
    """Upstream samples in batches of `sample_max_num_sequences` rows (8 in a run: it bounds the memory), each padded to
    that many, and on a CPU a decoding step of 32 rows costs about twice one of 8 (SmolLM2: 0.23 s against 0.10-0.13 s;
    the matmuls of a few rows run far below the CPU's peak), half as much per row: the nightly RL step's 32 samples took
    4 batches of 1.25 s, 5.0 s, against 2.5 s as one batch of 32 (in one process). When its rows are short
    (`rows_are_short`), a batch runs `factor` times upstream's rows:
    - a call of more rows than upstream's batch (the engine takes that many, `full-sampling-batches`);
    - and every call that asks for prompt logprobs, however few its rows, in batches of `EVALUATION_ROWS_FACTOR`
      times upstream's rows: those are evaluations (greedy tokens and the logprobs of each prompt), whose calls of
      24-32 prompts ran in 3-4 batches, and with one size for them all a run compiles one such program, its
      readiness sample's. Their logits are computed a chunk at a time (`prompt-logprobs-in-chunks`).
    Any other call that fits upstream's batch keeps it (a larger one would only pad it), so the programs are two
    row counts at most (`sampling-rows`). Can go when upstream sizes its sampling batches to the call."""
    from tx.tinker.backends import jax as backend

    upstream_sample = backend.JaxBackendImpl.sample

    def larger(engine, batch) -> int | None:
        rows = engine.config.sample_max_num_sequences
        if rows <= 0 or not rows_are_short([len(p) for p in batch.all_prompts],
                                           [p.max_tokens for p in batch.all_sampling_params], factor):
            return None
        if batch.needs_prompt_logprobs:
            return rows * min(factor, EVALUATION_ROWS_FACTOR)
        return rows * factor if len(batch.all_prompts) > rows else None

    @functools.wraps(upstream_sample)  # its annotations serialise the broadcast call (see above)
    def sample(self, prepared_batch):
        rows, chosen = self.config.sample_max_num_sequences, larger(self, prepared_batch)
        if chosen is None:
            return upstream_sample(self, prepared_batch)
        self.config.sample_max_num_sequences = chosen
        try:
            return upstream_sample(self, prepared_batch)
        finally:
            self.config.sample_max_num_sequences = rows  # the engine serves one batch at a time

    backend.JaxBackendImpl.sample = sample


def base_weights_loaded_not_drawn() -> None:
    """The engine builds its model with `models.base_weights_not_drawn`: upstream's backend loads the base weights
    right after (`base-weights-not-drawn`)."""
    from tx.tinker.backends import jax as backend

    upstream = backend.get_model_class
    if hasattr(upstream, "upstream"):
        return

    def get_model_class(config):
        model_class = upstream(config)

        def build(*args, **kwargs):
            with models.base_weights_not_drawn():
                return model_class(*args, **kwargs)

        return build

    get_model_class.upstream = upstream
    backend.get_model_class = get_model_class


def base_layers_stacked() -> None:
    """Right after upstream's backend loads the base weights, the model's decoder stack holds its layers' frozen
    weights stacked by layer, in the dtype the scan computes in (`models.stack_base_layers`, `base-layers-stacked`)."""
    from tx.tinker.backends import jax as backend

    upstream = backend.load_safetensors
    if hasattr(upstream, "upstream"):
        return

    @functools.wraps(upstream)
    def load_safetensors(checkpoint_path, config, model, *args, **kwargs):
        import jax

        loaded = upstream(checkpoint_path, config, model, *args, **kwargs)
        models.stack_base_layers(model)
        if jax.default_backend() == "cpu":  # why a step takes what it takes here (1.3-1.7x as long without)
            backend.logger.info(models.products_note(models.this_cpus_bfloat16_dot_instructions()))
        return loaded

    load_safetensors.upstream = upstream
    backend.load_safetensors = load_safetensors


# The backend's requests after which a rank hands its allocator's free memory back (`freed-memory-returned`): those
# of the evaluations and checkpoints, not a training step's (forward_backward, optim_step), which costs each step
# 5-20 ms of trimming and as much again in pages faulted back in, and whose next step reuses what the last one freed.
RETURNS_FREED_MEMORY = ("create_model", "forward", "sample", "save_checkpoint", "load_checkpoint",
                        "save_sampler_checkpoint", "delete_model")


def freed_memory_returned() -> None:
    """After an evaluation's or a checkpoint's request (`RETURNS_FREED_MEMORY`), every rank returns the memory its
    allocator holds free to the system (glibc's `malloc_trim`), so that the next program's buffers do not stack on
    it (`freed-memory-returned`).

    glibc keeps most of what a program frees: the buffers XLA allocates below the mmap threshold (which grows to 32
    MB as larger ones are freed) go back to the heap, not to the system. SmolLM2's demo rank held 300-500 MB so
    after its training and live reference, and its peak came in the restore check's sampling on top of them. Where
    the C library is not glibc, nothing changes."""
    import ctypes

    from tx.tinker.backends.jax import JaxBackendImpl

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return

    def returning(upstream):
        @functools.wraps(upstream)  # its annotations serialise the broadcast call
        def request(self, *args, **kwargs):
            try:
                return upstream(self, *args, **kwargs)
            finally:
                trim(0)

        request.returns_freed_memory = True
        return request

    for name in RETURNS_FREED_MEMORY:
        upstream = getattr(JaxBackendImpl, name)
        if not getattr(upstream, "returns_freed_memory", False):
            setattr(JaxBackendImpl, name, returning(upstream))


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
    base_weights_loaded_not_drawn()
    base_layers_stacked()
    optimizer_compile_logged()
    every_program_compile_logged()
    optimizer_covers_its_own_slot()
    sample_prompts_share_a_bucket()
    sampling_batches_fit_the_call()
    packing.model_passes_pack_shared_prefixes()
    one_slot_gradient()
    adapter_config_without_peft()
    freed_memory_returned()  # last: around every other change to these requests


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
    told there is no torch, and peft would load at its first use (`rank-imports`), which a rank does not reach: its
    sampler saves write their config without peft (`adapter-config-without-peft`)."""
    os.environ.setdefault("USE_TORCH", "0")
    if os.environ["USE_TORCH"].upper() in ("0", "FALSE", "OFF", "NO"):
        defer_import("peft")  # (torch, when asked for, walks the imported modules and would load it mid-import)


# What peft's `LoraConfig(base_model_name_or_path=..., r=..., lora_alpha=...).save_pretrained` writes, but for those
# three, with the peft the project pins (constraints.txt); tests/test_rank_imports.py holds it to peft's own file.
PEFT_LORA_CONFIG = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None, "auto_mapping": None, "bias": "none",
    "corda_config": None, "ensure_weight_tying": False, "eva_config": None, "exclude_modules": None,
    "fan_in_fan_out": False, "inference_mode": False, "init_lora_weights": True, "kasa_config": None,
    "layer_replication": None, "layers_pattern": None, "layers_to_transform": None, "loftq_config": {},
    "lora_bias": False, "lora_dropout": 0.0, "lora_ga_config": None, "megatron_config": None,
    "megatron_core": "megatron.core", "modules_to_save": None, "monteclora_config": None, "peft_type": "LORA",
    "peft_version": "0.21.2", "qalora_group_size": 16, "rank_pattern": {}, "revision": None, "target_modules": None,
    "target_parameters": None, "task_type": None, "trainable_token_indices": None, "use_bdlora": None,
    "use_dora": False, "use_qalora": False, "use_rslora": False, "velora_config": None,
}


class AdapterConfig:
    """peft's `LoraConfig` as far as upstream's sampler save uses it (`adapter-config-without-peft`): the same
    `adapter_config.json`, byte for byte, without importing peft, which imports torch."""

    def __init__(self, *, base_model_name_or_path: str, r: int, lora_alpha: float):
        self.values = {**PEFT_LORA_CONFIG, "base_model_name_or_path": base_model_name_or_path, "r": r,
                       "lora_alpha": lora_alpha}

    def save_pretrained(self, save_directory) -> None:
        import json
        from pathlib import Path

        Path(save_directory).mkdir(parents=True, exist_ok=True)
        # peft's own writing: sorted keys, an indent of 2, no newline at the end
        (Path(save_directory) / "adapter_config.json").write_text(json.dumps(self.values, indent=2, sort_keys=True))


def adapter_config_without_peft() -> None:
    """A sampler save writes its `adapter_config.json` with `AdapterConfig` instead of peft
    (`adapter-config-without-peft`). Upstream's save builds peft's `LoraConfig` for that one file, and importing
    peft imports torch, which then stays in the rank for the rest of its life: ~194 MB resident on a SmolLM2 rank
    from its first sampler save on (216 MB in a bare process)."""
    import tx.utils.models as upstream_models

    upstream_models.peft = types.SimpleNamespace(LoraConfig=AdapterConfig)


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
