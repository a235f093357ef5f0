"""SkyRL-tx's model code as every rank and the export's reference run it: a tied output head that reads the weights it
is given (`tied-head-from-arguments`), the decoder layers under one scan (`scanned-layers`), the tied head's LoRA
(`tied-head-lora`), one prefill per distinct prompt of a sampling batch (`prefill-once-per-prompt`), no forward pass
after a sampling batch's last token (`no-forward-after-the-last-token`), prompt logprobs a chunk at a time
(`prompt-logprobs-in-chunks`), on a CPU, a bfloat16 model's layers computed in float32
(`scan-in-float32-on-cpu`) and keeping only their projections' outputs for the backward
(`widened-layers-keep-their-dots`), on a CPU with bfloat16 dot instructions its projections and tied head multiplied
in bfloat16 into float32 (`bfloat16-products-on-cpu`), a bfloat16 embedding's rows taken as bits
(`embedding-rows-as-bits`), base weights loaded, not drawn first (`base-weights-not-drawn`), and the engine's layers'
frozen weights held stacked by layer (`base-layers-stacked`).
`tied-head-from-arguments`, `scanned-layers`, `prefill-once-per-prompt` and `prompt-logprobs-in-chunks` leave every
number the model computes as it was, up to float32 rounding (tests/test_scanned_layers.py, tests/test_prefill_once.py,
tests/test_prompt_logprobs_in_chunks.py); they change what XLA is asked to compile. `scan-in-float32-on-cpu` rounds
the layers' figures less."""

from __future__ import annotations

import contextlib
import functools


def tied_head(embed):
    """The output head of a model that ties it to its embedding `embed` (a LoRAEmbed), with the embedding's LoRA
    (`tied-head-lora`): logits = h (E + s A B)^T = h E^T + s (h B^T) A^T, for each example its own adapter's A
    (vocab x r), B (r x hidden) and scale s. The same matrix as the input side's `E[token] + s A[token] B`: an
    adapter that trains the unembedding of a tied model trains the one matrix both ends share, which is what its
    merged model holds. Upstream's `LoRAEmbed.T` drops the adapter.

    Every adapter slot's LoRA in one product, each example's other slots masked to zero (a gather of A per
    example would be vocab x r per token); computed only when an example's adapter trains the embedding (a
    nonzero scale), so the programs of adapters that do not pay nothing for it."""
    import jax
    import jax.numpy as jnp

    def head(hidden_states, adapter_indices=None):
        embedding = embed.embedding[...]
        if multiplies_in_bfloat16(embedding):  # (`bfloat16-products-on-cpu`), rounded to upstream's dtype
            logits = bfloat16_product(hidden_states, embedding, contract=1).astype(
                jnp.result_type(hidden_states, embedding))
        else:
            logits = hidden_states @ embedding.T
        if adapter_indices is None or embed.max_lora_adapters == 0:
            return logits
        scale = embed.lora_scaling[...][adapter_indices]  # (batch,): 0 for an adapter without the embedding

        def with_lora(logits):
            lora_a, lora_b = embed.lora_A[...], embed.lora_B[...]  # (slots, vocab, r), (slots, r, hidden)
            inner = jnp.einsum("bth,nrh->btnr", hidden_states, lora_b.astype(hidden_states.dtype))
            own = jax.nn.one_hot(adapter_indices, lora_a.shape[0], dtype=inner.dtype) * scale[:, None]
            delta = jnp.einsum("btnr,nvr->btv", inner * own[:, None, :, None], lora_a.astype(inner.dtype))
            return logits + delta.astype(logits.dtype)

        return jax.lax.cond(jnp.any(scale != 0), with_lora, lambda logits: logits, logits)

    return head


def tied_head_reads_its_arguments() -> None:
    """The tied output head multiplies by the embedding of the model it is called on (`tied-head-from-arguments`), with
    its LoRA (`tied-head-lora`).

    Upstream stores `self.lm_head = self.model.embed_tokens.T` at construction: a lambda bound to the
    embedding module the model was built with. A jitted program rebuilds the model from its arguments
    (`nnx.merge`), but that lambda still reads the original module's concrete array, so XLA received the
    49,152 x 576 embedding as a constant and folded it ("slow_operation_alarm: Constant folding ...
    f32[576,49152]") into every program that computes logits. Can go when upstream resolves the head on
    the module it is called on, with its adapter."""
    from tx.models.llama3 import Llama3ForCausalLM
    from tx.models.qwen3 import Qwen3ForCausalLM

    def replacing(upstream_head):
        def get_lm_head(self):
            return tied_head(self.model.embed_tokens) if self.config.tie_word_embeddings else self.lm_head

        get_lm_head.upstream = upstream_head  # what it replaced, which a test puts back
        return get_lm_head

    for model_class in (Llama3ForCausalLM, Qwen3ForCausalLM):
        if not hasattr(model_class.get_lm_head, "upstream"):
            model_class.get_lm_head = replacing(model_class.get_lm_head)


