"""Rows that share a prompt are computed once per batch (`packed-prefixes`).

An RL step trains each prompt's group of samples: for the nightly, 8 prompts of SmolLM2's arithmetic task x 4 samples
of 4 tokens. Each prompt is 72-74 tokens, of which the first 54 (the chat template's system prompt and a few-shot
turn) are the same for every prompt. Upstream computes every row of a forward_backward whole, so such a step computed
again what the row before it had computed. Here the rows of a micro-batch (of the same adapter) are packed as a
prefix tree into one row: every token that rows share at the same depth once (the few-shot prefix once, each prompt's
own tokens once, each sample's own tokens), with each token at its position in its original row and an attention
mask under which a token sees its own row's earlier tokens only (its ancestors in the tree). The output head runs
once per distinct (packed position, target token): rows that share a position share its target too, except where
their next tokens part, so the 49k-vocabulary logits cost about as much as the packed tokens, not as every original
row's padded positions (3072 for the nightly, against 384 asked). Each original position's logprob is gathered back,
and the losses and their gradients are computed on them as upstream computes them: the same function of the weights
(the gradient of a shared position is the sum over the rows that read it, which the gather's transpose adds up), in
fewer FLOPs. Same figures in float32 (tests/test_packing.py); on SmolLM2 in bfloat16 the nightly step's logprobs are
identical and its gradients within 5e-5 (relative, summed over every parameter).

A batch of more rows than a micro-batch (`train_micro_batch_size`, 8 in a run: it bounds a pass's memory) runs as one
micro-batch when packed it computes no more tokens and no more head positions than one micro-batch of upstream's
would: the nightly's 32 rollouts are one pass over one row of 384, where 4 micro-batches of 8 computed the few-shot
prefix 4 times.

Only for a micro-batch that packing halves at least, in a single-process, single-device engine (a sharded batch is
split over the devices by rows); any other batch runs upstream's program. Rows of chat share their template's
opening too (SmolLM2's default system prompt and the user turn's start: 27 tokens), so an SFT batch of short
conversations is packed as well: the demo's 4 rows of ~52 tokens are one row of 128. Can go when upstream shares a
prompt's computation across its samples in training."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

# A prefix shorter than this is not worth a packed row: its mask and gathers cost more than the tokens saved.
MIN_SHARED = 16
# A packed row may grow to twice its rows' width, and at least this far: the nightly RL step's 8 prompts x 4 samples
# (a few-shot prefix of 54 tokens, ~20 more for each prompt, 4 sampled tokens a row) fit in one row of 384 (32 of 96
# unpacked); attention over 512 positions still costs less than the layers over them.
MIN_CAP = 512


@dataclass(frozen=True)
class Plan:
    """How a micro-batch's rows are packed: `rows` packed rows (a power of two, the last ones empty) of `length`
    tokens, and where each original row's positions are found in them."""

    ids: np.ndarray  # (packed rows, length) token ids
    positions: np.ndarray  # (packed rows, length) each token's position in its original row
    mask: np.ndarray  # (packed rows, length, length) which packed position attends to which
    adapters: np.ndarray  # (packed rows,) the adapter of each packed row
    source_rows: np.ndarray  # (rows,) the packed row of each original row
    source_columns: np.ndarray  # (rows, width) where each original position is in its packed row

    @property
    def rows(self) -> int:
        return len(self.ids)

    @property
    def length(self) -> int:
        return self.ids.shape[1]


@dataclass(frozen=True)
class Queries:
    """The logprobs a packed micro-batch computes: each distinct (packed position, target token) once. Rows that
    share a position mostly share its target too (the next token of a prefix they share), so the 49k-vocabulary
    head runs over about as many positions as the packed rows hold tokens, not over every original row's."""

    nodes: np.ndarray  # (queries,) a packed position, as an index into the packed rows flattened
    targets: np.ndarray  # (queries,) its target token
    adapters: np.ndarray  # (queries,) the adapter of its packed row
    inverse: np.ndarray  # (rows, width) the query of each original position

    @property
    def count(self) -> int:
        return len(self.nodes)


