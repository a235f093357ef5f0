"""SkyRL-tx's model code as every rank and the export's reference run it: a tied output head that reads the
weights it is given (point 23) and the decoder layers under one scan (point 24). Both leave every number the
model computes as it was (tests/test_scanned_layers.py); they change what XLA is asked to compile."""

from __future__ import annotations


def tied_head_reads_its_arguments() -> None:
    """The tied output head multiplies by the embedding of the model it is called on (23.).

    Upstream stores `self.lm_head = self.model.embed_tokens.T` at construction: a lambda bound to the
    embedding module the model was built with. A jitted program rebuilds the model from its arguments
    (`nnx.merge`), but that lambda still reads the original module's concrete array, so XLA received the
    49,152 x 576 embedding as a constant and folded it ("slow_operation_alarm: Constant folding ...
    f32[576,49152]") into every program that computes logits. Can go when upstream resolves the head on
    the module it is called on."""
    from tx.models.llama3 import Llama3ForCausalLM
    from tx.models.qwen3 import Qwen3ForCausalLM

    def replacing(upstream_head):
        def get_lm_head(self):
            return self.model.embed_tokens.T if self.config.tie_word_embeddings else self.lm_head

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


def install() -> None:
    """Both changes, in this process, before a model is built."""
    tied_head_reads_its_arguments()
    decoder_layers_scanned()