def scanned(upstream_call):
    """A decoder stack's `__call__` that runs its layers under `jax.lax.scan` (`scanned-layers`), or upstream's loop
    where a scan cannot serve (every layer's hidden state asked for, or layers of different structure) or costs
    more than it saves: a decode step. Its one token per row is too little work to hide that XLA on CPU copies
    each layer's weights out of the stack inside the loop (for SmolLM2, 270 MB per token; 0.23 s a step against
    0.10-0.13 s in upstream's loop), and the decode program is the smallest one to compile unrolled.

    On a CPU a bfloat16 model's layers run in float32 under the scan (`scan-in-float32-on-cpu`): their weights are
    widened once per call, after the stack, and the layers compute in float32 (`widened`); on a CPU with bfloat16 dot
    instructions the projections' kernels stay bfloat16, carried as their bits, and multiply bfloat16 operands into
    float32 (`bfloat16-products-on-cpu`). Where the engine holds the frozen weights stacked so already
    (`base-layers-stacked`), only the LoRA weights are widened."""

    def __call__(self, input_ids, *, attention_mask, positions, output_hidden_states=None, adapter_indices=None,
                 kv_cache=None):
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from tx.models.types import ModelOutput
        from tx.utils.generator import KVCache

        layers = [nnx.split(layer) for layer in self.layers]
        graphdef = layers[0][0]
        wants_hidden = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        decode_step = kv_cache is not None and input_ids.shape[1] == 1
        if decode_step or wants_hidden or any(other != graphdef for other, _ in layers[1:]):
            return upstream_call(self, input_ids, attention_mask=attention_mask, positions=positions,
                                 output_hidden_states=output_hidden_states, adapter_indices=adapter_indices,
                                 kv_cache=kv_cache)
        # The layers' weights stacked along a new first axis: the engine's state keeps upstream's per-layer layout,
        # which its checkpoints, its LoRA slots and txflow's exports address. The frozen ones come stacked
        # already where the engine holds them so (`base-layers-stacked`); the rest are stacked here, in the program.
        weights = stacked_layers(self, [state for _, state in layers])
        cache = None if kv_cache is None else (jnp.stack(kv_cache.keys), jnp.stack(kv_cache.values))
        hidden = self.embed_tokens(input_ids, adapter_indices=adapter_indices)
        outer_dtype, wide = hidden.dtype, widened(weights, projection_kernels(self.layers[0]))
        if wide is not None:
            weights, hidden = wide, hidden.astype(jnp.float32)

        def layer_step(hidden, weights_and_cache):
            layer_weights, layer_cache = weights_and_cache
            layer = nnx.merge(graphdef, layer_weights)
            if wide is not None:
                in_float32(layer)
            hidden, (keys, values) = layer(
                hidden, attention_mask=attention_mask, positions=positions, adapter_indices=adapter_indices,
                kv_cache=layer_cache)
            # The KV cache in the model's dtype as each layer's keys and values leave it: stacked in float32 first,
            # a 32-row sampling batch of SmolLM2 held ~190 MB of float32 keys and values and their bfloat16 copies.
            return hidden, (keys.astype(outer_dtype), values.astype(outer_dtype))

        if wide is not None:
            # For the backward, a widened layer keeps its projections' outputs and computes the rest again (norms,
            # activations, rotary embedding, attention's scores and weights): cheap to recompute, and the loop saves
            # and zero-fills less (`widened-layers-keep-their-dots`). Its figures move by float32 rounding (XLA
            # fuses otherwise), which a bfloat16 model's widened layers are far coarser than; a float32 model's
            # layers keep upstream's figures to the last bits that tests/test_scanned_layers.py holds.
            layer_step = jax.checkpoint(layer_step, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                                        prevent_cse=False)
        hidden, (keys, values) = jax.lax.scan(layer_step, hidden, (weights, cache))
        if wide is not None:  # what follows the layers (the norm, the head) keeps the model's dtype
            hidden = hidden.astype(outer_dtype)
        return ModelOutput(last_hidden_state=self.norm(hidden),
                           kv_cache=KVCache.update(kv_cache, list(keys), list(values), positions, attention_mask),
                           hidden_states=None)

    __call__.upstream = upstream_call
    return __call__


STACKED = "txflow_stacked_layers"  # the decoder stack's attribute that holds its layers' frozen weights stacked


@functools.cache
def stacked_base():
    """The variable type of a decoder layers' frozen weight stacked by layer (`base-layers-stacked`): not a LoRA
    weight, so upstream's split puts it with the base weights, which every program takes as arguments and nothing
    trains or saves."""
    from flax import nnx

    return type("StackedBase", (nnx.Variable,), {"__module__": __name__})


def frozen_leaf(path) -> bool:
    """Whether a layer's weight at `path` stays as loaded: every weight but the LoRA factors and the per-slot
    ranks and scales (`lora_*`), which `create_model` and training change."""
    return not any(str(getattr(key, "key", "")).startswith("lora_") for key in path)


def leaf_name(path) -> str:
    """A layer's weight's name in the stack's dict: its path within the layer ("mlp.down_proj.kernel")."""
    return ".".join(str(key.key) for key in path if hasattr(key, "key"))


def stacked_layers(stack, per_layer: list):
    """The decoder layers' weights (`per_layer`, each layer's state) stacked along a new first axis: the frozen
    ones read from the decoder stack's `STACKED` where the engine holds them (`base-layers-stacked`), the others
    (LoRA) stacked here."""
    import jax
    import jax.numpy as jnp

    held = getattr(stack, STACKED, None)

    def one(path, *leaves):
        name = leaf_name(path)
        if held is not None and name in held:  # (it holds the frozen ones only)
            return held[name][...]
        return jnp.stack(leaves)

    return jax.tree_util.tree_map_with_path(one, *per_layer)


