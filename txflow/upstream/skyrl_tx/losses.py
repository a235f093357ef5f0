"""The `tinker-losses` change: Tinker's training losses, as Tinker documents them.

SkyRL-tx 0.3.0 serves three losses (cross_entropy, importance_sampling, ppo, whose clip is hard-coded at
0.8-1.2: `loss_fn_config` reaches the backend and nothing reads it), and computes each one as a mean: a
sequence's loss is divided by the sum of its weights, the accumulated gradient by the number of
sequences. Tinker documents every loss as a sum over tokens and sequences, takes clip thresholds and
beta in `loss_fn_config`, and serves cispo, dro and gspo too. `forward_backward_custom` needs the sum:
its second pass is cross_entropy with weights -dL/dlogprob, of either sign, which upstream's division
scales by an arbitrary factor per sequence (by 1e9 where the weights sum to zero or less).

In the engine and every worker (`install_backend`, before the backend exists): the loss table holds
Tinker's losses, one entry per loss and configuration a client used, so a configuration reaches the
compiled program as constants (a new one compiles once, on every rank alike); a sequence's loss is the
sum over its tokens and `optim_step` applies the sum of the accumulated gradients; every forward and
forward_backward result carries the `loss:sum` metric the SDKs read. In the API (`install_api`): a loss
or a configuration this cluster does not serve is refused with one line before it is queued (an unknown
name in the database would stop the engine). Can go when upstream serves Tinker's losses as sums
(`skyrl` 0.4.0 has cispo and configurable clips, and still divides by the weights).

The losses, per token, with r = exp(target_logprob - sampling_logprob) and A the advantage; a token
counts where its weight is not zero (SkyRL-tx gives every token weight 1 when the client sends none):

- cross_entropy: -w * logprob
- importance_sampling: -r * A
- ppo: -min(r * A, clip(r, low, high) * A); `clip_low_threshold` 0.8, `clip_high_threshold` 1.2
- cispo: -sg(clip(r, low, high)) * logprob * A; thresholds 0.0 and 4.0 (Tinker's tutorial 202)
- dro: -(logprob * A - beta / 2 * (logprob - sampling_logprob)^2); `beta` has no documented default, so
  it is required. Deliberately unlike Tinker's page, whose penalty runs over all N tokens, the penalty
  applies to the sampled tokens only: a prompt token's "sampling logprob" is the 0.0 the SDKs and the
  cookbook put there, not a logprob, and the page's penalty on it, beta / 2 * logprob^2, would train the
  model to predict the prompt. A client sees a `loss:sum` lower than the page's by beta / 2 times the sum
  of the prompt tokens' squared logprobs, and no gradient on them (tests/test_losses.py shows both).
- gspo (GSPO-token): every token carries the sequence ratio s = exp(mean over the sampled tokens of
  sg(logprob) - sampling_logprob) with its own logprob's gradient, -min(s_t * A, clip(s_t, low, high) * A);
  thresholds 0.8 and 1.2 (Tinker's page gives no default; PPO's). Tinker takes the sampled tokens from
  a `sequence_ratio_mask` input that SkyRL-tx cannot carry to the engine: a mask that marks other tokens
  than those is refused.

The sampled tokens (gspo's ratio, dro's penalty) are those with a weight and a sampling logprob or an
advantage: a prompt token has neither (the SDKs send 0.0 for both). A sampling logprob of 0.0 alone does
not make a prompt token: a bf16 model returns exactly 0.0 for a token it samples with p > ~0.97.
Only a sampled token with neither is taken for a prompt token, and such a token moves neither loss: no
advantage, and a penalty of (logprob - 0)^2 where the sampler was certain.

A token's loss is multiplied by its weight (cross_entropy's page; for the RL losses, whose pages take no
weights, the SDKs send none and SkyRL-tx gives every token weight 1, so a client's own weights scale its
tokens).
- stable_reinforce needs what the sampler records per sequence (`record_stability_info`), and Tinker
  documents neither that nor the objective: refused, with the losses there are.
"""

from __future__ import annotations

import json
from typing import Literal

SERVED = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
CLIP = ("clip_low_threshold", "clip_high_threshold")
CONFIG_KEYS = {"cross_entropy": (), "importance_sampling": (), "ppo": CLIP, "cispo": CLIP, "gspo": CLIP,
               "dro": ("beta",)}