class Tree:
    """One packed row: the tokens of its rows as a prefix tree, each token once, in the order they were added (a
    token's parent always before it). A row is the path from a root to one of its tokens."""

    def __init__(self, adapter: int) -> None:
        self.adapter = adapter
        self.tokens: list[int] = []
        self.parents: list[int] = []  # -1: a token that starts a row
        self.depths: list[int] = []
        self.children: dict[tuple[int, int], int] = {}  # (parent, token) -> its node

    def shared(self, row: np.ndarray) -> int:
        """How many leading tokens of `row` the tree holds already."""
        node = -1
        for depth, token in enumerate(row.tolist()):
            node = self.children.get((node, token), -2)
            if node == -2:
                return depth
        return len(row)

    def add(self, row: np.ndarray) -> list[int]:
        """The nodes of `row`'s tokens, the ones the tree lacked added."""
        path, node = [], -1
        for depth, token in enumerate(row.tolist()):
            child = self.children.get((node, token))
            if child is None:
                child = self.children[(node, token)] = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(depth)
            path.append(node := child)
        return path


def plan_for(rows: list[np.ndarray], adapters: list[int], width: int) -> Plan | None:
    """The packing of a micro-batch's `rows` (each its real tokens, unpadded; upstream pads them to `width`), or
    None when it would not halve the tokens computed. Each packed row is a prefix tree of rows of one adapter: a row
    joins the packed row that holds the longest start of it (at least MIN_SHARED tokens) while that row stays within
    max(2 x `width`, MIN_CAP) tokens (attention grows with its square), so that what rows share at any depth is
    computed once: a few-shot prefix shared by every prompt, each prompt shared by its samples. Packed rows are padded
    to one of upstream's length buckets, and their count to a power of two (each shape is a program)."""
    from tx.utils.models import round_up_seq_len

    cap = max(2 * width, MIN_CAP)
    trees: list[Tree] = []
    paths: list[tuple[int, list[int]]] = []  # each row's packed row and the nodes of its tokens
    for row, adapter in zip(rows, adapters):
        held = [(tree.shared(row), t) for t, tree in enumerate(trees) if tree.adapter == adapter]
        shared, best = max(((n, t) for n, t in held if len(trees[t].tokens) + len(row) - n <= cap), default=(0, -1))
        if shared < MIN_SHARED:
            trees.append(Tree(int(adapter)))
            best = len(trees) - 1
        paths.append((best, trees[best].add(row)))
    packed = 1 << (len(trees) - 1).bit_length()
    length = round_up_seq_len(max(len(tree.tokens) for tree in trees))
    if 2 * packed * length > len(rows) * width:
        return None
    ids = np.zeros((packed, length), np.int32)
    positions = np.zeros((packed, length), np.int32)
    # Every position sees itself, so that a padding position's softmax has a term (its output is never read).
    mask = np.broadcast_to(np.eye(length, dtype=bool), (packed, length, length)).copy()
    adapter_of = np.full(packed, trees[0].adapter, np.int32)
    for p, tree in enumerate(trees):
        n = len(tree.tokens)
        ids[p, :n], positions[p, :n], adapter_of[p] = tree.tokens, tree.depths, tree.adapter
        for node, parent in enumerate(tree.parents):  # a token sees its ancestors: its row's earlier tokens
            if parent >= 0:
                mask[p, node] |= mask[p, parent]
    source_rows = np.array([p for p, _ in paths], np.int32)
    # upstream's padding of a row (to `width`) reads column 0: it has no weight and is not returned
    source_columns = np.zeros((len(rows), width), np.int32)
    for i, (_, path) in enumerate(paths):
        source_columns[i, :len(path)] = path
    return Plan(ids, positions, mask, adapter_of, source_rows, source_columns)