def stack_base_layers(model) -> bool:
    """Gives the model's decoder stack its layers' frozen weights stacked by layer, in the dtype its scan computes
    in (`widened`), as `stacked_base` variables under `STACKED` (`base-layers-stacked`); each keeps its layer's
    sharding, a layer axis first. Once, right after the base weights' load: nothing changes them later. False,
    and nothing held, where the layers differ in structure (the stack does not scan them)."""
    import jax
    from flax import nnx

    stack = getattr(model, "model", None)
    layers = getattr(stack, "layers", None)
    if not layers or hasattr(stack, STACKED):
        return False
    split = [nnx.split(layer) for layer in layers]
    if any(graphdef != split[0][0] for graphdef, _ in split[1:]):
        return False

    def frozen(state) -> dict:
        leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return {leaf_name(path): variable for path, variable in leaves if frozen_leaf(path)}

    per_layer = [frozen(state) for _, state in split]
    first = per_layer[0]
    kernels = projection_kernels(layers[0])

    def build(arrays):
        stacked = {name: jax.numpy.stack([layer[name] for layer in arrays]) for name in arrays[0]}
        return widened(stacked, kernels) or stacked

    def sharding_of(array):
        sharding = array.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec))
        return sharding

    arrays = [{name: variable[...] for name, variable in layer.items()} for layer in per_layer]
    out = jax.jit(build, out_shardings={name: sharding_of(array) for name, array in arrays[0].items()})(arrays)
    held = {}
    for name, array in out.items():
        names = first[name].get_metadata().get("out_sharding")
        held[name] = stacked_base()(array, **({"out_sharding": (None, *names)} if names else {}))
    setattr(stack, STACKED, nnx.Dict(held))
    return True


def widened(stacked_weights, kernels=frozenset()):
    """The layers' stacked weights as a CPU's scan computes with them when they hold bfloat16
    (`scan-in-float32-on-cpu`), else None: the projections' kernels named in `kernels` as their bits (uint16) where
    the CPU multiplies bfloat16 (`bfloat16-products-on-cpu`), every other bfloat16 weight in float32.

    XLA's CPU runtime converts a bfloat16 dot's operands to float32 (it multiplies bfloat16 only into a float32
    result), and under the scan it did so for each layer in the forward and again in the backward: widened once
    per call, SmolLM2's SFT step took about half the time for ~0.4 GB more at its peak (docs/performance.md). A
    kernel multiplied in bfloat16 is carried through the scan as its bits: XLA widens a bfloat16 array that a
    loop slices, to float32, before the loop (the whole stack, at every call), and leaves 16-bit integers alone.
    The model's state stays bfloat16, and so do its checkpoints and exports; the engine holds the stack beside it
    (`base-layers-stacked`). A GPU or TPU multiplies bfloat16 natively, so it keeps the model's dtype."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "cpu" or not any(w.dtype == jnp.bfloat16 for w in jax.tree.leaves(stacked_weights)):
        return None
    as_bits = kernels if bfloat16_products_on_this_cpu() else frozenset()

    def one(path, w):
        if w.dtype != jnp.bfloat16:
            return w
        if leaf_name(path) in as_bits:
            return bits_of(w)
        return w.astype(jnp.float32)

    return jax.tree_util.tree_map_with_path(one, stacked_weights)


def projection_kernels(layer) -> frozenset:
    """The names (`leaf_name`'s) of a decoder layer's LoRA linear layers' kernels: the weights its scan may hold as
    bfloat16 bits (`bfloat16-products-on-cpu`)."""
    from flax import nnx
    from tx.layers.lora import LoRALinear

    return frozenset(".".join(map(str, path)) + ".kernel" for path, module in nnx.iter_modules(layer)
                     if isinstance(module, LoRALinear))


def bfloat16_products_on_this_cpu() -> bool:
    """Whether this process computes on a CPU with bfloat16 dot instructions (`bfloat16-products-on-cpu`): there
    XLA's CPU runtime hands a dot of bfloat16 operands with a float32 result to its YNNPACK kernels, which multiply
    in bfloat16 at several times the float32 rate (`bfloat16_dot_instructions`). Elsewhere the layers compute in
    float32 as before."""
    return this_cpus_bfloat16_dot_instructions() is not None


@functools.cache
def this_cpus_bfloat16_dot_instructions() -> str | None:
    """`bfloat16_dot_instructions` of the CPU this process computes on; None off a CPU backend."""
    import jax

    if jax.default_backend() != "cpu":
        return None
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return bfloat16_dot_instructions(cpuinfo.read())
    except OSError:
        return None


def bfloat16_dot_instructions(cpuinfo: str) -> str | None:
    """The bfloat16 dot instructions that XLA's YNNPACK kernels use on a CPU whose /proc/cpuinfo reads `cpuinfo`,
    by their flag, else None: AMX's tiles (`amx_bf16`; 1.7 TFLOP/s against 0.33 in float32 for a 1024-cube on 2
    cores) or AVX-512's bfloat16 dot products (`avx512_bf16`, as on AMD's Zen 4: 389 against 188 GFLOP/s, and
    SmolLM2's SFT forward_backward 1.11 s against 1.82 s; docs/performance.md). Not measured on CPUs with neither."""
    import re

    flags = set(re.findall(r"\b(amx_bf16|avx512_bf16)\b", cpuinfo))
    return next((flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags), None)


def products_note(instructions: str | None) -> str:
    """What a rank logs once about how a bfloat16 model's layers multiply on its CPU, whose bfloat16 dot
    `instructions` are given (`bfloat16_dot_instructions`): a step takes 1.3-1.7x as long without them."""
    if instructions:
        return (f"this CPU multiplies bfloat16 ({instructions}): a bfloat16 model's projections and tied head "
                "multiply bfloat16 into float32 (bfloat16-products-on-cpu)")
    return ("this CPU has no bfloat16 dot instructions (amx_bf16, avx512_bf16): a bfloat16 model's layers compute in "
            "float32 (scan-in-float32-on-cpu), 1.3-1.7x slower a step than on a CPU that has them")


