"""SkyRL-tx's model code as every rank and the export's reference run it: a tied output head that reads the
weights it is given (point 23) and the decoder layers under one scan (point 24). Both leave every number the
model computes as it was (tests/test_scanned_layers.py); they change what XLA is asked to compile."""

from __future__ import annotations

import functools


def tied_head(embed):
    """The output head of a model that ties it to its embedding `embed` (a LoRAEmbed), with the embedding's
    LoRA (26.): logits = h (E + s A B)^T = h E^T + s (h B^T) A^T, for each example its own adapter's A (vocab x r),
    B (r x hidden) and scale s. The same matrix as the input side's `E[token] + s A[token] B`: an adapter that
    trains the unembedding of a tied model trains the one matrix both ends share, which is what its merged
    model holds. Upstream's `LoRAEmbed.T` drops the adapter.

    Every adapter slot's LoRA in one product, each example's other slots masked to zero (a gather of A per
    example would be vocab x r per token); computed only when an example's adapter trains the embedding (a
    nonzero scale), so the programs of adapters that do not pay nothing for it."""
    import jax
    import jax.numpy as jnp

    def head(hidden_states, adapter_indices=None):
        logits = hidden_states @ embed.embedding[...].T
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
    """The tied output head multiplies by the embedding of the model it is called on (23.), with its LoRA (26.).

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
    """A decoder stack's `__call__` that runs its layers under `jax.lax.scan` (24.), or upstream's loop where a
    scan cannot serve: every layer's hidden state asked for, or layers of different structure."""

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
        if wants_hidden or any(other != graphdef for other, _ in layers[1:]):
            return upstream_call(self, input_ids, attention_mask=attention_mask, positions=positions,
                                 output_hidden_states=output_hidden_states, adapter_indices=adapter_indices,
                                 kv_cache=kv_cache)
        # The layers' weights stacked along a new first axis, inside the program: the engine's state keeps
        # upstream's per-layer layout, which its checkpoints, its LoRA slots and txflow's exports address.
        weights = jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *(state for _, state in layers))
        cache = None if kv_cache is None else (jnp.stack(kv_cache.keys), jnp.stack(kv_cache.values))

        def layer_step(hidden, weights_and_cache):
            layer_weights, layer_cache = weights_and_cache
            hidden, (keys, values) = nnx.merge(graphdef, layer_weights)(
                hidden, attention_mask=attention_mask, positions=positions, adapter_indices=adapter_indices,
                kv_cache=layer_cache)
            return hidden, (keys, values)

        hidden = self.embed_tokens(input_ids, adapter_indices=adapter_indices)
        hidden, (keys, values) = jax.lax.scan(layer_step, hidden, (weights, cache))
        return ModelOutput(last_hidden_state=self.norm(hidden),
                           kv_cache=KVCache.update(kv_cache, list(keys), list(values), positions, attention_mask),
                           hidden_states=None)

    __call__.upstream = upstream_call
    return __call__


def decoder_layers_scanned() -> None:
    """The Llama and Qwen3 decoder stacks compile one layer and loop over it (24.).

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
    """`init_lora_adapter` initialises the embedding's LoRA of a tied model for `train_unembed` (26.).

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


def install() -> None:
    """Every change, in this process, before a model is built."""
    tied_head_reads_its_arguments()
    decoder_layers_scanned()
    tied_models_train_the_unembedding()