DEFAULTS = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
            "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}}
ROUTES = ("/api/v1/forward_backward", "/api/v1/forward")


# --- what a request may ask for ---------------------------------------------------------------------------


def problem(loss_fn: str, config: dict | None) -> str | None:
    """Why this cluster cannot train with `loss_fn` and `config`, in one line; None when it can."""
    served = ", ".join(SERVED)
    if loss_fn == "stable_reinforce":
        return ("loss_fn 'stable_reinforce' is not served: it needs what Tinker's sampler records per sequence "
                "(record_stability_info), and neither that nor its objective is documented. This cluster serves "
                f"{served}; the Tinker cookbook takes loss_fn=importance_sampling (or another of them)")
    if loss_fn not in SERVED:
        return f"loss_fn {loss_fn!r} is not served; this cluster serves {served}"
    config = config or {}
    allowed = CONFIG_KEYS[loss_fn]
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        takes = f"takes {', '.join(allowed)}" if allowed else "takes no loss_fn_config"
        return f"loss_fn_config {', '.join(map(repr, unknown))} does not apply to {loss_fn}, which {takes}"
    if any(not isinstance(v, int | float) or v != v for v in config.values()):
        return f"loss_fn_config of {loss_fn} takes numbers, got {config}"
    if loss_fn == "dro" and "beta" not in config:
        return "loss_fn 'dro' needs loss_fn_config={'beta': ...}: Tinker documents no default"
    if loss_fn == "dro" and config["beta"] < 0:
        return f"dro's beta must be at least 0, got {config['beta']}"
    if allowed == CLIP:
        low, high = resolved(loss_fn, config)[1:]
        if not 0 <= low <= 1 <= high:
            return (f"{loss_fn}'s clip thresholds are bounds on the probability ratio, 0 <= clip_low_threshold <= 1 "
                    f"<= clip_high_threshold; got {low} and {high}")
    return None


def resolved(loss_fn: str, config: dict | None) -> tuple:
    """The loss and its parameters with Tinker's defaults filled in: the key of one entry of the loss table."""
    values = {**DEFAULTS.get(loss_fn, {}), **(config or {})}
    return (loss_fn, *(float(values[k]) for k in CONFIG_KEYS[loss_fn]))


def sampled_tokens(weights: list[float], sampling_logprobs: list[float], advantages: list[float]) -> list[bool]:
    """The tokens gspo's ratio and dro's penalty run over: with a weight, and a sampling logprob or an
    advantage (see the docstring: not the sampling logprob alone)."""
    return [w != 0 and (lp != 0 or a != 0) for w, lp, a in zip(weights, sampling_logprobs, advantages)]


def datum_problem(loss_fn: str, inputs: dict) -> str | None:
    """A gspo datum whose `sequence_ratio_mask` marks other tokens than the sampled ones (see the docstring)."""
    mask = inputs.get("sequence_ratio_mask")
    if loss_fn != "gspo" or mask is None:
        return None
    n = len(inputs["target_tokens"])
    weights, logprobs = inputs.get("weights") or [1.0] * n, inputs.get("logprobs") or [0.0] * n
    if [m != 0 for m in mask] != sampled_tokens(weights, logprobs, inputs.get("advantages") or [0.0] * n):
        return ("gspo's sequence_ratio_mask must mark exactly the sampled tokens (those with a weight, and a sampling "
                "logprob or an advantage): this cluster computes the sequence ratio over them, and cannot take "
                "another mask")
    return None


# --- the API: refuse what cannot be served, before it is queued ---------------------------------------------


def install_api(app) -> None:
    """Accept the names in upstream's request models, and check every forward and forward_backward request
    first (in front of every route, so it holds for upstream's routes and the SDK shims alike)."""
    from tx.tinker import api, types

    names = Literal[SERVED]  # type: ignore[valid-type]
    for model in (types.ForwardBackwardInput, api.ForwardBackwardInput):
        model.model_fields["loss_fn"].annotation = names
        model.model_rebuild(force=True)
    for model in (api.ForwardBackwardRequest, api.ForwardRequest):
        model.model_rebuild(force=True)
    _reregister(app, api)
    app.add_middleware(LossCheck)