def bits_of(x):
    """A bfloat16 array's bits, as uint16: where XLA's CPU runtime widens a bfloat16 array to float32 (a loop's
    slice of it, a gather from it, a slice written into it), it leaves 16-bit integers as they are."""
    import jax
    import jax.numpy as jnp

    return jax.lax.bitcast_convert_type(x, jnp.uint16)


def bfloat16_of(bits):
    """The bfloat16 array of `bits` (uint16), as `bits_of` took them."""
    import jax
    import jax.numpy as jnp

    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


@functools.cache
def bfloat16_product_of(dtype, contract: int):
    """`bfloat16_product` for inputs of `dtype` and a weight contracted on its axis `contract`."""
    import jax
    import jax.numpy as jnp

    def bfloat16(weight):
        return bfloat16_of(weight) if weight.dtype == jnp.uint16 else weight

    def multiply(a, b, dims):
        return jax.lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), (dims, ((), ())),
                                   preferred_element_type=jnp.float32)

    @jax.custom_vjp
    def product(x, weight):
        return multiply(x, bfloat16(weight), ((x.ndim - 1,), (contract,)))

    def forward(x, weight):
        # The weight as given (the scan's slice of the stack, which the loop then need not save again) and, for a
        # bfloat16 weight, the input its gradient needs.
        return product(x, weight), (weight, None if weight.dtype == jnp.uint16 else x.astype(jnp.bfloat16))

    def backward(residuals, g):
        weight, x = residuals
        dx = multiply(g, bfloat16(weight), ((g.ndim - 1,), (1 - contract,))).astype(dtype)
        if x is None:  # bits of a frozen weight: no gradient
            return dx, None
        lead = tuple(range(x.ndim - 1))
        dw = multiply(x, g, (lead, lead)) if contract == 0 else multiply(g, x, (lead, lead))
        return dx, dw.astype(weight.dtype)

    product.defvjp(forward, backward)
    return product


def bfloat16_product(x, weight, contract: int = 0):
    """x times `weight` (bfloat16, or its bits as uint16), contracting x's last axis with the weight's axis
    `contract` (0 for a kernel, in x out; 1 for an embedding, vocabulary x hidden), multiplied in bfloat16 into a
    float32 result (`bfloat16-products-on-cpu`). Its gradient is multiplied the same way: the gradient's rows
    rounded to bfloat16, as a bfloat16 model's are."""
    return bfloat16_product_of(x.dtype, contract)(x, weight)


def multiplies_in_bfloat16(weight) -> bool:
    """Whether a product with `weight` is multiplied in bfloat16 (`bfloat16-products-on-cpu`): its bits (only a
    scan on such a CPU holds them), or a bfloat16 weight on such a CPU."""
    import jax.numpy as jnp

    return weight.dtype == jnp.uint16 or (weight.dtype == jnp.bfloat16 and bfloat16_products_on_this_cpu())


def linear_in_bfloat16_products(upstream_call):
    """A LoRA linear layer's `__call__` whose base product is multiplied in bfloat16 into float32
    (`bfloat16-products-on-cpu`) where `multiplies_in_bfloat16`, then rounded to the layer's dtype as upstream's
    product is; its LoRA is upstream's. Elsewhere upstream's."""

    def __call__(self, x, adapter_indices=None):
        kernel = self.kernel[...]
        if not multiplies_in_bfloat16(kernel):
            return upstream_call(self, x, adapter_indices)
        out = bfloat16_product(x, kernel)
        if self.bias is not None:
            out = out + self.bias[...]
        return self.apply_lora(x, out.astype(self.dtype), adapter_indices)

    __call__.upstream = upstream_call
    return __call__


def embedding_rows_as_bits(upstream_call):
    """A LoRA embedding's `__call__` that, for a bfloat16 embedding on a CPU, takes its rows through their bits
    (`embedding-rows-as-bits`): the same rows, bit for bit, then upstream's LoRA. Elsewhere upstream's."""

    def __call__(self, x, adapter_indices=None):
        import jax
        import jax.numpy as jnp

        embedding = self.embedding[...]
        if embedding.dtype != jnp.bfloat16 or self.dtype != jnp.bfloat16 or self.num_embeddings == 1 \
                or jax.default_backend() != "cpu":
            return upstream_call(self, x, adapter_indices)
        return self.apply_lora(x, bfloat16_of(jnp.take(bits_of(embedding), x, axis=0)), adapter_indices)

    __call__.upstream = upstream_call
    return __call__


def embedding_rows_taken_as_bits() -> None:
    """A bfloat16 embedding's rows are taken through their bits on a CPU (`embedding-rows-as-bits`).

    XLA's CPU runtime gathers from a bfloat16 array by widening the whole array to float32 first: SmolLM2's
    embedding (49,152 x 576) became a 108 MB float32 copy in the training program, for 256 rows, and in the
    sampling program, where the decoding loop's copy was held through the batch. Can go when XLA gathers
    bfloat16 rows as they are."""
    from tx.layers.lora import LoRAEmbed

    if not hasattr(LoRAEmbed.__call__, "upstream"):
        LoRAEmbed.__call__ = embedding_rows_as_bits(LoRAEmbed.__call__)