def queries_for(plan: Plan, target_ids) -> Queries:
    """The distinct (packed position, target) pairs of a micro-batch's original positions, padding included (one
    pair per packed row: column 0 with upstream's padded target 0; its logprob is never read), their count padded
    to one of upstream's length buckets (each count is a program)."""
    from tx.utils.models import round_up_seq_len

    flat = plan.source_rows[:, None] * plan.length + plan.source_columns
    pairs = np.stack([flat.ravel(), np.asarray(target_ids, np.int64).ravel()], axis=1)
    distinct, inverse = np.unique(pairs, axis=0, return_inverse=True)
    count = round_up_seq_len(len(distinct))
    nodes, targets = np.zeros(count, np.int32), np.zeros(count, np.int32)
    nodes[:len(distinct)], targets[:len(distinct)] = distinct[:, 0], distinct[:, 1]
    return Queries(nodes, targets, plan.adapters[nodes // plan.length], inverse.reshape(flat.shape).astype(np.int32))


def micro_batch_plan(input_ids, attention_mask, adapter_indices) -> Plan | None:
    """The plan of a micro-batch as upstream hands it to its program (padded arrays on the device)."""
    ids, lengths = np.asarray(input_ids), np.asarray(attention_mask).sum(axis=1)
    return plan_for([ids[i, :n] for i, n in enumerate(lengths)], list(np.asarray(adapter_indices)), ids.shape[1])


def attention_reads_a_packed_mask() -> None:
    """Llama's and Qwen3's attention take a mask of one row per query position (`packed-prefixes`), which a packed
    batch passes instead of upstream's padding mask; every other call is upstream's."""
    import jax
    from tx.models import llama3, qwen3

    for module in (llama3, qwen3):
        upstream = module.dot_product_attention
        if hasattr(upstream, "upstream"):
            continue

        def dot_product_attention(q, k, v, attention_mask, is_causal, head_dim, upstream=upstream):
            if attention_mask.ndim == 3:
                return jax.nn.dot_product_attention(q, k, v, scale=1.0 / head_dim**0.5,
                                                    mask=attention_mask[:, None].astype(bool))
            return upstream(q, k, v, attention_mask, is_causal, head_dim)

        dot_product_attention.upstream = upstream
        module.dot_product_attention = dot_product_attention


def packed_program(graphdef, checkpointed: bool, backward: bool):
    """Upstream's forward_backward (or forward) program on a packed micro-batch: the model over the packed rows,
    each original row's hidden states gathered back, then upstream's logprobs, losses and gradient sum on them
    (`JaxBackendImpl._create_loss_and_grad_fn`, whose steps this repeats: they are closures there)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tx.tinker.loss_fns import LOSS_FUNCTIONS

    def target_logprobs(lora, rest, packed_ids, packed_mask, packed_positions, packed_adapters, query_nodes,
                        query_targets, query_adapters, inverse):
        model = nnx.merge(graphdef, lora, rest)
        hidden = model(packed_ids, attention_mask=packed_mask, positions=packed_positions,
                       adapter_indices=packed_adapters).last_hidden_state
        asked = hidden.reshape(-1, hidden.shape[-1])[query_nodes]
        # upstream's logprobs, one query per row of one position: each query's own adapter for a LoRA on the head
        logprobs = model.compute_logprobs(asked[:, None], query_targets[:, None], query_adapters)[:, 0]
        return logprobs[inverse]

    if checkpointed:
        target_logprobs = jax.checkpoint(target_logprobs, policy=None)

    def loss(lora, rest, plan, adapter_indices, target_ids, loss_mask, loss_fn_types, sampling_logprobs,
             advantages):
        logprobs = target_logprobs(lora, rest, *plan)  # the targets are the queries'; `target_ids` is upstream's
        per_token = jax.vmap(lambda kind, *args: jax.lax.switch(kind, LOSS_FUNCTIONS, *args))(
            loss_fn_types, logprobs, loss_mask, sampling_logprobs, advantages)
        per_row = per_token.sum(axis=-1) / jnp.maximum(loss_mask.sum(axis=-1), 1e-9)
        return per_row.sum(), (logprobs, per_token)

    def run(accumulated, lora, rest, plan, adapter_indices, *batch):
        if not backward:
            _, (logprobs, per_token) = loss(lora, rest, plan, adapter_indices, *batch)
            return accumulated, per_token, logprobs
        (_, (logprobs, per_token)), grads = jax.value_and_grad(loss, has_aux=True)(lora, rest, plan,
                                                                                 adapter_indices, *batch)
        return accumulated.add(grads, adapter_indices), per_token, logprobs

    return jax.jit(run, donate_argnums=(0,) if backward else ())


class PackingPass:
    """A model-pass program of upstream's engine that runs a micro-batch packed when its plan says so."""

    def __init__(self, engine, upstream, backward: bool):
        self.engine, self.upstream, self.backward = engine, upstream, backward

    @functools.cached_property
    def packed(self):
        return packed_program(self.engine.graphdef, self.engine.config.gradient_checkpointing, self.backward)

    def __call__(self, accumulated, lora, rest, input_ids, attention_mask, adapter_indices, target_ids, *batch):
        plan = micro_batch_plan(input_ids, attention_mask, adapter_indices) if packs(self.engine) else None
        if plan is None:
            return self.upstream(accumulated, lora, rest, input_ids, attention_mask, adapter_indices, target_ids,
                                 *batch)
        queries = queries_for(plan, target_ids)
        arrays = (plan.ids, plan.mask, plan.positions, plan.adapters, queries.nodes, queries.targets, queries.adapters,
                  queries.inverse)
        return self.packed(accumulated, lora, rest, arrays, adapter_indices, target_ids, *batch)


def packs(engine) -> bool:
    """Whether the engine packs micro-batches at all: one process, one device, its programs compiled."""
    import jax

    return jax.process_count() == 1 and engine.mesh.size == 1 and not engine.config.enforce_eager


def installed_and_packs(engine) -> bool:
    """Whether this engine's model passes are `PackingPass`es (whatever wraps them since, `ranks.OneSlotPass`) and
    it packs at all."""
    return getattr(engine, "_txflow_packing_passes", False) and packs(engine)


def shapes_of(engine, rows: list[list[int]], targets: list[list[int]], adapters: list[int], length: int) -> tuple:
    """What a micro-batch's program is compiled for (`compile-log`): its row count, and when packed its packed rows,
    their length and its logprob queries."""
    from tx.tinker.backends.utils import pad_batch

    plan = plan_for([np.asarray(r) for r in rows], adapters, length) if installed_and_packs(engine) else None
    if plan is None:
        return (len(rows),)
    return len(rows), "packed", plan.rows, plan.length, queries_for(plan, pad_batch(targets, length, np.int32)).count


def adapters_of(engine, model_ids: list[str]) -> list[int]:
    """Each row's adapter slot, by its model (0, the base model's, for a model the engine does not hold)."""
    return [getattr(engine.models.get(m), "adapter_index", 0) for m in model_ids]


def whole_batch_packs(engine, batch) -> bool:
    """Whether a batch of more rows than one micro-batch (`train_micro_batch_size`, which bounds a pass's memory)
    packs into one that computes no more than a micro-batch of upstream's would: its packed tokens and its head's
    queries each within that many rows of the batch's length. The nightly's 32 rollouts are one packed row of 384
    tokens, where 4 micro-batches of 8 would compute the few-shot prefix 4 times."""
    from tx.tinker.backends.jax import round_up_seq_len
    from tx.tinker.backends.utils import pad_batch

    rows, micro = batch.all_input_ids, engine.config.train_micro_batch_size
    if not 0 < micro < len(rows) or not installed_and_packs(engine):
        return False
    length = round_up_seq_len(max(len(row) for row in rows))
    adapters = adapters_of(engine, batch.all_model_ids)
    plan = plan_for([np.asarray(row) for row in rows], adapters, length)
    budget = micro * length
    return plan is not None and plan.rows * plan.length <= budget \
        and queries_for(plan, pad_batch(batch.all_targets, length, np.int32)).count <= budget


def model_passes_pack_shared_prefixes() -> None:
    """The engine's forward_backward and forward programs pack rows that share a prefix (`packed-prefixes`), a
    whole batch at once where packed it fits one micro-batch."""
    from tx.tinker.backends.jax import JaxBackendImpl

    attention_reads_a_packed_mask()
    upstream = JaxBackendImpl._create_loss_and_grad_fn
    if hasattr(upstream, "upstream"):
        return
    upstream_pass, upstream_micro = JaxBackendImpl._model_pass, JaxBackendImpl._micro_batch_size

    @functools.wraps(upstream_pass)
    def _model_pass(self, prepared_batch, model_pass_fn):
        self._txflow_whole_batch = whole_batch_packs(self, prepared_batch)
        try:
            return upstream_pass(self, prepared_batch, model_pass_fn)
        finally:
            self._txflow_whole_batch = False

    @functools.wraps(upstream_micro)
    def _micro_batch_size(self, total: int) -> int:
        return total if getattr(self, "_txflow_whole_batch", False) else upstream_micro(self, total)

    _model_pass.upstream, _micro_batch_size.upstream = upstream_pass, upstream_micro
    JaxBackendImpl._model_pass, JaxBackendImpl._micro_batch_size = _model_pass, _micro_batch_size

    @functools.wraps(upstream)
    def _create_loss_and_grad_fn(self):
        upstream(self)
        self._forward_backward_and_accumulate = PackingPass(self, self._forward_backward_and_accumulate, True)
        self._forward = PackingPass(self, self._forward, False)
        self._txflow_packing_passes = True

    _create_loss_and_grad_fn.upstream = upstream
    JaxBackendImpl._create_loss_and_grad_fn = _create_loss_and_grad_fn