class LossCheck:
    """ASGI middleware: a forward or forward_backward request with a loss or configuration this cluster does
    not serve gets 400 with one line; every other request passes untouched (no cost but a path check)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTES:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        reason = _request_problem(scope, body)
        if reason:
            payload = json.dumps({"detail": reason}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            return await send({"type": "http.response.body", "body": payload})
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


def _request_problem(scope, body: bytes) -> str | None:
    from txflow.upstream.skyrl_tx import tinker_compat

    headers = dict(scope.get("headers") or [])
    try:
        if headers.get(b"content-type", b"").split(b";")[0].strip().lower() == tinker_compat.PROTO.encode():
            found = tinker_compat.parse_forward_backward(body)[0]["forward_backward_input"]
        else:
            payload = json.loads(body)
            found = payload.get("forward_backward_input") or payload.get("forward_input")
    except (ValueError, AttributeError):
        return None  # unreadable: the route itself says so
    if not isinstance(found, dict) or not isinstance(found.get("loss_fn"), str):
        return None  # the route's own validation names what is missing
    loss_fn = found["loss_fn"]
    reason = problem(loss_fn, found.get("loss_fn_config"))
    for datum in found.get("data") or []:
        if reason or not isinstance(datum, dict):
            break
        inputs = {k: (v.get("data") if isinstance(v, dict) else v)
                  for k, v in (datum.get("loss_fn_inputs") or {}).items()}
        reason = datum_problem(loss_fn, inputs)
    return reason


def _reregister(app, api) -> None:
    """FastAPI builds a route's body validator when the route is added: add upstream's routes again so that
    they validate against the rebuilt models (the SDK shims validate when called)."""
    from fastapi.routing import APIRoute

    for route in [r for r in app.router.routes if isinstance(r, APIRoute) and r.path in ROUTES]:
        if route.endpoint in (api.forward_backward, api.forward):
            app.router.routes.remove(route)
            app.add_api_route(route.path, route.endpoint, methods=list(route.methods),
                              response_model=route.response_model)


# --- the engine and every worker -----------------------------------------------------------------------------


def install_backend() -> None:
    """In each rank process, before the backend is created: Tinker's losses and sums (see the docstring)."""
    from tx.tinker import loss_fns, types
    from tx.tinker.backends import jax as backend

    types.LOSS_TYPES.clear()  # the engine maps a request's loss to its index through this same dict
    types.LOSS_TYPES.update({name: index for index, name in enumerate(SERVED)})
    types.ForwardBackwardInput.model_fields["loss_fn"].annotation = Literal[SERVED]  # type: ignore[valid-type]
    types.ForwardBackwardInput.model_rebuild(force=True)
    # The backend's switch reads this very list when it compiles: one entry per (loss, configuration), the
    # first ones at the index the engine gives each name (dro's only holds its place: it has no default).
    loss_fns.LOSS_FUNCTIONS[:] = [summed(loss_function(key or ("dro", 0.0))) for key in _INITIAL]
    backend.AccumulatedGradients.get_mean = _gradient_sum
    upstream = backend.JaxBackendImpl._model_pass

    def _model_pass(self, prepared_batch, model_pass_fn):
        forward_only = model_pass_fn is getattr(self, "_forward", None)
        batch = prepared_batch.model_copy(update={"all_loss_fn_types": _table_indices(self, prepared_batch)})
        if len(loss_fns.LOSS_FUNCTIONS) != getattr(self, "_txflow_compiled_losses", len(SERVED)):
            self._create_loss_and_grad_fn()  # a new configuration: compile the switch with it
            self._txflow_compiled_losses = len(loss_fns.LOSS_FUNCTIONS)
            model_pass_fn = self._forward if forward_only else self._forward_backward_and_accumulate
        return _sums_and_metrics(upstream(self, batch, model_pass_fn), prepared_batch)

    backend.JaxBackendImpl._model_pass = _model_pass