def projections_multiply_in_bfloat16() -> None:
    """On a CPU with bfloat16 dot instructions (AMX, AVX-512 BF16), a bfloat16 model's projections and tied head
    multiply bfloat16 into float32 (`bfloat16-products-on-cpu`), through XLA's YNNPACK kernels.

    XLA's CPU runtime converts the operands of a bfloat16 dot with a bfloat16 result (upstream's) to float32 and
    multiplies in float32; only a dot of bfloat16 operands into a float32 result reaches the kernels that use
    the CPU's bfloat16 instructions. For the same figures a bfloat16 model computes (bfloat16 operands), the
    products come out summed in float32 instead of rounded per layer, and no program holds its weights in float32:
    SmolLM2's SFT forward_backward 0.58 s against 0.98 s, a sampling batch 0.86 s against 1.49 s, the sampling
    program's buffers 0.90 GiB against 1.52 GiB (docs/performance.md). Can go when XLA multiplies bfloat16 dots
    on a CPU's bfloat16 units itself."""
    from tx.layers.lora import LoRALinear

    if not hasattr(LoRALinear.__call__, "upstream"):
        LoRALinear.__call__ = linear_in_bfloat16_products(LoRALinear.__call__)


def in_float32(layer) -> None:
    """A decoder layer (rebuilt inside the scan's step, so this changes nothing outside it) that computes in
    float32: every submodule of bfloat16 `dtype` (the projections with their LoRA, the norms, the attention)
    casts its inputs and weights to float32 instead."""
    import jax.numpy as jnp
    from flax import nnx

    for _, module in nnx.iter_modules(layer):
        if getattr(module, "dtype", None) == jnp.bfloat16:
            module.dtype = jnp.float32


def decoder_layers_scanned() -> None:
    """The Llama and Qwen3 decoder stacks compile one layer and loop over it (`scanned-layers`).

    Upstream runs `for layer_idx, layer in enumerate(self.layers)`, so every program traced and compiled
    each of a model's layers anew: 30 copies for SmolLM2, in the training program, its gradient, and both
    halves (prefill, decode) of the sampling program; 82-96 s per program on 2 cores. Under a scan XLA
    compiles one layer. Can go when upstream scans its layers."""
    from tx.models.llama3 import Llama3Model
    from tx.models.qwen3 import Qwen3Model

    for model_class in (Llama3Model, Qwen3Model):
        if not hasattr(model_class.__call__, "upstream"):
            model_class.__call__ = scanned(model_class.__call__)


def tied_models_train_the_unembedding() -> None:
    """`init_lora_adapter` initialises the embedding's LoRA of a tied model for `train_unembed` (`tied-head-lora`).

    Upstream refuses it ("train_unembed=True is incompatible with tie_word_embeddings=True") because its
    tied head drops the adapter; `tied_head` applies it. Its check reads the model's config and nothing else
    does inside it: the config says untied for the length of the call. Can go with `tied_head`."""
    from tx.layers import lora
    from tx.tinker.backends import jax as backend

    upstream = lora.init_lora_adapter
    if hasattr(upstream, "upstream"):
        return

    @functools.wraps(upstream)
    def init_lora_adapter(model, adapter_index, lora_config):
        config = model.config
        if not (lora_config.train_unembed and getattr(config, "tie_word_embeddings", False)):
            return upstream(model, adapter_index, lora_config)
        config.tie_word_embeddings = False
        try:
            return upstream(model, adapter_index, lora_config)
        finally:
            config.tie_word_embeddings = True

    init_lora_adapter.upstream = upstream
    lora.init_lora_adapter = backend.init_lora_adapter = init_lora_adapter


def shared_prompts(input_ids, attention_mask, adapter_indices) -> tuple | None:
    """For a sampling batch whose rows repeat a prompt (the same tokens for the same adapter): the rows to
    prefill, padded to a power of two (each count is a program of its own), and for every row the index of its
    prompt among them. None when that saves nothing, or in a job of several processes, whose batch is not all
    on this host."""
    import jax
    import numpy as np

    if jax.process_count() > 1:
        return None
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
    adapters = np.zeros(len(ids), np.int32) if adapter_indices is None else np.asarray(adapter_indices)
    first: dict[tuple, int] = {}
    row_of = [first.setdefault((int(adapters[i]), ids[i][mask[i] == 1].tobytes()), len(first))
              for i in range(len(ids))]
    unique_rows = [row_of.index(k) for k in range(len(first))]
    rows = 1 << (len(unique_rows) - 1).bit_length()
    if rows >= len(ids):
        return None
    return (np.asarray(unique_rows + [unique_rows[0]] * (rows - len(unique_rows)), np.int32),
            np.asarray(row_of, np.int32))


class PrefillOnce:
    """The model as the sampling program sees it, but its prefill (the call without a KV cache) runs on the
    batch's distinct prompts only and hands every row its prompt's hidden states and KV cache."""

    def __init__(self, model, unique_rows, row_of):
        self._model, self._unique_rows, self._row_of = model, unique_rows, row_of

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, *, attention_mask, adapter_indices=None, kv_cache=None, **kwargs):
        import jax

        if kv_cache is not None:
            return self._model(input_ids, attention_mask=attention_mask, adapter_indices=adapter_indices,
                               kv_cache=kv_cache, **kwargs)
        rows = self._unique_rows
        out = self._model(input_ids[rows], attention_mask=attention_mask[rows],
                          adapter_indices=None if adapter_indices is None else adapter_indices[rows], **kwargs)
        return jax.tree.map(lambda x: x[self._row_of], out)  # every array of it has the batch first


# The arguments of upstream's sampling program (`GeneratorMixin._prefill_and_decode`) that it is compiled for.
SAMPLING_STATIC = ("max_length", "max_new_tokens", "max_top_k", "use_top_p", "prompt_logprobs")


def prefill_and_decode(model, input_ids, attention_mask, max_length, max_new_tokens, adapter_indices, temperatures,
                       rngs, stop_tokens, top_k_values, top_p_values, max_top_k, use_top_p, prompt_logprobs=False):
    """Upstream's sampling program (`GeneratorMixin._prefill_and_decode` of SkyRL-tx 0.3.0, its code as it is but
    for the loop's end and its draws), which stops the decoding loop one forward pass earlier
    (`no-forward-after-the-last-token`) and draws each token only the way its batch needs (`one-draw-per-token`).

    Upstream's loop takes `max_new_tokens` steps, each sampling a token from the logits the step before computed
    and then running the model on that token for the next step's logits. The last step's forward pass computes
    logits nothing reads. Here the loop takes one step fewer and the last token is sampled after it, from the
    logits its last step computed, with the same keys: the same tokens, logprobs and stop positions."""
    import jax
    import jax.numpy as jnp
    from tx.utils.generator import DecodeState, apply_top_k_batch, apply_top_p_batch

    outputs = model(input_ids, attention_mask=attention_mask, adapter_indices=adapter_indices)
    last_token_idx = attention_mask.sum(axis=1) - 1
    batch_idx = jnp.arange(input_ids.shape[0])
    if prompt_logprobs:
        all_logits = model.compute_logits(outputs.last_hidden_state, adapter_indices)
        last_logits = all_logits[batch_idx, last_token_idx, :]
        prompt_logprobs_array = model.logits_to_logprobs(all_logits[:, :-1, :], input_ids[:, 1:])
    else:
        last_hidden = outputs.last_hidden_state[batch_idx, last_token_idx][:, None, :]
        last_logits = model.compute_logits(last_hidden, adapter_indices)[:, 0, :]
        prompt_logprobs_array = None
    kv_cache = outputs.kv_cache.pad_to_length(max_length)
    decode_attention_mask = jnp.pad(attention_mask, ((0, 0), (0, max_length - attention_mask.shape[1])))

    def choose(s: DecodeState, step):
        """A step's token from the logits in `s`, as upstream's `decode_fn` samples it: the token, its logprob,
        the next keys and the stop positions."""
        split_keys = jax.vmap(jax.random.split)(s.rngs)
        rngs, sample_keys = split_keys[:, 0], split_keys[:, 1]
        zero_temp_mask = temperatures == 0.0

        def sampled():
            scaled_logits = s.logits / jnp.where(zero_temp_mask, 1.0, temperatures)[:, None]
            if max_top_k > 0:
                scaled_logits = apply_top_k_batch(scaled_logits, top_k_values, max_top_k)
            if use_top_p:
                scaled_logits = apply_top_p_batch(scaled_logits, top_p_values)
            return jax.vmap(lambda key, logit: jax.random.categorical(key, logit, axis=-1))(sample_keys,
                                                                                           scaled_logits)

        def greedy():
            return jnp.argmax(s.logits, axis=-1)

        def either():
            return jnp.where(zero_temp_mask, greedy(), sampled())

        # Upstream draws every row's token both ways and keeps one per row. A batch is mostly of one kind (an
        # evaluation's greedy rows, an RL group's sampled ones), and its other draw is not free on a CPU: a
        # categorical draw over 49,152 logits a row (its noise, then an argmax), or an argmax. Only the
        # branch the batch needs runs (`one-draw-per-token`); a row's token is the one upstream's `where` keeps.
        kind = jnp.where(jnp.all(zero_temp_mask), 0, jnp.where(jnp.any(zero_temp_mask), 2, 1))
        next_token = jax.lax.switch(kind, [greedy, sampled, either])[:, None]
        sampled_logprob = model.logits_to_logprobs(s.logits, next_token[:, 0])[:, None]
        is_stop = jnp.any(next_token == stop_tokens, axis=1)
        stop_pos = jnp.where((s.stop_pos == -1) & is_stop, step + 1, s.stop_pos)
        return next_token, sampled_logprob, rngs, stop_pos

    def decode_fn(s: DecodeState, step):
        next_token, sampled_logprob, rngs, stop_pos = choose(s, step)
        next_attention_mask = s.attention_mask.at[jnp.arange(s.attention_mask.shape[0]),
                                                  s.kv_cache.cache_position].set(1)
        outputs = model(next_token, attention_mask=next_attention_mask, positions=s.last_positions + 1,
                        kv_cache=s.kv_cache, adapter_indices=adapter_indices)
        next_logits = model.compute_logits(outputs.last_hidden_state, adapter_indices)[:, 0, :]
        return DecodeState(kv_cache=outputs.kv_cache, rngs=rngs, attention_mask=next_attention_mask,
                           last_positions=s.last_positions + 1, logits=next_logits,
                           stop_pos=stop_pos), (next_token, sampled_logprob)

    initial_state = DecodeState(kv_cache=kv_cache, rngs=rngs, attention_mask=decode_attention_mask,
                                last_positions=last_token_idx[:, None], logits=last_logits,
                                stop_pos=jnp.full((input_ids.shape[0],), -1))
    state, (tokens, logprobs) = jax.lax.scan(decode_fn, initial_state, xs=jnp.arange(max(max_new_tokens - 1, 0)))
    new_tokens, new_logprobs = jnp.swapaxes(tokens, 0, 1).squeeze(-1), jnp.swapaxes(logprobs, 0, 1).squeeze(-1)
    if max_new_tokens == 0:  # a batch of prompt logprobs alone: no token, as upstream
        return new_tokens, new_logprobs, state.stop_pos, prompt_logprobs_array
    last_token, last_logprob, _, stop_pos = choose(state, max_new_tokens - 1)
    return (jnp.concatenate([new_tokens, last_token], axis=1), jnp.concatenate([new_logprobs, last_logprob], axis=1),
            stop_pos, prompt_logprobs_array)