def _table_indices(backend, batch) -> list[int]:
    """Each example's entry in the loss table, registering the configurations seen for the first time. Every
    rank sees the same batches in the same order, so every rank builds the same table."""
    from tx.tinker import loss_fns

    table = backend.__dict__.setdefault("_txflow_losses", {key: i for i, key in enumerate(_INITIAL) if key})
    indices = []
    for loss_type, config in zip(batch.all_loss_fn_types, batch.all_loss_fn_configs):
        key = resolved(SERVED[loss_type], config)
        if key not in table:
            loss_fns.LOSS_FUNCTIONS.append(summed(loss_function(key)))
            table[key] = len(loss_fns.LOSS_FUNCTIONS) - 1
        indices.append(table[key])
    return indices


_INITIAL = [None if name == "dro" else resolved(name, None) for name in SERVED]


def _sums_and_metrics(results: dict, batch) -> dict:
    """The `loss:sum` metric of each request: the sum of its per-token losses, as the device computed them
    (`summed` leaves their values alone, so the host applies no scale of its own)."""
    for request_id, *_ in batch.request_batch_slices:
        result = results.get(request_id)
        if result is None or not hasattr(result, "loss_fn_outputs"):
            continue
        result.metrics["loss:sum"] = sum(sum(output["elementwise_loss"]["data"]) for output in result.loss_fn_outputs)
    return results


def _gradient_sum(self, adapter_index):
    """`optim_step` applies the sum of the gradients accumulated since the last one (not their mean)."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda g: jnp.zeros_like(g).at[adapter_index].set(g[adapter_index]), self.grad_sum)


def summed(loss):
    """`loss` with its gradient scaled so that upstream's division of each sequence's loss by the sum of its
    weights gives back the gradient of the plain sum. Its values stay the loss's own: they are the per-token
    losses the client gets, and a scale the host divided out again would be computed twice, in two dtypes
    (float32 here, float64 there), which differ by orders of magnitude where weights nearly cancel."""
    import jax
    import jax.numpy as jnp

    def entry(target_logprobs, weights, sampling_logprobs, advantages):
        value = loss(target_logprobs, weights, sampling_logprobs, advantages)
        # The same float32 expression as upstream's divisor, on the same weights: the factors cancel.
        scale = jnp.maximum(weights.sum(), 1e-9)
        return jax.lax.stop_gradient(value) + (value - jax.lax.stop_gradient(value)) * scale

    return entry


def loss_function(key: tuple):
    """The per-token loss of one table entry, (loss, parameters...) as `resolved` gives it."""
    import jax
    import jax.numpy as jnp

    name, *parameters = key
    sg = jax.lax.stop_gradient

    def counted(x, weights):  # upstream's safe_loss_mask: only tokens with a weight count
        return jnp.where(weights != 0, weights * x, jnp.zeros_like(x))

    def sampled(weights, sampling_logprobs, advantages):  # see `sampled_tokens`
        return (weights != 0) & ((sampling_logprobs != 0) | (advantages != 0))

    if name == "cross_entropy":
        return lambda tlp, w, slp, adv: -counted(tlp, w)
    if name == "importance_sampling":
        return lambda tlp, w, slp, adv: -counted(jnp.exp(tlp - slp) * adv, w)
    if name == "dro":
        (beta,) = parameters
        return lambda tlp, w, slp, adv: -counted(
            tlp * adv - jnp.where(sampled(w, slp, adv), 0.5 * beta * (tlp - slp) ** 2, 0.0), w)
    low, high = parameters
    if name == "ppo":
        def ppo(tlp, w, slp, adv):
            ratio = jnp.exp(tlp - slp)
            return -counted(jnp.minimum(ratio * adv, jnp.clip(ratio, low, high) * adv), w)
        return ppo
    if name == "cispo":
        return lambda tlp, w, slp, adv: -counted(sg(jnp.clip(jnp.exp(tlp - slp), low, high)) * tlp * adv, w)
    if name == "gspo":
        def gspo(tlp, w, slp, adv):
            mask = sampled(w, slp, adv)
            log_ratio = jnp.where(mask, sg(tlp) - slp, 0.0).sum() / jnp.maximum(mask.sum(), 1)
            ratio = jnp.exp(log_ratio + tlp - sg(tlp))
            return -counted(jnp.minimum(ratio * adv, jnp.clip(ratio, low, high) * adv), w)
        return gspo
    raise ValueError(f"no loss {name!r}")