def no_forward_after_the_last_token() -> None:
    """The sampling program runs no forward pass after its last token (`no-forward-after-the-last-token`):
    `prefill_and_decode` in place of upstream's. For the nightly's RL batches of 4 new tokens that is one of the
    program's 4 decoding passes (~0.15 s of SmolLM2's ~1.6 s batch here), and one of 8 in an evaluation. Can go
    when upstream's loop stops after its last token."""
    import jax
    from tx.utils.generator import GeneratorMixin

    current = GeneratorMixin._prefill_and_decode
    program = current
    while program is not None:  # this change, or another wrapped around it (their `upstream`), is in already
        if getattr(program, "replaced", None) is not None:
            return
        program = getattr(program, "upstream", None)
    program = jax.jit(prefill_and_decode, static_argnames=SAMPLING_STATIC)
    program.replaced = current  # upstream's program (not `upstream`: the changes wrapped around it call this one)
    GeneratorMixin._prefill_and_decode = staticmethod(program)


def prefill_once_per_prompt() -> None:
    """A sampling batch's rows that share a prompt are prefilled once (`prefill-once-per-prompt`).

    A request for `num_samples` completions (an RL group) becomes that many rows of the batch, and upstream's
    sampling program prefills each: for the nightly's RL groups of 4, three quarters of every prefill computed
    what the row before it had computed (an 8-row batch of 96 tokens: ~1.7 s of its ~2.9 s on 2 cores). The
    program prefills the batch's distinct (prompt, adapter) rows and gives each row its prompt's hidden states
    and KV cache; the decode is upstream's, per row, with its own seed. Same figures in float32
    (tests/test_prefill_once.py).

    Only for batches that ask for no prompt logprobs: every evaluation of txflow asks for them (greedy tokens
    and sequence logprobs), and its restore check compares a live sampler with a restored one exactly. A
    prefill of fewer rows rounds differently in bfloat16, and how many rows repeat depends on which requests
    the engine batched together (padding rows included), so those batches prefill every row (in the program of
    `prompt-logprobs-in-chunks`): a run's restore check failed (logprobs off by 0.25, greedy tokens different)
    when they did not. Can go when upstream shares a request's prefill across its samples."""
    import jax
    from tx.utils.generator import GeneratorMixin

    upstream = GeneratorMixin._prefill_and_decode
    if hasattr(upstream, "upstream"):
        return

    @functools.partial(jax.jit, static_argnames=SAMPLING_STATIC)
    def deduplicated(model, input_ids, attention_mask, max_length, max_new_tokens, adapter_indices, temperatures,
                     rngs, stop_tokens, top_k_values, top_p_values, max_top_k, use_top_p, prompt_logprobs=False, *,
                     unique_rows, row_of):
        return upstream.__wrapped__(PrefillOnce(model, unique_rows, row_of), input_ids, attention_mask, max_length,
                                    max_new_tokens, adapter_indices, temperatures, rngs, stop_tokens, top_k_values,
                                    top_p_values, max_top_k, use_top_p, prompt_logprobs=prompt_logprobs)

    def _prefill_and_decode(model, input_ids, attention_mask, max_length, max_new_tokens, adapter_indices,
                            temperatures, rngs, stop_tokens, top_k_values, top_p_values, max_top_k, use_top_p,
                            prompt_logprobs=False):
        args = (model, input_ids, attention_mask, max_length, max_new_tokens, adapter_indices, temperatures, rngs,
                stop_tokens, top_k_values, top_p_values, max_top_k, use_top_p)
        plan = None if prompt_logprobs else shared_prompts(input_ids, attention_mask, adapter_indices)
        if plan is None:
            return upstream(*args, prompt_logprobs=prompt_logprobs)
        return deduplicated(*args, prompt_logprobs=prompt_logprobs, unique_rows=plan[0], row_of=plan[1])

    _prefill_and_decode.upstream, _prefill_and_decode.deduplicated = upstream, deduplicated
    GeneratorMixin._prefill_and_decode = staticmethod(_prefill_and_decode)


# Positions whose logits a sampling batch's prompt logprobs compute at once (`prompt-logprobs-in-chunks`), and a
# model pass's logprobs (the engine's `loss_chunk_size`, `launch.backend_config`): SmolLM2's 49,152-token vocabulary
# makes that 25 MB in float32, held in several copies, and a chunk of 128 rows is still a full-size matmul (the
# same step times as 256 and 1024, measured).
LOGPROBS_CHUNK = 128


class PrefillLogits:
    """The logits of every position of a prefill, not computed: upstream's sampling program takes from them the
    last position's (to sample the first token) and every earlier position's logprob of the next token. Each is
    computed as it is asked for: the last position's from its hidden state alone, the logprobs a chunk of
    positions at a time (`prompt-logprobs-in-chunks`)."""

    def __init__(self, model, hidden_states, adapter_indices):
        self.model, self.hidden_states, self.adapter_indices = model, hidden_states, adapter_indices

    def __getitem__(self, key):
        rows, positions, vocab = key
        if vocab != slice(None):
            raise NotImplementedError(f"prefill logits indexed by {key!r}")
        if isinstance(rows, slice) and rows == slice(None) and isinstance(positions, slice):
            return PrefillLogits(self.model, self.hidden_states[:, positions], self.adapter_indices)
        if not isinstance(rows, slice) and not isinstance(positions, slice):  # one position of each row
            last = self.hidden_states[rows, positions][:, None, :]
            return self.model.compute_logits(last, self.adapter_indices)[:, 0, :]
        raise NotImplementedError(f"prefill logits indexed by {key!r}")


class PromptLogprobsInChunks:
    """The model as the sampling program sees it when the batch asks for prompt logprobs: a prefill's logits
    are a `PrefillLogits`; a decoding step's (one position) are computed as upstream does."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def compute_logits(self, hidden_states, adapter_indices=None):
        if hidden_states.shape[1] == 1:
            return self._model.compute_logits(hidden_states, adapter_indices)
        return PrefillLogits(self._model, hidden_states, adapter_indices)

    def logits_to_logprobs(self, logits, target_ids):
        if isinstance(logits, PrefillLogits):
            return self._model._compute_chunked_logprobs(logits.hidden_states, target_ids, LOGPROBS_CHUNK,
                                                         logits.adapter_indices)
        return self._model.logits_to_logprobs(logits, target_ids)


def prompt_logprobs_in_chunks() -> None:
    """A sampling batch that asks for prompt logprobs computes them `LOGPROBS_CHUNK` positions at a time,
    with the model's own chunked logprobs, as training computes its logprobs (`prompt-logprobs-in-chunks`).

    Upstream's program computes the output head at every position of every row (`rows x prompt x 49,152`
    float32 logits for SmolLM2: 100 MB for 8 rows of 64 tokens, held in several copies) and then takes the last
    position's and the logprob of each next token from them. The logits of a chunk of positions at a time hold
    its memory to one chunk's whatever the rows, so a batch of evaluation prompts can be as large as the
    call's other batches (`sampling-rows`). The figures are the same up to float32 rounding
    (tests/test_prompt_logprobs_in_chunks.py). Can go when upstream computes prompt logprobs in chunks."""
    import jax
    from tx.utils.generator import GeneratorMixin

    current = GeneratorMixin._prefill_and_decode
    if getattr(current, "in_chunks", None) is not None:
        return
    upstream = getattr(current, "upstream", current)

    @functools.partial(jax.jit, static_argnames=SAMPLING_STATIC)
    def in_chunks(model, input_ids, attention_mask, max_length, max_new_tokens, adapter_indices, temperatures, rngs,
                  stop_tokens, top_k_values, top_p_values, max_top_k, use_top_p, prompt_logprobs=False):
        return upstream.__wrapped__(PromptLogprobsInChunks(model), input_ids, attention_mask, max_length,
                                    max_new_tokens, adapter_indices, temperatures, rngs, stop_tokens, top_k_values,
                                    top_p_values, max_top_k, use_top_p, prompt_logprobs=prompt_logprobs)

    def _prefill_and_decode(model, input_ids, attention_mask, max_length, max_new_tokens, adapter_indices,
                            temperatures, rngs, stop_tokens, top_k_values, top_p_values, max_top_k, use_top_p,
                            prompt_logprobs=False):
        chosen = in_chunks if prompt_logprobs else current
        return chosen(model, input_ids, attention_mask, max_length, max_new_tokens, adapter_indices, temperatures,
                      rngs, stop_tokens, top_k_values, top_p_values, max_top_k, use_top_p,
                      prompt_logprobs=prompt_logprobs)

    _prefill_and_decode.upstream, _prefill_and_decode.in_chunks = upstream, in_chunks
    _prefill_and_decode.deduplicated = getattr(current, "deduplicated", None)
    GeneratorMixin._prefill_and_decode = staticmethod(_prefill_and_decode)


@contextlib.contextmanager
def base_weights_not_drawn():
    """Builds a model whose base weights are loaded next (upstream's `load_safetensors`, which replaces every one of
    them and fails on a key the checkpoint lacks) with zeros where upstream's kernels, embeddings and norms draw
    random values (`base-weights-not-drawn`): SmolLM2's draws took 1-1.6 s of every engine start and export, for
    values nothing read. Every key split happens as before (a layer takes its key, then calls the initialiser), and
    the LoRA factors' initialisers (zeros, and `init_lora_adapter`'s own) are untouched, so every later draw is the
    same. Only while the model is built: nothing else in the process sees the change."""
    from flax import nnx

    drawn = nnx.initializers.lecun_normal, nnx.initializers.normal
    nnx.initializers.lecun_normal = nnx.initializers.normal = lambda *_, **__: nnx.initializers.zeros_init()
    try:
        yield
    finally:
        nnx.initializers.lecun_normal, nnx.initializers.normal = drawn


def install() -> None:
    """Every change, in this process, before a model is built."""
    tied_head_reads_its_arguments()
    projections_multiply_in_bfloat16()
    embedding_rows_taken_as_bits()
    decoder_layers_scanned()
    tied_models_train_the_unembedding()
    no_forward_after_the_last_token()
    prefill_once_per_prompt()
    prompt_logprobs_in_chunks()
